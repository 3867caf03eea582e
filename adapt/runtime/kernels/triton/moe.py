"""Triton fused MoE: token slots sorted by expert, a grouped GEMM over expert tiles, a weighted combine
(twin: moe_experts.moe_experts_fused_ref).

# Legend: T tokens, H hidden, I expert intermediate, K top-k, S = T * K slots, E local experts,
# BM slot rows per tile, BN / BK output / reduction columns per tile.

1. Sort: each (token, k) slot gets its local expert (slots routed to other ranks go past the last one),
   slots are sorted by expert (stable), and every expert's segment is cut into tiles of BM slots.
2. Gate|up: one program per (tile, BN columns of I) gathers its slots' token rows and multiplies them by
   its expert's gate and up rows (both tiles of one pass over H), then applies SiLU-and-mul.
3. Down: one program per (tile, BN columns of H) multiplies the activations by its expert's down rows and
   scales each row by its routing weight, in float32.
4. Combine: one program per (token, BN columns of H) sums its K slots' rows in k order (no atomics, so the
   sum is deterministic) and casts to the dtype.
The GEMMs accumulate in float32 and round where F.linear rounds (after each projection).
"""

import torch
import triton
import triton.language as tl

from . import pow2, precision


@triton.jit
def _tile(tex_ptr, tst_ptr, tend_ptr, BM: tl.constexpr, BN: tl.constexpr):
    """This program's expert, its tile's sorted rows and their mask, and its output columns."""
    tile = tl.program_id(0)
    rows = tl.load(tst_ptr + tile) + tl.arange(0, BM)
    cols = tl.program_id(1) * BN + tl.arange(0, BN)
    return tl.load(tex_ptr + tile).to(tl.int64), rows, rows < tl.load(tend_ptr + tile), cols


@triton.jit
def _gate_up(x_ptr, w_ptr, order_ptr, tex_ptr, tst_ptr, tend_ptr, act_ptr, h, inter, k_top, sxt, swe, swn, swk,
             PREC: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    e, rows, rm, cols = _tile(tex_ptr, tst_ptr, tend_ptr, BM, BN)
    tok = tl.load(order_ptr + rows, mask=rm, other=0) // k_top
    cm = cols < inter
    acc_g = tl.zeros([BM, BN], tl.float32)
    acc_u = tl.zeros([BM, BN], tl.float32)
    for k0 in range(0, h, BK):
        kk = k0 + tl.arange(0, BK)
        km = kk < h
        a = tl.load(x_ptr + tok[:, None] * sxt + kk[None, :], mask=rm[:, None] & km[None, :], other=0.0)
        wb = w_ptr + e * swe + kk[:, None] * swk
        bg = tl.load(wb + cols[None, :] * swn, mask=km[:, None] & cm[None, :], other=0.0)  # [BK, BN]
        bu = tl.load(wb + (cols + inter)[None, :] * swn, mask=km[:, None] & cm[None, :], other=0.0)
        acc_g = tl.dot(a, bg, acc_g, input_precision=PREC)
        acc_u = tl.dot(a, bu, acc_u, input_precision=PREC)
    ty = act_ptr.dtype.element_ty
    g = acc_g.to(ty).to(tl.float32)
    u = acc_u.to(ty).to(tl.float32)
    act = (g / (1.0 + tl.exp(-g))).to(ty).to(tl.float32) * u
    tl.store(act_ptr + rows[:, None] * inter + cols[None, :], act.to(ty), mask=rm[:, None] & cm[None, :])


@triton.jit
def _down(act_ptr, w_ptr, rw_ptr, order_ptr, tex_ptr, tst_ptr, tend_ptr, y_ptr, h, inter, swe, swn, swk,
          PREC: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    e, rows, rm, cols = _tile(tex_ptr, tst_ptr, tend_ptr, BM, BN)
    cm = cols < h
    acc = tl.zeros([BM, BN], tl.float32)
    for k0 in range(0, inter, BK):
        kk = k0 + tl.arange(0, BK)
        km = kk < inter
        a = tl.load(act_ptr + rows[:, None] * inter + kk[None, :], mask=rm[:, None] & km[None, :], other=0.0)
        b = tl.load(w_ptr + e * swe + cols[None, :] * swn + kk[:, None] * swk, mask=km[:, None] & cm[None, :],
                    other=0.0)
        acc = tl.dot(a, b, acc, input_precision=PREC)
    slot = tl.load(order_ptr + rows, mask=rm, other=0)
    rw = tl.load(rw_ptr + slot, mask=rm, other=0.0).to(tl.float32)
    y = acc.to(act_ptr.dtype.element_ty).to(tl.float32) * rw[:, None]
    tl.store(y_ptr + rows[:, None] * h + cols[None, :], y, mask=rm[:, None] & cm[None, :])


@triton.jit
def _combine(y_ptr, pos_ptr, out_ptr, h, K: tl.constexpr, BN: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BN + tl.arange(0, BN)
    cm = cols < h
    acc = tl.zeros([BN], tl.float32)
    for j in tl.static_range(K):
        p = tl.load(pos_ptr + t * K + j)  # -1: a slot served by another rank
        row = tl.load(y_ptr + tl.maximum(p, 0) * h + cols, mask=cm, other=0.0)
        acc += tl.where(p >= 0, row, 0.0)
    tl.store(out_ptr + t * h + cols, acc.to(out_ptr.dtype.element_ty), mask=cm)


def moe_experts_fused(x, weights, ids, w_gate_up, w_down, expert_offset=0, choose=None) -> torch.Tensor:
    """x [T, H], routing weights [T, K], global ids [T, K], w_gate_up [E, 2I, H], w_down [E, H, I] (any
    strides: the runtime holds them transposed) -> out [T, H] in x.dtype (moe_experts.moe_experts_fused;
    ``choose`` picks among the torch form's paths, unused here)."""
    t, h = x.shape
    e, i2, _ = w_gate_up.shape
    inter, k = i2 // 2, ids.shape[1]
    dev = x.device
    out = torch.empty(t, h, dtype=x.dtype, device=dev)
    if t == 0:
        return out
    x = x if x.stride(-1) == 1 else x.contiguous()
    local = ids.reshape(-1).to(torch.int64) - expert_offset  # [S]
    local = torch.where((local >= 0) & (local < e), local, e)  # other ranks' slots sort last
    order = torch.argsort(local, stable=True)  # [S] slots by expert
    counts = torch.bincount(local, minlength=e + 1)[:e]  # [E]
    bm = 16 if t * k <= 64 * e else 64
    tiles = (counts + bm - 1) // bm
    n_tiles = int(tiles.sum())
    pos = torch.full((t * k,), -1, dtype=torch.int64, device=dev)  # each slot's row in the sorted order
    served = int(counts.sum())
    pos[order[:served]] = torch.arange(served, device=dev)
    if n_tiles:
        starts = torch.cumsum(counts, 0) - counts  # [E] first sorted row of each expert
        tile_e = torch.repeat_interleave(torch.arange(e, device=dev), tiles)  # [n_tiles]
        first_tile = torch.cumsum(tiles, 0) - tiles
        tile_start = starts[tile_e] + (torch.arange(n_tiles, device=dev) - first_tile[tile_e]) * bm
        tile_end = starts[tile_e] + counts[tile_e]
        act = torch.empty(served, inter, dtype=x.dtype, device=dev)
        y = torch.empty(served, h, dtype=torch.float32, device=dev)
        prec = precision(x.dtype)
        bn, bk = min(64, pow2(inter)), min(64, pow2(h))
        _gate_up[(n_tiles, triton.cdiv(inter, bn))](x, w_gate_up, order, tile_e, tile_start, tile_end, act, h, inter,
                                                     k, x.stride(0), *w_gate_up.stride(), PREC=prec, BM=bm, BN=bn,
                                                     BK=bk)
        bn, bk = min(64, pow2(h)), min(64, pow2(inter))
        _down[(n_tiles, triton.cdiv(h, bn))](act, w_down, weights.reshape(-1).contiguous(), order, tile_e, tile_start,
                                             tile_end, y, h, inter, *w_down.stride(), PREC=prec, BM=bm, BN=bn, BK=bk)
    else:
        y = torch.zeros(1, h, dtype=torch.float32, device=dev)
    bn = min(256, pow2(h))
    _combine[(t, triton.cdiv(h, bn))](y, pos, out, h, K=k, BN=bn)
    return out
