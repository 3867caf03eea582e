"""The fused quantized MoE decode (csrc/quant_moe.h) against the per-expert form (a quant_linear per expert
segment, runtime/quant/experts.py) and against the float32 twin of the dequantized experts."""

from __future__ import annotations

import pytest
import torch

from adapt.quantize import pack_int4, quantize_fp8_blocks, quantize_int4_groups, quantize_int8_channel
from adapt.runtime.kernels import fused
from adapt.runtime.kernels.moe_experts import moe_experts_fused_ref
from adapt.runtime.kernels.quant_linear import quant_moe_takes
from adapt.runtime.quant import experts as qexperts
from adapt.runtime.quant.experts import QuantizedExperts
from adapt.runtime.quant.weight import QuantizedWeight

from ._tol import assert_fp32_close, assert_lowp_close


def _quantized(kind: str, w: torch.Tensor, g: int):
    """(q, scale, zero, rb, bk) of w [N, K] as QuantizedWeight holds it."""
    if kind == "fp8":
        q, s = quantize_fp8_blocks(w, (g, g))
        return q, s, None, g, g
    if kind == "int8":
        q, s = quantize_int8_channel(w)
        return q, s, None, 1, w.shape[1]
    q, s, z = quantize_int4_groups(w, g, symmetric=g != 32)  # g32: with zero points
    return pack_int4(q).view(torch.uint8), s, z, 1, g


def _experts(kind: str, e: int, h: int, inter: int, g: int, offset: int = 0, twin: bool = False,
             act: str | None = None):
    """QuantizedExperts of e random experts, stacked as a materialized model's are, and the dequantized
    stacked float32 weights (gate_up [E, 2I, H], down [E, H, I])."""
    gen = torch.Generator().manual_seed(e * 100 + h + g)
    made = {"gu": [], "dn": []}
    for name, (n, k) in (("gu", (2 * inter, h)), ("dn", (h, inter))):
        for _ in range(e):
            made[name].append(_quantized(kind, torch.randn(n, k, generator=gen) * k**-0.5, g))  # outputs O(1)

    def held(parts, n, k):
        q, s, z, rb, bk = parts
        return QuantizedWeight(kind, n, k, rb, bk, z is not None, [("w", 0, n)], not twin, act=act)

    gu = [held(p, 2 * inter, h) for p in made["gu"]]
    dn = [held(p, h, inter) for p in made["dn"]]
    qe = QuantizedExperts(gu, dn, offset)
    qe.materialized(lambda shape, dt: torch.empty(shape, dtype=dt))
    for ws, parts in ((gu, made["gu"]), (dn, made["dn"])):
        for w, (q, s, z, _, _) in zip(ws, parts):
            with torch.no_grad():
                w.q.copy_(q.view(w.q.dtype))
                w.scale.copy_(s)
                if z is not None:
                    w.zero.copy_(z)
    return qe, torch.stack([w.dequantized() for w in gu]), torch.stack([w.dequantized() for w in dn])


def _per_expert(qe: QuantizedExperts, x, weights, ids):
    stacked, qe._stacked = qe._stacked, None
    try:
        return qe(x, weights, ids)
    finally:
        qe._stacked = stacked


def _routing(t: int, k: int, n_ids: int, seed: int, spread: bool):
    """(weights [T, K] float32, ids [T, K]); spread: every id at most twice (each expert <= 2 rows)."""
    gen = torch.Generator().manual_seed(seed)
    if spread:
        ids = torch.randperm(n_ids, generator=gen).repeat(2)[: t * k].view(t, k)
    else:
        ids = torch.stack([torch.randperm(n_ids, generator=gen)[:k] for _ in range(t)])
    weights = torch.softmax(torch.randn(t, k, generator=gen), dim=-1)
    return weights, ids


CASES = [("int4", 128), ("int4", 32), ("int4", 64), ("int8", 0), ("fp8", 16)]


@pytest.fixture
def fused_kernels():
    from adapt.runtime import cpu_kernels

    if cpu_kernels.load() is None or not hasattr(fused.module(), "quant_moe"):
        pytest.skip(f"fused CPU kernels {cpu_kernels.status()}")


@pytest.mark.parametrize("kind,g", CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("h", [256, 192])
def test_decode_bitwise_equal_to_per_expert(fused_kernels, kind, g, dtype, h):
    # at most 2 rows an expert: the per-expert linears take their decode path too, and the sums run in the
    # same order, so the bits agree (beyond QMR rows an expert, the per-expert linear's buffered path differs)
    e, inter = 8, 128
    qe, _, _ = _experts(kind, e, h, inter, g)
    if not quant_moe_takes(kind, h, inter, qe.gate_up[0].bk, qe.down[0].bk, dtype):
        pytest.skip("no decode kernel for this form here")
    for t, k in ((1, 4), (2, 2), (3, 4)):
        weights, ids = _routing(t, k, e, t, spread=True)
        x = torch.randn(t, h, generator=torch.Generator().manual_seed(t)).to(dtype)
        got = qe(x, weights, ids)
        assert got.dtype == dtype and got.shape == (t, h)
        assert torch.equal(got, _per_expert(qe, x, weights, ids)), (kind, g, dtype, t, k)


@pytest.mark.parametrize("kind,g", [("int4", 128), ("int4", 32), ("int8", 0)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int8_activations(fused_kernels, kind, g, dtype):
    # W4A8 / W8A8: bitwise equal to the per-expert form (each expert's inputs quantized per row there too) where
    # no expert has more than 2 rows; 16 tokens against the per-expert twin (float32 products of the quantized
    # rows), and the activations really quantized (the weight-only experts differ)
    e, h, inter = 8, 256, 128
    qe, _, _ = _experts(kind, e, h, inter, g, act="int8")
    if not quant_moe_takes(kind, h, inter, qe.gate_up[0].bk, qe.down[0].bk, dtype, "int8"):
        pytest.skip("no int8-activation decode for this form here")
    for t, k in ((1, 4), (3, 4)):
        weights, ids = _routing(t, k, e, t, spread=True)
        x = torch.randn(t, h, generator=torch.Generator().manual_seed(t)).to(dtype)
        got = qe(x, weights, ids)
        assert torch.equal(got, _per_expert(qe, x, weights, ids)), (kind, g, dtype, t, k)
    weights, ids = _routing(16, 4, e, 7, spread=False)
    x = torch.randn(16, h, generator=torch.Generator().manual_seed(5))
    twin, _, _ = _experts(kind, e, h, inter, g, twin=True, act="int8")
    plain, _, _ = _experts(kind, e, h, inter, g, twin=True)
    got, want = qe(x, weights, ids), twin(x, weights, ids)
    assert_fp32_close(got, want, f"{kind} g{g} a8")
    assert (plain(x, weights, ids) - want).abs().max() > 1e-3


@pytest.mark.parametrize("kind,g", CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_batch_matches_twin(fused_kernels, kind, g, dtype):
    # 16 tokens top-4 over 8 experts (~8 rows each, taken 4 at a time), a rank holding experts 4..11 of 16:
    # foreign slots add nothing; against the float32 twin of the dequantized experts
    e, h, inter, t, k, off = 8, 256, 128, 16, 4, 4
    qe, gu, dn = _experts(kind, e, h, inter, g, offset=off)
    weights, ids = _routing(t, k, 16, 7, spread=False)
    x = torch.randn(t, h, generator=torch.Generator().manual_seed(5))
    ref = moe_experts_fused_ref(x, weights, ids, gu, dn, off)
    got = qe(x.to(dtype), weights, ids)
    assert qe._stacked is not None and t <= qexperts.DECODE_TOKENS
    if dtype == torch.float32:
        assert_fp32_close(got, ref, f"{kind} g{g}")
        return
    twin, _, _ = _experts(kind, e, h, inter, g, offset=off, twin=True)
    assert_lowp_close(got, twin(x.to(dtype), weights, ids), ref, f"{kind} g{g} bf16")


def test_stacked_views_hold_the_loaded_values(fused_kernels):
    # each expert's parameters are views of the stacked tensors: a copy into one lands in the stack, and the
    # bytes the model reports are the experts' own (no second copy)
    qe, _, _ = _experts("int4", 4, 256, 128, 128)
    q1 = qe._stacked[0][0]
    assert all(w.q.data_ptr() == q1[i].data_ptr() for i, w in enumerate(qe.gate_up))
    with torch.no_grad():
        qe.gate_up[2].q.fill_(0x33)
    assert bool((q1[2] == 0x33).all()) and not bool((q1[1] == 0x33).all())
    held = sum(w.nbytes() for w in list(qe.gate_up) + list(qe.down))
    stacked = sum(t.numel() * t.element_size() for part in qe._stacked for t in part[:3] if t is not None)
    assert held == stacked


def test_twins_and_long_batches_take_the_per_expert_form(fused_kernels, monkeypatch):
    # the twins never run the fused kernel, nor a call of more than DECODE_TOKENS tokens
    calls = []
    monkeypatch.setattr(qexperts, "quant_moe", lambda *a, **kw: calls.append(1))
    twin, _, _ = _experts("int4", 4, 256, 128, 128, twin=True)
    qe, _, _ = _experts("int4", 4, 256, 128, 128)
    w, ids = _routing(qexperts.DECODE_TOKENS + 1, 2, 4, 1, spread=False)
    x = torch.randn(qexperts.DECODE_TOKENS + 1, 256)
    twin(x[:1], w[:1], ids[:1])
    qe(x, w, ids)
    assert calls == []
    qe(x[:1], w[:1], ids[:1])
    assert calls == [1]
