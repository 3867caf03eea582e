"""Triton RMSNorm, fused residual-add + RMSNorm, SiLU-and-mul and RoPE (twins: norm.py, activation.py, rope.py).

# Legend: N rows, H hidden, I intermediate, T tokens, Hh heads, D head dim, Dr rotary dims.

One program per row (per token and head for RoPE); statistics and products in float32, rounded to the
dtype where the torch form rounds (the normalized row before the weight, silu before the product).
"""

import torch
import triton
import triton.language as tl

from . import pow2


@triton.jit
def _rms_norm(x_ptr, r_ptr, w_ptr, out_ptr, res_ptr, n, sx, sr, eps, HAS_RES: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    m = cols < n
    x = tl.load(x_ptr + row * sx + cols, mask=m, other=0.0)
    if HAS_RES:
        x = x + tl.load(r_ptr + row * sr + cols, mask=m, other=0.0)  # in the input dtype, as the layer adds
        tl.store(res_ptr + row * n + cols, x, mask=m)
    h = x.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(h * h, axis=0) / n + eps)
    w = tl.load(w_ptr + cols, mask=m, other=0.0)
    ty = out_ptr.dtype.element_ty
    y = (h * rstd).to(x.dtype).to(ty) * w.to(ty)
    tl.store(out_ptr + row * n + cols, y, mask=m)


def _rows(x: torch.Tensor) -> torch.Tensor:
    x2 = x.reshape(-1, x.shape[-1])
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """RMSNorm of x [..., H] with weight [H] -> promote(weight, x) dtype (norm.rms_norm)."""
    x2 = _rows(x)
    out = torch.empty(x2.shape, dtype=torch.promote_types(weight.dtype, x.dtype), device=x.device)
    if x2.shape[0]:
        _rms_norm[(x2.shape[0],)](x2, x2, weight, out, out, x2.shape[1], x2.stride(0), x2.stride(0), eps,
                                  HAS_RES=False, BLOCK=pow2(x2.shape[1]))
    return out.view(*x.shape[:-1], -1)


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                       eps: float = 1e-6) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(residual + x), residual + x), both [..., H] (norm.fused_add_rms_norm)."""
    if residual.dtype != x.dtype or residual.shape != x.shape:
        new = residual + x
        return rms_norm(new, weight, eps), new
    x2, r2 = _rows(x), _rows(residual)
    out = torch.empty(x2.shape, dtype=torch.promote_types(weight.dtype, x.dtype), device=x.device)
    new = torch.empty_like(x2)
    if x2.shape[0]:
        _rms_norm[(x2.shape[0],)](x2, r2, weight, out, new, x2.shape[1], x2.stride(0), r2.stride(0), eps,
                                  HAS_RES=True, BLOCK=pow2(x2.shape[1]))
    return out.view(*x.shape[:-1], -1), new.view(x.shape)


@triton.jit
def _silu_and_mul(x_ptr, out_ptr, inter, sx, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = cols < inter
    g = tl.load(x_ptr + row * sx + cols, mask=m, other=0.0)
    u = tl.load(x_ptr + row * sx + inter + cols, mask=m, other=0.0)
    gf = g.to(tl.float32)
    s = (gf / (1.0 + tl.exp(-gf))).to(g.dtype)  # F.silu rounds to the dtype before the product
    tl.store(out_ptr + row * inter + cols, (s.to(tl.float32) * u.to(tl.float32)).to(g.dtype), mask=m)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x [..., 2I] = cat(gate, up) -> silu(gate) * up [..., I] (activation.silu_and_mul)."""
    x2 = _rows(x)
    inter = x2.shape[1] // 2
    out = torch.empty(x2.shape[0], inter, dtype=x.dtype, device=x.device)
    block = min(1024, pow2(inter))
    if x2.shape[0] and inter:
        _silu_and_mul[(x2.shape[0], triton.cdiv(inter, block))](x2, out, inter, x2.stride(0), BLOCK=block)
    return out.view(*x.shape[:-1], inter)


_LAYOUT = {"rotate_half": 0, "interleave": 1, "interleave_pairs": 2}


@triton.jit
def _rope(x_ptr, cos_ptr, sin_ptr, out_ptr, sxt, sxh, sct, sst, d, rd, LAYOUT: tl.constexpr,
          BLOCK_F: tl.constexpr, BLOCK_D: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    nh = tl.num_programs(1)
    half = rd // 2
    f = tl.arange(0, BLOCK_F)
    fm = f < half
    c = tl.load(cos_ptr + t * sct + f, mask=fm, other=0.0).to(tl.float32)  # cos[:, i] == cos[:, i + half]
    s = tl.load(sin_ptr + t * sst + f, mask=fm, other=0.0).to(tl.float32)
    if LAYOUT == 0:
        ia, ib, oa, ob = f, f + half, f, f + half
    elif LAYOUT == 1:
        ia, ib, oa, ob = 2 * f, 2 * f + 1, f, f + half
    else:
        ia, ib, oa, ob = 2 * f, 2 * f + 1, 2 * f, 2 * f + 1
    src = x_ptr + t * sxt + h * sxh
    dst = out_ptr + (t * nh + h) * d
    a = tl.load(src + ia, mask=fm, other=0.0)
    b = tl.load(src + ib, mask=fm, other=0.0)
    af, bf = a.to(tl.float32), b.to(tl.float32)
    tl.store(dst + oa, (af * c - bf * s).to(a.dtype), mask=fm)
    tl.store(dst + ob, (bf * c + af * s).to(a.dtype), mask=fm)
    cols = tl.arange(0, BLOCK_D)
    pm = (cols >= rd) & (cols < d)  # partial rotary: the rest passes through
    tl.store(dst + cols, tl.load(src + cols, mask=pm, other=0.0), mask=pm)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, layout: str = "rotate_half") -> torch.Tensor:
    """Rotate x [T, Hh, D] by cos/sin [T, Dr] -> a new [T, Hh, D] tensor (rope.apply_rope)."""
    if layout not in _LAYOUT:
        raise ValueError(f"unknown rope layout {layout!r}; expected one of {tuple(_LAYOUT)}")
    if x.stride(-1) != 1:
        x = x.contiguous()
    cos, sin = cos.contiguous(), sin.contiguous()
    t, h, d = x.shape
    out = torch.empty(t, h, d, dtype=x.dtype, device=x.device)
    rd = cos.shape[-1]
    if t and h:
        _rope[(t, h)](x, cos, sin, out, x.stride(0), x.stride(1), cos.stride(0), sin.stride(0), d, rd,
                      LAYOUT=_LAYOUT[layout], BLOCK_F=pow2(rd // 2, 1), BLOCK_D=pow2(d, 1))
    return out
