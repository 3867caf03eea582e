"""Int8 activations (W8A8 / W4A8): quantize_rows, and the fused kernel (csrc/quant_dot_a8.h: vpdpbusd on the
packed bytes for 1-4 rows; the buffered path on the dequantized rows beyond) against its twin (the rows
quantized and dequantized, W dequantized, F.linear in float32)."""

from __future__ import annotations

import pytest
import torch

from adapt.quantize import pack_int4, quantize_int4_groups, quantize_int8_channel
from adapt.runtime.kernels import fused
from adapt.runtime.kernels.quant_linear import dequantize, quant_linear, quant_linear_ref, quantize_rows

from ._tol import assert_fp32_close


def _weights(kind, n, k, g, symmetric=True):
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(n + k + g)) * k**-0.5
    if kind == "int8":
        q, s = quantize_int8_channel(w)
        return q, s, None, 1, k
    q, s, z = quantize_int4_groups(w, g if g else None, symmetric=symmetric)
    return pack_int4(q).view(torch.uint8), s, z, 1, (g or k)


def test_quantize_rows():
    x = torch.tensor([[0.5, -1.0, 0.25, 0.0], [0.0, 0.0, 0.0, 0.0], [3.0, 1.5, -0.75, 2.9999]])
    q, s = quantize_rows(x)
    assert q.dtype == torch.int8 and s.shape == (3, 1)
    assert s[0, 0] == torch.tensor(1.0) / 127 and s[1, 0] == 0 and q[1].eq(0).all()
    assert q[0].tolist() == [64, -127, 32, 0]  # 63.5 rounds half to even
    assert q.abs().max() <= 127 and q[2, 0] == 127
    assert torch.allclose(q.float() * s, x, atol=(s / 2 + 1e-7).max().item())


# int4: groups of 128 / 256 (symmetric and with zero points), one per row; int8 per channel; K 256 / 512 (the
# vpdpbusd decode) and 192 (int4: no whole 128-column blocks, the buffered path on the dequantized rows)
CASES = [("int4", 128, True, 256), ("int4", 128, False, 512), ("int4", 256, True, 512), ("int4", 0, False, 256),
         ("int4", 32, True, 192), ("int8", 0, True, 256), ("int8", 0, True, 192)]


@pytest.mark.parametrize("kind,g,sym,k", CASES)
@pytest.mark.parametrize("m", [1, 2, 3, 4, 9])
def test_fused_matches_twin_float32(kernel_form, kind, g, sym, k, m):
    n = 37
    q, s, z, rb, bk = _weights(kind, n, k, g, sym)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
    x[0, :] = 0 if m == 3 else x[0, :]  # an all-zero row: scale 0, the bias only
    bias = torch.randn(n)
    ref = quant_linear_ref(x, kind, q, s, z, rb, bk, k, bias, act="int8")
    got = quant_linear(x, kind, q, s, z, rb, bk, k, bias, act="int8")
    assert got.shape == (m, n) and got.dtype == torch.float32
    assert_fp32_close(got, ref, f"{kind} g{g} k{k} m{m}")
    # the activations really are quantized: the weight-only product differs by more than the tolerance
    plain = quant_linear_ref(x, kind, q, s, z, rb, bk, k, bias)
    assert (plain - ref).abs().max() > 1e-3


@pytest.mark.parametrize("kind,g,sym,k", CASES[:4] + CASES[5:6])
def test_bfloat16_rounds_once(kernel_form, kind, g, sym, k):
    # bf16 rows: quantized from their exact float32 values; the float32 result rounded once to bf16
    q, s, z, rb, bk = _weights(kind, 64, k, g, sym)
    x = torch.randn(2, k, generator=torch.Generator().manual_seed(4)).bfloat16()
    got = quant_linear(x, kind, q, s, z, rb, bk, k, None, act="int8")
    exact = quant_linear_ref(x.float(), kind, q, s, z, rb, bk, k, None, act="int8")
    assert got.dtype == torch.bfloat16
    # within half a bf16 ulp of the float32 value (plus float32 summation order)
    assert ((got.float() - exact).abs() <= exact.abs() * 2**-8 + 1e-6).all()


def test_integer_sums_exact():
    # the decode's int4 dot is an exact integer sum per group, scaled once per group: the result equals the
    # float64 evaluation of the same formula to float32 rounding
    from adapt.runtime import cpu_kernels

    if cpu_kernels.load() is None or not getattr(fused.module(), "QUANT_A8_DOT", False):
        pytest.skip("no int8-activation decode on this host")
    k, n, g = 512, 16, 128
    q, s, z, rb, bk = _weights("int4", n, k, g, symmetric=False)
    x = torch.randn(1, k, generator=torch.Generator().manual_seed(9))
    qx, sx = quantize_rows(x)
    w = dequantize("int4", q, s, z, rb, bk, k, torch.float64)
    want = (qx.double() * sx.double()) @ w.T
    got = quant_linear(x, "int4", q, s, z, rb, bk, k, None, act="int8")
    assert torch.allclose(got.double(), want, rtol=1e-6, atol=1e-6), (got.double() - want).abs().max()
