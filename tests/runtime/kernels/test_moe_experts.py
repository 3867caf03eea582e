import pytest
import torch

from adapt.runtime.kernels.moe_experts import (moe_experts, moe_experts_fused, moe_experts_fused_ref,
                                               moe_experts_ref)

from ._tol import assert_fp32_close, assert_lowp_close

pytestmark = pytest.mark.usefixtures("kernel_form")

T, K, E, HID, INTER = 13, 2, 6, 16, 24


def _weights(e=E, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    w_gate = torch.randn(e, INTER, HID, generator=g) * HID**-0.5
    w_up = torch.randn(e, INTER, HID, generator=g) * HID**-0.5
    w_down = torch.randn(e, HID, INTER, generator=g) * INTER**-0.5
    return w_gate.to(dtype), w_up.to(dtype), w_down.to(dtype)


def _routing(ids, seed=0):
    w = torch.rand(ids.shape, generator=torch.Generator().manual_seed(seed)) + 0.1
    return w / w.sum(-1, keepdim=True), ids


def _random_ids(experts, seed=0):
    g = torch.Generator().manual_seed(seed)
    choices = torch.tensor(experts)
    return torch.stack([choices[torch.randperm(len(experts), generator=g)[:K]] for _ in range(T)])


def _x(seed=0):
    return torch.randn(T, HID, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize(
    "ids",
    [
        _random_ids(list(range(E))),
        _random_ids([1, 4]),  # experts 0, 2, 3, 5 receive no token
        torch.cat([torch.full((T, 1), 3), torch.full((T, 1), 5)], dim=1),  # every first choice on expert 3
    ],
    ids=["random", "idle_experts", "one_expert"],
)
def test_moe_matches_twin_fp32(ids):
    x, ws = _x(), _weights()
    weights, ids = _routing(ids)
    out = moe_experts(x, weights, ids, *ws)
    assert out.shape == (T, HID) and out.dtype == torch.float32
    assert_fp32_close(out, moe_experts_ref(x, weights, ids, *ws))


def test_all_slots_on_one_expert_k1():
    x, ws = _x(1), _weights()
    weights, ids = torch.ones(T, 1), torch.full((T, 1), E - 1)
    assert_fp32_close(moe_experts(x, weights, ids, *ws), moe_experts_ref(x, weights, ids, *ws))


def test_expert_parallel_ranks_sum_to_full():
    x, (wg, wu, wd) = _x(2), _weights(seed=2)
    weights, ids = _routing(_random_ids(list(range(E)), seed=2))
    full = moe_experts(x, weights, ids, wg, wu, wd)
    parts = []
    for e0, e1 in [(0, 2), (2, 5), (5, 6)]:  # uneven ranges, one rank with a single expert
        part = moe_experts(x, weights, ids, wg[e0:e1], wu[e0:e1], wd[e0:e1], expert_offset=e0)
        assert_fp32_close(part, moe_experts_ref(x, weights, ids, wg[e0:e1], wu[e0:e1], wd[e0:e1], expert_offset=e0))
        parts.append(part)
    assert_fp32_close(sum(parts), full)
    # a rank whose experts nobody chose contributes exactly zero
    none = moe_experts(x, weights, ids, wg[:1], wu[:1], wd[:1], expert_offset=E)
    assert torch.equal(none, torch.zeros_like(none))


def test_matches_transformers_experts():
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3Experts

    cfg = DeepseekV3Config(hidden_size=HID, moe_intermediate_size=INTER, n_routed_experts=E, hidden_act="silu")
    experts = DeepseekV3Experts(cfg)
    wg, wu, wd = _weights(seed=3)
    with torch.no_grad():
        experts.gate_up_proj.copy_(torch.cat([wg, wu], dim=1))  # [E, 2I, H]: gate rows then up rows
        experts.down_proj.copy_(wd)
    x = _x(3)
    weights, ids = _routing(_random_ids(list(range(E)), seed=3))
    with torch.no_grad():
        expected = experts(x, ids, weights)
    assert_fp32_close(moe_experts(x, weights, ids, wg, wu, wd), expected)


def test_moe_bf16_within_2x_of_torch():
    x = _x(4)
    ws = _weights(seed=4)
    weights, ids = _routing(_random_ids(list(range(E)), seed=4))
    ref32 = moe_experts_ref(x, weights, ids, *ws)
    wsb = tuple(w.bfloat16() for w in ws)
    out = moe_experts(x.bfloat16(), weights, ids, *wsb)
    assert out.dtype == torch.bfloat16
    assert_lowp_close(out, moe_experts_ref(x.bfloat16(), weights, ids, *wsb), ref32, "moe bf16")


def _fused(ws):
    wg, wu, wd = ws
    return torch.cat([wg, wu], dim=1), wd  # [E, 2I, H]


@pytest.mark.parametrize(
    "ids",
    [
        _random_ids(list(range(E))),
        _random_ids([1, 4]),
        torch.cat([torch.full((T, 1), 3), torch.full((T, 1), 5)], dim=1),
    ],
    ids=["random", "idle_experts", "one_expert"],
)
def test_fused_matches_twins_fp32(ids):
    x, ws = _x(5), _weights(seed=5)
    weights, ids = _routing(ids, seed=5)
    wgu, wd = _fused(ws)
    out = moe_experts_fused(x, weights, ids, wgu, wd)
    assert out.shape == (T, HID) and out.dtype == torch.float32
    assert_fp32_close(out, moe_experts_fused_ref(x, weights, ids, wgu, wd))
    assert_fp32_close(out, moe_experts_ref(x, weights, ids, *ws))


def test_fused_expert_parallel_ranks_and_single_token():
    x, ws = _x(6), _weights(seed=6)
    weights, ids = _routing(_random_ids(list(range(E)), seed=6))
    wgu, wd = _fused(ws)
    full = moe_experts_fused(x, weights, ids, wgu, wd)
    parts = [moe_experts_fused(x, weights, ids, wgu[e0:e1], wd[e0:e1], expert_offset=e0)
             for e0, e1 in [(0, 2), (2, 5), (5, 6)]]
    assert_fp32_close(sum(parts), full)
    none = moe_experts_fused(x, weights, ids, wgu[:1], wd[:1], expert_offset=E)
    assert torch.equal(none, torch.zeros_like(none))
    one = moe_experts_fused(x[:1], weights[:1], ids[:1], wgu, wd)
    assert_fp32_close(one, moe_experts_ref(x[:1], weights[:1], ids[:1], *ws))


def test_fused_bf16_within_2x_of_torch():
    x = _x(7)
    ws = _weights(seed=7)
    weights, ids = _routing(_random_ids(list(range(E)), seed=7))
    wgu, wd = _fused(ws)
    ref32 = moe_experts_fused_ref(x, weights, ids, wgu, wd)
    out = moe_experts_fused(x.bfloat16(), weights, ids, wgu.bfloat16(), wd.bfloat16())
    assert out.dtype == torch.bfloat16
    assert_lowp_close(out, moe_experts_fused_ref(x.bfloat16(), weights, ids, wgu.bfloat16(), wd.bfloat16()),
                      ref32, "moe fused bf16")


def _stored_transposed(w: torch.Tensor) -> torch.Tensor:
    """The same [E, M, N] values held as a view of [E, N, M] storage, as the runtime's MoE holds experts."""
    return w.transpose(1, 2).contiguous().transpose(1, 2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_padded_batched_path_matches_twin(dtype, monkeypatch):
    import adapt.runtime.kernels.moe_experts as me

    calls = []
    real = me._padded_experts
    monkeypatch.setattr(me, "_padded_experts", lambda *a: calls.append(1) or real(*a))

    e, t, k = 4, 24, 2
    g = torch.Generator().manual_seed(8)
    x = torch.randn(t, HID, generator=g)
    wgu = torch.randn(e, 2 * INTER, HID, generator=g) * HID**-0.5
    wd = torch.randn(e, HID, INTER, generator=g) * INTER**-0.5
    # every expert busy, one of them twice as busy: padding C = 16 rows for 48 slots over 4 experts
    ids = torch.stack([torch.tensor([i % e, (i // 2) % e if (i // 2) % e != i % e else (i + 1) % e])
                       for i in range(t)])
    weights = torch.rand(t, k, generator=g) + 0.1
    ref32 = moe_experts_fused_ref(x, weights, ids, wgu, wd)
    xs, wgu_t, wd_t = x.to(dtype), _stored_transposed(wgu.to(dtype)), _stored_transposed(wd.to(dtype))
    out = moe_experts_fused(xs, weights.to(dtype), ids, wgu_t, wd_t)  # static rule: pads 1.33x, padded
    assert calls, "the padded batched path was not taken"
    twin = moe_experts_fused_ref(xs, weights.to(dtype), ids, wgu.to(dtype), wd.to(dtype))
    if dtype == torch.float32:
        assert_fp32_close(out, twin)
    else:
        assert_lowp_close(out, twin, ref32, "moe padded bf16")
    # an expert-parallel rank holding experts 1..2 only: its slots, nothing from the others
    part = moe_experts_fused(xs, weights.to(dtype), ids, wgu_t[1:3], wd_t[1:3], expert_offset=1)
    twin_part = moe_experts_fused_ref(xs, weights.to(dtype), ids, wgu.to(dtype)[1:3], wd.to(dtype)[1:3], 1)
    if dtype == torch.float32:
        assert_fp32_close(part, twin_part)


def test_padded_path_declines_when_padding_wastes_too_much():
    import adapt.runtime.kernels.moe_experts as me

    e = 8
    wgu = _stored_transposed(torch.randn(e, 2 * INTER, HID))
    wd = _stored_transposed(torch.randn(e, HID, INTER))
    # 12 slots on expert 0, one slot on each of 1..7: C = 12 -> 96 padded rows for 19 real ones
    ids = torch.cat([torch.zeros(12, dtype=torch.long), torch.arange(1, e)])[:, None]
    x = torch.randn(ids.shape[0], HID)
    local = ids.reshape(-1)
    order = torch.argsort(local, stable=True)
    counts = torch.bincount(local, minlength=e + 1).tolist()
    assert me._padded_experts(x, torch.ones_like(ids, dtype=torch.float32), order // 1, order, local, counts,
                              wgu, wd) is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "ids",
    [
        _random_ids(list(range(E)), seed=8),
        _random_ids([1, 4], seed=8),  # idle experts
        torch.cat([torch.full((T, 1), 3), torch.full((T, 1), 5)], dim=1),  # every first choice on expert 3
    ],
    ids=["random", "idle_experts", "one_expert"],
)
def test_packed_matches_twins(ids, dtype):
    from adapt.runtime.kernels.moe_experts import moe_experts_packed, onednn_packs, pack_expert_weights

    if not onednn_packs(dtype):
        pytest.skip(f"this CPU does not pack {dtype} for oneDNN")
    x, ws = _x(8), _weights(seed=8)
    weights, ids = _routing(ids, seed=8)
    wgu, wd = _fused(ws)
    pg, pd = pack_expert_weights(wgu.to(dtype)), pack_expert_weights(wd.to(dtype))
    assert all(p.is_mkldnn for p in pg + pd) and torch.equal(pg[2].to_dense(), wgu[2].to(dtype))
    out = moe_experts_packed(x.to(dtype), weights.to(dtype), ids, pg, pd)
    assert out.shape == (T, HID) and out.dtype == dtype
    ref = moe_experts_ref(x, weights, ids, *ws)
    if dtype == torch.float32:
        assert_fp32_close(out, ref)
    else:
        lowp = moe_experts_fused_ref(x.to(dtype), weights.to(dtype), ids, wgu.to(dtype), wd.to(dtype))
        assert_lowp_close(out, lowp, ref)
    # expert parallelism: ranks holding contiguous slices sum to the full output; a rank with none is 0
    parts = [moe_experts_packed(x, weights, ids, pack_expert_weights(wgu[a:b]), pack_expert_weights(wd[a:b]), a)
             for a, b in [(0, 2), (2, 5), (5, 6)]]
    assert_fp32_close(sum(parts), moe_experts_ref(x, weights, ids, *ws))


def _skewed_case(seed=11, t=40, e=6, k=2):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, HID, generator=g)
    probs = 1.0 / torch.arange(1, e + 1, dtype=torch.float32)
    ids = torch.multinomial(probs.expand(t, e), k, generator=g)
    weights = torch.rand(t, k, generator=g) + 0.1
    wgu = torch.randn(e, 2 * INTER, HID, generator=g) * HID**-0.5
    wd = torch.randn(e, HID, INTER, generator=g) * INTER**-0.5
    return x, weights, ids, wgu, wd


def test_tactics_time_every_eligible_path_once_and_keep_the_fastest(monkeypatch):
    import adapt.runtime.kernels.moe_experts as me
    from adapt.runtime.tactics import STRATEGY_ENV, Tactics

    tac = Tactics()
    monkeypatch.delenv(STRATEGY_ENV, raising=False)
    x, weights, ids, wgu, wd = _skewed_case()
    wgu_t, wd_t = _stored_transposed(wgu), _stored_transposed(wd)
    runs = {"padded": 0, "grouped": 0, "loop": 0}
    real_pad, real_mm = me._padded_experts, getattr(torch, "_grouped_mm", None)

    def pad(*a):
        runs["padded"] += 1
        return real_pad(*a)

    monkeypatch.setattr(me, "_padded_experts", pad)
    if real_mm is not None:
        def mm(*a, **kw):
            runs["grouped"] += 1
            return real_mm(*a, **kw)
        monkeypatch.setattr(torch, "_grouped_mm", mm)
    twin = moe_experts_fused_ref(x, weights, ids, wgu, wd)
    out = moe_experts_fused(x, weights, ids, wgu_t, wd_t, choose=tac.run)
    assert_fp32_close(out, twin)
    (key, choice), = tac.choice.items()
    assert choice == tac.last and choice in key[-1] and "loop" in key[-1] and "padded" in key[-1]
    assert runs["padded"] == 4  # a warm-up and three timed runs
    assert runs["grouped"] in (0, 8)  # two projections a run, where this build has grouped_mm
    before = dict(runs)
    assert_fp32_close(moe_experts_fused(x, weights, ids, wgu_t, wd_t, choose=tac.run), twin)  # the winner alone
    ran = {n: runs[n] - before[n] for n in runs}
    assert ran["padded"] == (1 if choice == "padded" else 0)
    assert ran["grouped"] == (2 if choice == "grouped" else 0)
    assert len(tac.choice) == 1


@pytest.mark.parametrize("strategy", ["padded", "grouped", "loop"])
def test_each_pinned_strategy_matches_the_twin(strategy, monkeypatch):
    from adapt.runtime.tactics import STRATEGY_ENV, Tactics

    monkeypatch.setenv(STRATEGY_ENV, strategy)
    tac = Tactics()
    x, weights, ids, wgu, wd = _skewed_case(seed=12)
    out = moe_experts_fused(x, weights, ids, _stored_transposed(wgu), _stored_transposed(wd), choose=tac.run)
    assert tac.last == (strategy if strategy != "grouped" or hasattr(torch, "_grouped_mm") else "loop")
    assert_fp32_close(out, moe_experts_fused_ref(x, weights, ids, wgu, wd))
    ep = moe_experts_fused(x, weights, ids, _stored_transposed(wgu[2:5]), _stored_transposed(wd[2:5]), 2,
                           choose=tac.run)
    assert_fp32_close(ep, moe_experts_fused_ref(x, weights, ids, wgu[2:5], wd[2:5], 2))


def test_a_candidate_that_raises_is_dropped_and_a_bad_pin_is_refused(monkeypatch):
    from adapt.runtime.tactics import STRATEGY_ENV, Tactics

    tac = Tactics()
    monkeypatch.delenv(STRATEGY_ENV, raising=False)

    def broken():
        raise NotImplementedError("no kernel for this dtype")

    assert tac.run(("k",), {"grouped": broken, "loop": lambda: "loop ran"}) == "loop ran"
    assert tac.choice == {("k",): "loop"}
    monkeypatch.setenv(STRATEGY_ENV, "grouped")
    assert tac.run(("k2",), {"grouped": broken, "loop": lambda: "fallback"}) == "fallback"
    monkeypatch.setenv(STRATEGY_ENV, "fastest")
    with pytest.raises(ValueError, match="ADAPT_MOE_STRATEGY"):
        tac.run(("k3",), {"loop": lambda: None})
    monkeypatch.delenv(STRATEGY_ENV)

    def failing_loop():
        raise RuntimeError("out of memory")

    with pytest.raises(RuntimeError, match="out of memory"):  # the always-valid path's error is not hidden
        tac.run(("k4",), {"grouped": broken, "loop": failing_loop})
    assert ("k4",) not in tac.choice


def test_packing_trial_is_measured_once_per_shape_and_leaves_the_block_alone():
    import adapt.runtime.tactics as tactics
    from adapt.runtime.kernels.moe_experts import onednn_packs

    if not onednn_packs(torch.float32):
        pytest.skip("this CPU does not pack float32 for oneDNN")

    class Block:  # what packing_wins reads from a MoE module
        experts, hidden_size, num_inter, expert_offset = tuple(range(6)), HID, INTER, 0

        class moe:
            top_k = 2

    _, _, _, wgu, wd = _skewed_case(seed=13)
    Block.w_gate_up, Block.w_down = _stored_transposed(wgu), _stored_transposed(wd)
    tactics._PACK_TRIALS.clear()
    first = tactics.packing_wins(Block, torch.float32)
    assert isinstance(first, bool) and len(tactics._PACK_TRIALS) == 1
    assert torch.equal(Block.w_gate_up, _stored_transposed(wgu)) and not Block.w_gate_up.is_mkldnn
    tactics._PACK_TRIALS[next(iter(tactics._PACK_TRIALS))] = not first  # cached: not measured again
    assert tactics.packing_wins(Block, torch.float32) is (not first)
    tactics._PACK_TRIALS.clear()


def test_timing_cache_persists_choices_per_host_and_survives_a_bad_file(tmp_path, monkeypatch):
    from adapt.runtime.tactics import STRATEGY_ENV, Tactics

    monkeypatch.delenv(STRATEGY_ENV, raising=False)
    f = tmp_path / "t" / "host.json"
    timed = []

    def cands():
        return {"padded": lambda: timed.append("padded") or "p", "loop": lambda: timed.append("loop") or "l"}

    first = Tactics(f)
    out = first.run(("cls", 1), cands())
    assert out in ("p", "l") and f.is_file() and len(timed) == 8  # warm-up + three timed runs each
    second = Tactics(f)  # a later process on the same host: the recorded choice, nothing timed
    timed.clear()
    assert second.run(("cls", 1), cands()) == out and timed == [{"p": "padded", "l": "loop"}[out]]
    assert second.choice == {("cls", 1): {"p": "padded", "l": "loop"}[out]}
    f.write_text("{not json")
    third = Tactics(f)
    timed.clear()
    third.run(("cls", 1), cands())
    assert len(timed) == 8  # unreadable cache: timed again, and rewritten
    assert Tactics(f).recall("paths", ("cls", 1)) in ("padded", "loop")
    ro = Tactics(tmp_path / "file-not-dir" / "x.json")
    (tmp_path / "file-not-dir").write_text("")  # the cache's folder cannot be made: in memory only
    assert ro.run(("cls", 2), cands()) in ("p", "l") and ("cls", 2) in ro.choice
