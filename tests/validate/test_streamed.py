"""The layer-streamed reference: `adapt validate dump --stream` writes the goldens the ordinary dump writes
(logits and layer outputs bit for bit in float32 on every text family, greedy tokens identical), under a memory budget, refused before reading when the
budget cannot hold a layer, and a perturbed target fails at the same first divergence from either golden."""

from __future__ import annotations

import json

import pytest
import torch

from adapt.validate.golden import GoldenReference, dump_golden
from adapt.validate.stream_estimate import StreamBudgetError, estimate, layer_costs
from tests.fixtures.tiny import TEXT_FAMILIES, save_tiny

from .test_validate_cli import perturbed, report, run_cli

KW = dict(max_new_tokens=4, top_n=5, long_lengths=(64,))


def _same(a, b) -> list[str]:
    ga, gb = GoldenReference(a), GoldenReference(b)
    assert set(ga.tensors) == set(gb.tensors)
    return [k for k in ga.tensors if not torch.equal(ga.tensors[k], gb.tensors[k])]


def _same_generation(a: dict, b: dict, atol: float = 1e-6) -> None:
    """Identical greedy tokens and top-N ids; logprobs within ``atol``. The decode steps run transformers' decoder
    with its KV cache from the streamed layers, and transformers' own generate loop: the prefill logits are bit for
    bit equal, a decode step's may differ in the last float32 bits (transformers 5.25: up to ~2e-7 in a logprob)."""
    assert a["max_new_tokens"] == b["max_new_tokens"] and a["top_n"] == b["top_n"]
    for pa, pb in zip(a["prompts"], b["prompts"], strict=True):
        assert pa["tokens"] == pb["tokens"]
        for sa, sb in zip(pa["logprobs"], pb["logprobs"], strict=True):
            assert {t for t, _ in sa} == {t for t, _ in sb}
            da, db = dict(sa), dict(sb)
            assert max(abs(da[t] - db[t]) for t in da) <= atol, (sa, sb)


@pytest.mark.parametrize("family", TEXT_FAMILIES)
def test_streamed_dump_equals_the_ordinary_dump(family, tmp_path):
    _, m = save_tiny(family, tmp_path / "m")
    a = dump_golden(m, tmp_path / "a", **KW)
    b = dump_golden(m, tmp_path / "b", stream=True, **KW)
    assert _same(tmp_path / "a", tmp_path / "b") == []  # logits, every layer output, long rung: bit for bit
    _same_generation(a["generation"], b["generation"])
    assert a["layer_stats"] == b["layer_stats"]
    assert a["long_context"]["lengths"] == [64]
    st = b["streamed"]
    assert st["passes"] == 1 + 3 + 1  # prefill, 3 greedy steps, one long rung
    assert st["bytes_read"] > 0 and st["rss"]["peak_bytes"] > 0
    if "moe" in family or family in ("mixtral", "deepseek_v2", "deepseek_v3"):
        assert st["experts_per_layer"] and all(st["experts_per_layer"].values())


def test_chunked_experts_within_float32_rounding_same_tokens(tmp_path):
    """A budget that holds a layer but not its touched experts: experts run in chunks (transformers' eager
    loop), within 1e-6 of the grouped reference, the same greedy tokens; the record names the layers."""
    _, m = save_tiny("deepseek_v3", tmp_path / "m")
    a = dump_golden(m, tmp_path / "a", **KW)
    from adapt.spec import ModelSpec
    from adapt.layout import WeightLayout
    from adapt.source import read_config

    costs = layer_costs(WeightLayout.from_spec(ModelSpec.from_hf_config(read_config(m / "config.json"))))
    moe = [c for c in costs if c.num_experts]
    head = 256 * 64 * 4  # lm_head [V, H] float32
    budget = max(max(c.f32 for c in costs) + 3 * moe[0].expert_f32, head) + 1024  # a layer, 3 experts, norm
    b = dump_golden(m, tmp_path / "b", stream=True, memory_budget=budget, **KW)
    assert b["streamed"]["experts_chunked_layers"] == [c.layer for c in moe]
    assert b["streamed"]["peak_weight_bytes"] <= budget
    ga, gb = GoldenReference(tmp_path / "a"), GoldenReference(tmp_path / "b")
    for k in ga.tensors:
        assert torch.allclose(ga.tensors[k], gb.tensors[k], atol=1e-6, rtol=0), k
    assert [g["tokens"] for g in a["generation"]["prompts"]] == [g["tokens"] for g in b["generation"]["prompts"]]


def test_budget_below_one_layer_is_refused_before_reading(tmp_path, monkeypatch, capsys):
    _, m = save_tiny("deepseek_v3", tmp_path / "m")
    from adapt.shard.checkpoint import Checkpoint

    def no_read(*a, **k):
        raise AssertionError("read a tensor before refusing the budget")

    monkeypatch.setattr(Checkpoint, "read", no_read)
    with pytest.raises(StreamBudgetError, match="layer"):
        dump_golden(m, tmp_path / "g", stream=True, memory_budget=50_000, **KW)
    assert run_cli("validate", "dump", m, "--out", tmp_path / "g", "--stream", "--memory-budget", "50KB") == 2
    err = capsys.readouterr().err
    assert "cannot hold layer" in err and "Traceback" not in err and not (tmp_path / "g").exists()
    assert run_cli("validate", "dump", m, "--stream", "--dry-run", "--memory-budget", "50KB") == 2


def test_perturbed_target_same_first_divergence_from_either_golden(tmp_path):
    _, m = save_tiny("deepseek_v3", tmp_path / "m")
    bad = perturbed(m, tmp_path / "bad", "model.layers.2.self_attn.o_proj.weight", lambda w: w * 1.05)
    assert run_cli("validate", "dump", m, "--out", tmp_path / "ga", "--long-lengths", "none") == 0
    assert run_cli("validate", "dump", m, "--out", tmp_path / "gb", "--stream") == 0
    only = ["--only", "text_inference", "--only", "layer_alignment", "--runtime", "transformers"]
    fds = []
    for g in ("ga", "gb"):
        assert run_cli("validate", m, "--reference", tmp_path / g, "--out", tmp_path / f"ok-{g}", *only) == 0
        assert run_cli("validate", bad, "--reference", tmp_path / g, "--out", tmp_path / f"r-{g}", *only) == 1
        fds.append(report(tmp_path / f"r-{g}")["first_divergence"])
    assert fds[0] == fds[1] and fds[0]["layer"] == 2
    env = report(tmp_path / "r-gb")["environment"]
    assert "reference_streamed" in env and "reference_streamed" not in report(tmp_path / "r-ga")["environment"]
    assert set(env["reference_streamed"]["experts_loaded"]) == {"1", "2"}
    html = (tmp_path / "r-gb" / "report.html").read_text()
    assert "reference_streamed" in html and "layer-streamed" in html


def test_estimate_bounds_what_the_dump_reads(tmp_path):
    """Dense: every tensor but the embedding rows is read exactly as estimated; MoE: at most as estimated."""
    from adapt.spec import ModelSpec
    from adapt.source import read_config
    from adapt.validate.reference import fixed_prompts

    for family in ("llama", "deepseek_v3"):
        _, m = save_tiny(family, tmp_path / family)
        doc = dump_golden(m, tmp_path / f"g-{family}", stream=True, **KW)
        spec = ModelSpec.from_hf_config(read_config(m / "config.json"))
        est = estimate(spec, fixed_prompts(spec.vocab_size), 4, [64])
        st = doc["streamed"]
        assert est["passes"] == st["passes"]
        assert st["bytes_read"] <= est["bytes_read"]
        got = st["bytes_read_per_layer"]
        for rec in est["layers"]:
            if family == "llama":
                assert got[str(rec["layer"])] == rec["bytes_read"]
            else:
                assert got[str(rec["layer"])] <= rec["bytes_read"]


def test_dry_run_json_on_real_configs(capsys):
    for name in ("moonshotai__Kimi-K2-Instruct", "deepseek-ai__DeepSeek-V3"):
        path = f"/work/shared/configs/{name}.json"
        assert run_cli("validate", "dump", path, "--stream", "--dry-run", "--format", "json") == 0
        d = json.loads(capsys.readouterr().out)
        assert {"bytes_read", "peak_memory_bytes", "est_time_s", "layers"} <= set(d)
        assert d["bytes_read"] == _independent_count(path) and d["read_bandwidth_source"] == "assumed"
        assert len(d["layers"]) == 61 and d["peak_memory_bytes"] > d["peak_weight_bytes"] > 0


def _independent_count(config_path: str) -> int:
    """Bytes a no-budget streamed dump with the default prompts and 16 new tokens reads, counted from the
    WeightLayout's tensor table directly: per pass every non-expert layer tensor once, min(E, tokens x k)
    experts per MoE layer, the prompts' unique embedding rows, the lm_head; the final norm once."""
    from adapt.layout import WeightLayout
    from adapt.spec import ModelSpec
    from adapt.source import read_config
    from adapt.validate.reference import fixed_prompts

    spec = ModelSpec.from_hf_config(read_config(__import__("pathlib").Path(config_path)))
    lay = WeightLayout.from_spec(spec)
    main = [t for t in lay if not t.mtp]
    prompts = fixed_prompts(spec.vocab_size)
    embed = sum(t.nbytes for t in main if t.role == "embed" or t.scale_of == "model.embed_tokens.weight")
    head = sum(t.nbytes for t in main if t.name.startswith("lm_head."))
    norm = sum(t.nbytes for t in main if t.name == "model.norm.weight")
    k, E = spec.moe.top_k, spec.moe.num_experts
    total = norm
    for tokens, rows in [(sum(map(len, prompts)), len({t for p in prompts for t in p}))] + [(4, 4)] * 15:
        total += rows * embed // spec.vocab_size + head
        for i in range(spec.num_layers):
            ts = [t for t in main if t.layer == i]
            total += sum(t.nbytes for t in ts if t.expert is None)
            per_expert = sum(t.nbytes for t in ts if t.expert == 0)
            total += min(E, tokens * k) * per_expert
    return total


def test_kimi_k2_model_type_streams_as_deepseek_v3(tmp_path):
    """Kimi-K2's config says model_type kimi_k2 (remote code transformers does not ship): streamed as DeepSeek-V3."""
    _, m = save_tiny("deepseek_v3", tmp_path / "m")
    a = dump_golden(m, tmp_path / "a", **KW)
    cfg = json.loads((m / "config.json").read_text())
    cfg.update(model_type="kimi_k2", auto_map={"AutoConfig": "configuration_deepseek.DeepseekV3Config"})
    (m / "config.json").write_text(json.dumps(cfg))
    b = dump_golden(m, tmp_path / "b", stream=True, **KW)
    assert _same(tmp_path / "a", tmp_path / "b") == [] and a["generation"] == b["generation"]
