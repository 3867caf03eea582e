"""Triton KV-cache writes by slot mapping (twins: kv_write.write_kv_cache_ref, mla.write_mla_cache_ref).

# Legend: T tokens, NB blocks, BS tokens per block, Hkv kv heads, D head dim, R latent rank, Dr rope dims.

One program per (token, head); a negative slot (padding) writes nothing. An int8 cache is quantized per
token and head as kv_quant.quantize_int8 does (scale = amax / 127, round half to even, clamp to +-127).
"""

import torch
import triton
import triton.language as tl

from . import pow2


@triton.jit
def _round_even(v):
    r = tl.floor(v)
    diff = v - r
    odd = (r - 2.0 * tl.floor(r * 0.5)) != 0.0
    return tl.where((diff > 0.5) | ((diff == 0.5) & odd), r + 1.0, r)


@triton.jit
def _write(x_ptr, cache_ptr, scale_ptr, slots_ptr, sxt, sxh, scn, scb, sch, ssn, ssb, ssh, d, bs,
           QUANT: tl.constexpr, BLOCK_D: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    slot = tl.load(slots_ptr + t).to(tl.int64)
    if slot >= 0:
        blk = slot // bs
        off = slot % bs
        cols = tl.arange(0, BLOCK_D)
        m = cols < d
        x = tl.load(x_ptr + t * sxt + h * sxh + cols, mask=m, other=0.0)
        dst = cache_ptr + blk * scn + off * scb + h * sch + cols
        if QUANT:
            xf = x.to(tl.float32)
            amax = tl.max(tl.abs(xf), axis=0)
            s = tl.where(amax > 0, amax / 127.0, 1.0)
            q = tl.minimum(tl.maximum(_round_even(xf / s), -127.0), 127.0)
            tl.store(dst, q.to(tl.int8), mask=m)
            tl.store(scale_ptr + blk * ssn + off * ssb + h * ssh, s)
        else:
            tl.store(dst, x.to(cache_ptr.dtype.element_ty), mask=m)


def _one(x, cache, scale, slots):
    if cache.dtype == torch.int8 and scale is None:
        raise ValueError("an int8 cache needs its scale tensor [NB, BS, Hkv]")
    t, h, d = x.shape
    if not t:
        return
    quant = cache.dtype == torch.int8
    s = scale if quant else cache
    sst = s.stride()[:3] if quant else (0, 0, 0)
    _write[(t, h)](x, cache, s, slots, x.stride(0), x.stride(1), cache.stride(0), cache.stride(1), cache.stride(2),
                   *sst, d, cache.shape[1], QUANT=quant, BLOCK_D=pow2(d, 1))


def write_kv_cache(k, v, k_cache, v_cache, slot_mapping, k_scale=None, v_scale=None, checked=False) -> None:
    """Write k [T, Hkv, D], v [T, Hkv, Dv] into k_cache / v_cache [NB, BS, Hkv, *] at slot_mapping [T]
    (kv_write.write_kv_cache; ``checked`` is the torch form's shortcut, not needed here)."""
    slots = slot_mapping.to(torch.int64).contiguous()
    _one(k if k.stride(-1) == 1 else k.contiguous(), k_cache, k_scale, slots)
    _one(v if v.stride(-1) == 1 else v.contiguous(), v_cache, v_scale, slots)


def write_mla_cache(c_kv, k_pe, latent_cache, slot_mapping) -> None:
    """Write [c_kv [T, R] | k_pe [T, Dr]] into latent_cache [NB, BS, R + Dr] at slot_mapping [T]."""
    nb, bs, w = latent_cache.shape
    r = c_kv.shape[1]
    slots = slot_mapping.to(torch.int64).contiguous()
    lat = latent_cache.view(nb, bs, 1, w)
    for x, view, d in ((c_kv, lat[..., :r], r), (k_pe, lat[..., r:], w - r)):
        x = x.contiguous()
        if x.shape[0]:
            _write[(x.shape[0], 1)](x, view, view, slots, x.stride(0), 0, view.stride(0), view.stride(1), 0,
                                    0, 0, 0, d, bs, QUANT=False, BLOCK_D=pow2(d, 1))
