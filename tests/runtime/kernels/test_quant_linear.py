"""The fused quantized linear (csrc/quant_gemm.h) against its twin (dequantize, then F.linear)."""

from __future__ import annotations

import pytest
import torch

from adapt.quantize import pack_int4, quantize_fp8_blocks, quantize_int4_groups, quantize_int8_channel
from adapt.runtime.kernels import fused
from adapt.runtime.kernels.quant_linear import dequantize, quant_linear, quant_linear_ref, unpack_int4


def _weights(kind, n, k, g):
    gen = torch.Generator().manual_seed(n * 1000 + k)
    w = torch.randn(n, k, generator=gen) * 0.5
    if kind == "fp8":
        q, s = quantize_fp8_blocks(w, (g, g))
        return q, s, None, g, g
    if kind == "int8":
        q, s = quantize_int8_channel(w)
        return q, s, None, 1, k
    q, s, z = quantize_int4_groups(w, g, symmetric=(g % 32 == 0))
    zero = None if z is None else z
    return pack_int4(q).view(torch.uint8), s, zero, 1, g


@pytest.mark.parametrize("kind,g", [("fp8", 128), ("fp8", 16), ("int8", 0), ("int4", 32), ("int4", 16), ("int4", 24),
                                    ("int4", 20)])
@pytest.mark.parametrize("m,n,k", [(1, 64, 256), (5, 37, 200), (19, 130, 96)])
def test_fused_matches_twin_float32(kernel_form, kind, g, m, n, k):
    q, s, z, rb, bk = _weights(kind, n, k, g)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
    bias = torch.randn(n)
    ref = quant_linear_ref(x, kind, q, s, z, rb, bk, k, bias)
    got = quant_linear(x, kind, q, s, z, rb, bk, k, bias)
    assert got.shape == (m, n) and got.dtype == torch.float32
    assert torch.allclose(got, ref, atol=1e-5, rtol=1e-5), (got - ref).abs().max()


def _bf16_dot(kind, k, bk, dtype) -> bool:
    """Whether the fused kernel takes bf16 rows of this weight by its bf16 dot (csrc/quant_dot_bf16.h)."""
    mod = fused.module()
    chunk = {"int4": 128, "int8": 64}.get(kind)
    return (mod is not None and getattr(mod, "QUANT_BF16_DOT", False) and dtype == torch.bfloat16
            and chunk is not None and k % chunk == 0 and (bk % 128 == 0 or bk >= k))


@pytest.mark.parametrize("kind,g", [("fp8", 128), ("fp8", 16), ("int8", 0), ("int4", 32), ("int4", 16), ("int4", 24)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("k", [200, 256])
def test_decode_rows_equal_their_batch_rows(kernel_form, kind, g, dtype, k):
    # fused: 1-4 rows take the decode path (packed bytes dequantized in registers), 19 the buffered one, and
    # give the same bits (torch's GEMM is not batch-invariant: the twin is held to the tolerance only); bf16 rows
    # of int8 / int4 weights the bf16 dot takes sum in another order (test_bf16_decode_dot)
    n = 37
    q, s, z, rb, bk = _weights(kind, n, k, g)
    x = torch.randn(19, k, generator=torch.Generator().manual_seed(3)).to(dtype)
    bias = torch.randn(n).to(dtype)
    full = quant_linear(x, kind, q, s, z, rb, bk, k, bias)
    for m in (1, 2, 3, 4):
        part = quant_linear(x[:m], kind, q, s, z, rb, bk, k, bias)
        if kernel_form == "fused" and not _bf16_dot(kind, k, bk, dtype):
            assert torch.equal(part, full[:m]), (m, (part - full[:m]).abs().max())
        if dtype == torch.float32:  # bfloat16's rounding: test_fused_bfloat16_rounds_once
            ref = quant_linear_ref(x[:m], kind, q, s, z, rb, bk, k, bias)
            assert torch.allclose(part, ref, atol=1e-5, rtol=1e-5), (part - ref).abs().max()


@pytest.mark.parametrize("kind", ["fp8", "int8", "int4"])
def test_fused_bfloat16_rounds_once(kernel_form, kind):
    n, k = 96, 256
    q, s, z, rb, bk = _weights(kind, n, k, 32 if kind != "fp8" else 128)
    x = torch.randn(7, k).to(torch.bfloat16)
    exact = quant_linear_ref(x.float(), kind, q, s, z, rb, bk, k)  # float32 sums of the same values
    got = quant_linear(x, kind, q, s, z, rb, bk, k)
    plain = quant_linear_ref(x, kind, q, s, z, rb, bk, k)  # torch in bfloat16
    assert got.dtype == torch.bfloat16
    # FlashAttention's rule: no worse than twice plain torch's error in the same precision
    assert (got.float() - exact).abs().max() <= 2 * (plain.float() - exact).abs().max() + 1e-6


def _ulp_bf16(v: torch.Tensor) -> torch.Tensor:
    """One unit in the last place of bfloat16 (8 significant bits) at |v|."""
    _, e = torch.frexp(v.float().abs().clamp_min(2.0 ** -100))
    return torch.ldexp(torch.ones_like(v, dtype=torch.float32), e - 8)


@pytest.mark.parametrize("kind,g,sym", [("int4", 128, True), ("int4", 128, False), ("int4", 256, False),
                                        ("int4", 0, True), ("int8", 0, True)])
def test_bf16_decode_dot(kernel_form, kind, g, sym):
    """bf16 rows (decode, 1-4) of int8 / int4 weights: the bf16 dot's numerics (csrc/quant_dot_bf16.h). int4:
    the twin's own bfloat16 weights, so the result is the float32 sum of the same products rounded once (within
    an ulp of torch's fp32 sum of them: the order of the sums); int8: the float32 sum of x times the exact
    integers, times the row's scale (within an ulp of that computed in float64). Both no worse than twice the
    twin's (plain torch bfloat16) error against float64 (FlashAttention's rule)."""
    n, k = 37, 384
    gen = torch.Generator().manual_seed(7)
    w = torch.randn(n, k, generator=gen) * 0.5
    if kind == "int8":
        q, s = quantize_int8_channel(w)
        z, bk = None, k
    else:
        qi, s, z = quantize_int4_groups(w, g or None, symmetric=sym)
        q, bk = pack_int4(qi).view(torch.uint8), g or k
    x = torch.randn(4, k, generator=gen).to(torch.bfloat16)
    bias = torch.randn(n, generator=gen).to(torch.bfloat16)
    w32 = dequantize(kind, q, s, z, 1, bk, k)
    for m in (1, 2, 3, 4):
        xm = x[:m]
        got = quant_linear(xm, kind, q, s, z, 1, bk, k, bias)
        exact = xm.double() @ w32.double().T + bias.double()
        twin = quant_linear_ref(xm, kind, q, s, z, 1, bk, k, bias)
        assert got.dtype == torch.bfloat16
        assert (got.double() - exact).abs().max() <= 2 * (twin.double() - exact).abs().max() + 1e-6
        if kernel_form != "fused" or not _bf16_dot(kind, k, bk, torch.bfloat16):
            continue
        if kind == "int4":
            same = xm.float() @ dequantize(kind, q, s, z, 1, bk, k, torch.bfloat16).float().T + bias.float()
        else:
            same = ((xm.double() @ q.double().T) * s.double().T + bias.double()).float()
        assert ((got.float() - same).abs() <= _ulp_bf16(same)).all(), (got.float() - same).abs().max()


def test_dequantize_formulas():
    w = torch.randn(40, 72)
    q, s = quantize_fp8_blocks(w, (16, 32))
    d = dequantize("fp8", q, s, None, 16, 32, 72)
    assert (d - w).abs().max() <= w.abs().max() * 2 ** -3  # e4m3: 3 mantissa bits
    qi, si, zi = quantize_int4_groups(w, 24, symmetric=False)
    assert torch.equal(unpack_int4(pack_int4(qi).view(torch.uint8), 72), qi)
    d4 = dequantize("int4", pack_int4(qi).view(torch.uint8), si, zi, 1, 24, 72)
    assert (d4 - w).abs().max() <= si.max() * 0.5 + 1e-6
