"""A linear on weights held quantized: fp8 blocks, int8 per channel, int4 groups (adapt/runtime/quant/).

Shapes: x [..., K]; q [N, K] (fp8 as float8_e4m3fn or its bytes, int8) or [N, Kp] uint8 (int4: the bytes of
compressed-tensors' int32 words, value k in nibble k % 2 of byte k // 2, stored as value + 8); scale float32
[ceil(N / rb), ceil(K / bk)]; zero int8 [N, ceil(K / bk)] or None (int4 with zero points).
W[n, k] = (q[n, k] - zero[n, k // bk]) * scale[n // rb, k // bk].

``act="int8"`` (W8A8 / W4A8, compressed-tensors' dynamic per-token int8 input activations): each row of x is
quantized first (``quantize_rows``: scale max|x| / 127, round half to even, clamp to +-127) and the product is
that of the dequantized rows with W in float32, rounded once to x's dtype. The fused kernel's decode sums the
integer products exactly (csrc/quant_dot_a8.h, vpdpbusd); its other paths run on the dequantized rows.

``quant_linear`` runs the fused CPU kernel (csrc/quant_gemm.h: each block of W dequantized into a buffer in
cache and dotted with x's rows there, one rounding per output) where it takes the tensors; ``quant_linear_ref``
is the twin: dequantize W, then F.linear.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from . import fused

KINDS = {"fp8": 0, "int8": 1, "int4": 2}
ACTS = {None: 0, "int8": 1}  # activation forms: as they are; int8 per row (dynamic, symmetric)
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


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic symmetric int8 per row of x [..., K]: (q int8, scale float32 [..., 1]); an all-zero row has scale
    0 and q 0."""
    xf = x.float()
    s = xf.abs().amax(dim=-1, keepdim=True) / 127.0
    q = torch.where(s > 0, torch.round(xf / torch.where(s > 0, s, 1.0)), 0.0).clamp(-127, 127)
    return q.to(torch.int8), s


def quant_linear(x: torch.Tensor, kind: str, q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None,
                 rb: int, bk: int, k: int, bias: torch.Tensor | None = None, act: str | None = None) -> torch.Tensor:
    """x @ W^T (+ bias) for W held quantized (module docstring); the fused CPU kernel where it takes the tensors,
    else the twin."""
    ext = fused.module()
    if (ext is not None and hasattr(ext, "quant_linear") and x.is_cpu and x.dtype in _X_DTYPES
            and not (torch.is_grad_enabled() and x.requires_grad)):
        if x.dim() == 2:  # the runtime's rows as they come (a reshape and a view cost ~2.5 us a call)
            return ext.quant_linear(x, _bytes(q), scale, zero, KINDS[kind], rb, bk, bias, ACTS[act])
        rows = x.reshape(-1, x.shape[-1])
        y = ext.quant_linear(rows, _bytes(q), scale, zero, KINDS[kind], rb, bk, bias, ACTS[act])
        return y.view(*x.shape[:-1], y.shape[-1])
    return quant_linear_ref(x, kind, q, scale, zero, rb, bk, k, bias, act)


def quant_linear_ref(x: torch.Tensor, kind: str, q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None,
                     rb: int, bk: int, k: int, bias: torch.Tensor | None = None, act: str | None = None) -> torch.Tensor:
    """The twin: dequantize W to x's dtype, then F.linear (with ``act``: x's rows quantized and dequantized, the
    product in float32, rounded once to x's dtype)."""
    if act is None:
        return F.linear(x, dequantize(kind, q, scale, zero, rb, bk, k, x.dtype), bias)
    qx, s = quantize_rows(x)
    b = None if bias is None else bias.float()
    return F.linear(qx.float() * s, dequantize(kind, q, scale, zero, rb, bk, k), b).to(x.dtype)


# (q, scale, zero or None, rb, bk) of one projection of every expert, stacked: q [E, N, *], scale [E, *, *]
Stacked = tuple


def quant_moe_takes(kind: str, h: int, inter: int, bk_gate_up: int, bk_down: int, dtype: torch.dtype,
                    act: str | None = None) -> bool:
    """Whether the fused CPU kernel runs quant_moe for experts gate|up [2I, H] (groups of bk_gate_up) and down
    [H, I] (groups of bk_down) on activations of ``dtype`` here (float32 or bfloat16), ``act`` as quant_linear."""
    ext = fused.module()
    return (ext is not None and hasattr(ext, "quant_moe") and dtype in (torch.float32, torch.bfloat16)
            and ext.quant_moe_takes(KINDS[kind], h, inter, bk_gate_up, bk_down, dtype == torch.bfloat16, ACTS[act]))


def quant_moe(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, kind: str, gate_up: Stacked,
              down: Stacked, expert_offset: int = 0, act: str | None = None) -> torch.Tensor:
    """The routed experts of x [T, H] (weights, global ids [T, K]) held quantized, in one call of the fused CPU
    kernel (csrc/quant_moe.h; where quant_moe_takes): out [T, H] (x.dtype) as the per-expert form computes it
    (runtime/quant/experts.py: a quant_linear for gate|up, silu_and_mul and a quant_linear for down per expert,
    the weighted combine in float32; ``act`` as quant_linear's, for both projections)."""
    (q1, s1, z1, rb1, bk1), (q2, s2, z2, rb2, bk2) = gate_up, down
    ids = ids if ids.dtype == torch.long else ids.long()
    weights = weights if weights.dtype == torch.float32 else weights.float()
    return fused.module().quant_moe(x.contiguous(), ids.contiguous(), weights.contiguous(), _bytes(q1), s1, z1,
                                    _bytes(q2), s2, z2, KINDS[kind], rb1, bk1, rb2, bk2, expert_offset,
                                    ACTS[act])


def _bytes(q: torch.Tensor) -> torch.Tensor:
    return q.view(torch.uint8) if q.dtype != torch.uint8 else q
