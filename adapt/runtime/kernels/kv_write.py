"""The paged KV cache write by slot mapping (float caches, and int8 with per-token-and-head scales).

# Legend: T tokens being written, NB cache blocks, BS tokens per block, Hkv kv heads, D head dim.

Token t goes to slot slot_mapping[t] = block * BS + offset of k_cache / v_cache [NB, BS, Hkv, D];
the layout is described in paged_attention.py.
"""

import torch

from . import fused
from .kv_quant import quantize_int8


def write_kv_cache(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    checked: bool = False,
) -> None:
    """Write k [T, Hkv, D], v [T, Hkv, Dv] into the caches in place at slot_mapping [T] int
    (slot = block * BS + offset; negative slots, e.g. padding, are skipped). When a cache is int8
    the rows are quantized per token and head and the scales written to k_scale / v_scale.
    checked: the caller knows slot_mapping is int64 without negative slots (skips that test per layer)."""
    slots = slot_mapping.to(torch.long)  # [T]
    ext = fused.module()
    if (ext is not None and k.device.type == "cpu" and k.dtype == v.dtype == k_cache.dtype == v_cache.dtype
            and k.dtype in (torch.float32, torch.bfloat16) and k.stride(-1) == 1 and v.stride(-1) == 1
            and k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1 and k.shape[0]):
        ext.write_kv(k, v, k_cache, v_cache, slots.contiguous())  # both caches, one call; negative slots skipped
        return
    if not checked and bool((slots < 0).any()):  # padding present: drop those rows (decode steps have none)
        keep = slots >= 0
        slots, k, v = slots[keep], k[keep], v[keep]
    _write(k, k_cache, k_scale, slots)
    _write(v, v_cache, v_scale, slots)


def _write(x: torch.Tensor, cache: torch.Tensor, scale: torch.Tensor | None, slots: torch.Tensor) -> None:
    nb, bs, h, d = cache.shape
    flat = cache.view(nb * bs, h, d)  # a view: writes land in the cache
    if cache.dtype == torch.int8:
        if scale is None:
            raise ValueError("an int8 cache needs its scale tensor [NB, BS, Hkv]")
        xq, xs = quantize_int8(x)
        flat.index_copy_(0, slots, xq)
        scale.view(nb * bs, h).index_copy_(0, slots, xs.to(scale.dtype))
    else:
        flat.index_copy_(0, slots, x.to(cache.dtype))


def write_kv_cache_ref(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    checked: bool = False,
) -> None:
    """Reference twin: one token at a time (``checked`` is the kernel's shortcut, ignored)."""
    bs = k_cache.shape[1]
    for t in range(k.shape[0]):
        slot = int(slot_mapping[t])
        if slot < 0:
            continue
        blk, off = slot // bs, slot % bs
        for x, cache, sc in ((k[t], k_cache, k_scale), (v[t], v_cache, v_scale)):
            if cache.dtype == torch.int8:
                amax = x.float().abs().amax(dim=-1)  # [Hkv]
                s = torch.where(amax > 0, amax / 127.0, torch.ones_like(amax))
                cache[blk, off] = torch.round(x.float() / s[:, None]).clamp(-127, 127).to(torch.int8)
                sc[blk, off] = s
            else:
                cache[blk, off] = x.to(cache.dtype)
