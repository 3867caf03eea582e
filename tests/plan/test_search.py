"""Acceptance of the search: what fits where, and why the rest is rejected."""

import re

from adapt.plan import layer_costs

import pytest

from adapt.profile.planner import Workload, make_cluster, search
from tests.plan.conftest import CONFIG_NAMES

RULE = re.compile(r"^(divisibility: (attention heads|KV heads|tp over KV heads|vocabulary|dense MLP|layers over pp|"
                  r"ep over|routed experts|expert intermediate|shared expert|ep=)|fp8 block alignment: |"
                  r"memory: needs [\d.]+ GB per device( \(stage \d+\))? > [\d.]+ GB usable .*largest term: "
                  r"(weights|kv|activations)$|slo: )")


def test_deepseek_v3_fp8_32k_fits_one_node_of_h200(spec_of):
    spec = spec_of("deepseek-ai__DeepSeek-V3")
    assert spec.weight_dtype == "float8_e4m3fn"
    res = search(spec, make_cluster("h200", nodes=1), Workload(context=32768))
    r = res.recommended
    assert r is not None and r.world_size == 8 and r.nodes == 1
    assert r.memory.total <= 141e9 * 0.9
    assert 85e9 < r.memory.weights < 110e9  # 671B FP8 + scales + bf16 embeddings over 8, dense parts replicated


def test_llama_405b_bf16_needs_two_nodes_of_h100_and_fp8_fits_one(spec_of):
    spec = spec_of("meta-llama__Llama-3.1-405B")
    one = search(spec, make_cluster("h100-sxm", nodes=1), Workload(context=8192))
    assert one.recommended is None
    assert all(r.rule == "memory" for r in one.rejected)
    assert "needs" in one.summary() and "largest term: weights" in one.summary()
    two = search(spec, make_cluster("h100-sxm", nodes=2), Workload(context=8192))
    assert two.recommended is not None and two.recommended.nodes == 2
    fp8 = search(spec, make_cluster("h100-sxm", max_nodes=2),
                 Workload(context=8192, weights_dtype="fp8", objective="min-devices"))
    assert fp8.recommended.nodes == 1 and fp8.recommended.world_size == 8


def test_kimi_k2_does_not_fit_one_node_of_h200_and_says_why(spec_of):
    res = search(spec_of("moonshotai__Kimi-K2-Instruct"), make_cluster("h200", nodes=1), Workload(context=32768))
    assert res.recommended is None
    m = re.search(r"needs ([\d.]+) GB per device > 126.9 GB usable", res.summary())
    assert m and float(m.group(1)) > 126.9


@pytest.mark.parametrize("stem", CONFIG_NAMES)
def test_every_rejection_names_its_rule(stem, spec_of):
    res = search(spec_of(stem), make_cluster("h100-sxm", max_nodes=4),
                 Workload(context=32768, concurrency=64, max_tpot_s=0.5))
    assert res.rejected
    for r in res.rejected:
        assert RULE.match(r.reason), (r.layout, r.reason)
        assert r.reason.startswith(r.rule)


def test_mla_kv_is_split_by_dp_not_tp(spec_of):
    spec = spec_of("deepseek-ai__DeepSeek-V3")
    res = search(spec, make_cluster("h200", nodes=1), Workload(context=32768, concurrency=8))
    by = {c.label: c for c in res.candidates}
    kv_tp8 = search(spec, make_cluster("h200", nodes=1), Workload(context=32768, concurrency=8))
    tp2dp4, tp1dp8 = by["tp2.pp1.ep8.dp4"], by["tp1.pp1.ep8.dp8"]
    assert tp2dp4.memory.kv == pytest.approx(2 * tp1dp8.memory.kv)  # 2 vs 1 sequences per rank: dp divides
    per_seq = 61 * (512 + 64) * 2 * 32768
    assert tp1dp8.memory.kv == per_seq  # one sequence per rank, the whole latent (tp does not split it)
    assert kv_tp8.recommended is not None


def test_gqa_kv_is_split_by_tp_up_to_the_kv_heads(spec_of):
    from adapt.profile.planner.estimate import memory
    from adapt.plan import balanced_stages

    spec = spec_of("meta-llama__Llama-3.1-8B")  # 8 KV heads
    w = Workload(context=8192, concurrency=4)
    kv = {tp: memory(spec, tp, 1, 1, balanced_stages(spec, 1), w).kv for tp in (1, 2, 4, 8)}
    assert kv[1] == 4 * 8192 * 32 * 8 * 256 * 2
    assert kv[2] == kv[1] / 2 and kv[8] == kv[1] / 8


def test_objectives_rank_differently(spec_of):
    spec = spec_of("Qwen__Qwen3-235B-A22B")
    c = make_cluster("h100-sxm", max_nodes=2)
    few = search(spec, c, Workload(objective="min-devices")).recommended
    fast = search(spec, c, Workload(objective="latency"))
    thr = search(spec, c, Workload(objective="throughput"))
    assert few.world_size == min(x.world_size for x in fast.candidates)
    assert fast.recommended.times.tpot_s == min(x.times.tpot_s for x in fast.candidates)
    assert thr.recommended.times.tokens_per_s == max(x.times.tokens_per_s for x in thr.candidates)


def test_slo_rejections(spec_of):
    res = search(spec_of("meta-llama__Llama-3.1-8B"), make_cluster("h100-sxm", nodes=1),
                 Workload(max_tpot_s=1e-6))
    assert res.recommended is None
    assert {r.rule for r in res.rejected} <= {"slo", "divisibility"}
    assert any("slo: est TPOT" in r.reason and "--max-tpot-s 1e-06" in r.reason for r in res.rejected)


def test_uneven_stages_balance(spec_of):
    spec = spec_of("deepseek-ai__DeepSeek-V3")  # 61 layers, the first 3 dense
    res = search(spec, make_cluster("h200", max_nodes=2), Workload())
    c = next(c for c in res.candidates if c.pp == 4)
    sizes = [b - a for a, b in c.layer_ranges]
    assert sum(sizes) == 61 and len(set(sizes)) > 1  # uneven: the dense first layers weigh less
    cost = layer_costs(spec)
    edge = spec.vocab_size * spec.hidden_size
    w = [sum(cost[a:b]) for a, b in c.layer_ranges]
    w[0] += edge
    w[-1] += edge
    assert max(w) / min(w) < 1.1
