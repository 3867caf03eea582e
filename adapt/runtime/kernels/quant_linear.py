"""A linear on weights held quantized: fp8 blocks, int8 per channel, int4 groups (adapt/runtime/quant/).

Shapes: x [..., K]; q [N, K] (fp8 as float8_e4m3fn or its bytes, int8) or [N, Kp] uint8 (int4: the bytes of
compressed-tensors' int32 words, value k in nibble k % 2 of byte k // 2, stored as value + 8); scale float32
[ceil(N / rb), ceil(K / bk)]; zero int8 [N, ceil(K / bk)] or None (int4 with zero points).
W[n, k] = (q[n, k] - zero[n, k // bk]) * scale[n // rb, k // bk].

``quant_linear`` runs the fused CPU kernel (csrc/quant_gemm.h: each block of W dequantized into a buffer in
cache and dotted with x's rows there, one rounding per output) where it takes the tensors; ``quant_linear_ref``
is the twin: dequantize W, then F.linear.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from . import fused

KINDS = {"fp8": 0, "int8": 1, "int4": 2}
_X_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def unpack_int4(q: torch.Tensor, k: int) -> torch.Tensor:
    """[N, Kp] uint8 (two values a byte, low nibble first, stored as value + 8) -> [N, k] int8 in [-8, 7]."""
    lo, hi = (q & 0xF), (q >> 4)
    return (torch.stack((lo, hi), dim=-1).reshape(q.shape[0], -1)[:, :k].to(torch.int8) - 8)


def dequantize(kind: str, q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None, rb: int, bk: int,
               k: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The real weight [N, K]: (q - zero) * scale in float32 (one rounding), then cast to ``dtype``."""
    n = q.shape[0]
    v = unpack_int4(q, k) if kind == "int4" else q
    v = v.to(torch.float32)
    if zero is not None:
        v = v - zero.to(torch.float32).repeat_interleave(bk, dim=1)[:, :k]
    s = scale.to(torch.float32).repeat_interleave(rb, dim=0)[:n].repeat_interleave(bk, dim=1)[:, :k]
    return (v * s).to(dtype)


def quant_linear(x: torch.Tensor, kind: str, q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None,
                 rb: int, bk: int, k: int, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ W^T (+ bias) for W held quantized (module docstring); the fused CPU kernel where it takes the tensors,
    else the twin."""
    ext = fused.module()
    if (ext is not None and hasattr(ext, "quant_linear") and x.device.type == "cpu" and x.dtype in _X_DTYPES
            and not (torch.is_grad_enabled() and x.requires_grad)):
        rows = x.reshape(-1, x.shape[-1])
        qb = q.view(torch.uint8) if q.dtype != torch.uint8 else q
        y = ext.quant_linear(rows, qb, scale, zero, KINDS[kind], rb, bk, bias)
        return y.view(*x.shape[:-1], y.shape[-1])
    return quant_linear_ref(x, kind, q, scale, zero, rb, bk, k, bias)


def quant_linear_ref(x: torch.Tensor, kind: str, q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None,
                     rb: int, bk: int, k: int, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The twin: dequantize W to x's dtype, then F.linear."""
    return F.linear(x, dequantize(kind, q, scale, zero, rb, bk, k, x.dtype), bias)
