"""Symmetric int8 quantization of KV vectors, one scale per token and head.

# Legend: T tokens, H heads, D head dim ("..." any leading dims).

Each vector x[t, h, :] is stored as q = round(x / s) clamped to [-127, 127] with
s = max(|x[t, h, :]|) / 127 (s = 1 for an all-zero vector). Dequantization is q * s.

Error bound (per element): |x - dequant(quant(x))| <= s / 2 = amax / 254, i.e. at most
0.394% of the vector's largest magnitude, plus float32 rounding of the division and
product (a relative 2^-23 of amax). The value of largest magnitude is represented
exactly up to that rounding. The bound is tested in tests/runtime/kernels/test_kv_quant.py.
"""

import torch

INT8_MAX = 127.0


def quantize_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize x [..., D] to (int8 [..., D], scale [...] float32), symmetric per vector."""
    xf = x.float()  # [..., D]
    amax = xf.abs().amax(dim=-1)  # [...]
    scale = torch.where(amax > 0, amax / INT8_MAX, torch.ones_like(amax))  # [...]
    q = torch.round(xf / scale.unsqueeze(-1)).clamp_(-INT8_MAX, INT8_MAX).to(torch.int8)
    return q, scale


def dequantize_int8(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Inverse of quantize_int8: q [..., D] int8, scale [...] -> [..., D] in dtype."""
    return (q.float() * scale.float().unsqueeze(-1)).to(dtype)


def quantize_int8_ref(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference twin of quantize_int8: one vector at a time."""
    flat = x.float().reshape(-1, x.shape[-1])  # [N, D]
    qs, scales = [], []
    for row in flat:
        amax = row.abs().max()
        s = amax / INT8_MAX if amax > 0 else torch.tensor(1.0)
        qs.append(torch.round(row / s).clamp(-INT8_MAX, INT8_MAX).to(torch.int8))
        scales.append(s)
    q = torch.stack(qs).reshape(x.shape) if qs else torch.empty(x.shape, dtype=torch.int8)
    scale = torch.stack(scales).reshape(x.shape[:-1]) if scales else torch.empty(x.shape[:-1])
    return q, scale.float()


def dequantize_int8_ref(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Reference twin of dequantize_int8."""
    return (q.to(torch.float32) * scale.to(torch.float32)[..., None]).to(dtype)
