import pytest
import torch

from adapt.runtime.kernels.moe_experts import (moe_experts, moe_experts_fused, moe_experts_fused_ref,
                                               moe_experts_ref)

from ._tol import assert_fp32_close, assert_lowp_close

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
