"""Triton paged decode attention, varlen prefill attention and MLA prefill (twins: paged_attention.py,
attention.py, mla.py).

# Legend: B sequences, Hq query heads, Hkv kv heads, G = Hq // Hkv, D qk head dim, Dv v head dim,
# NB cache blocks, BS tokens per block, Tq / Tk packed queries / keys, BM / BN query / key tile rows.

Decode: one program per (sequence, kv head) holds that head's G query heads as the rows of one tile
(GQA: K/V are read once per kv head, not once per query head) and walks the sequence's cache blocks with
an online softmax in float32; a sliding window starts the walk at the window's first block. An int8 cache
is dequantized in the tile with its per-token-and-head scales.
Prefill: one program per (sequence, query head, query tile) over the sequence's keys in tiles, causal
masks bottom-right aligned, so that queries after a cached prefix (cu_seqlens_k) see the prefix; only the
key tiles a tile's rows can see (causal, window) are read.
"""

import torch
import triton
import triton.language as tl

from ..mla import decompress
from . import pow2, precision


@triton.jit
def _paged_decode(q_ptr, k_ptr, v_ptr, ks_ptr, vs_ptr, tab_ptr, len_ptr, out_ptr, scale,
                  sqb, sqh, skn, skb, skh, svn, svb, svh, ssn, ssb, ssh, stb, sob, soh,
                  g, d, dv, bs, window, QUANT: tl.constexpr, PREC: tl.constexpr,
                  BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_N: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    kvh = tl.program_id(1).to(tl.int64)
    n = tl.load(len_ptr + b).to(tl.int64)
    gi = tl.arange(0, BLOCK_G)
    di = tl.arange(0, BLOCK_D)
    vi = tl.arange(0, BLOCK_DV)
    ni = tl.arange(0, BLOCK_N)
    heads = kvh * g + gi
    q = tl.load(q_ptr + b * sqb + heads[:, None] * sqh + di[None, :], mask=(gi < g)[:, None] & (di < d)[None, :],
                other=0.0)
    if QUANT:
        q = q.to(tl.float32)
    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_DV], tl.float32)
    start = 0
    if window > 0:
        start = tl.maximum(n - window, 0)
    for blk in range(start // bs, (n + bs - 1) // bs):
        bid = tl.load(tab_ptr + b * stb + blk).to(tl.int64)
        pos = blk * bs + ni
        ok = (ni < bs) & (pos < n) & (pos >= start)
        k = tl.load(k_ptr + bid * skn + ni[:, None] * skb + kvh * skh + di[None, :],
                    mask=ok[:, None] & (di < d)[None, :], other=0.0)
        v = tl.load(v_ptr + bid * svn + ni[:, None] * svb + kvh * svh + vi[None, :],
                    mask=ok[:, None] & (vi < dv)[None, :], other=0.0)
        if QUANT:
            k = k.to(tl.float32) * tl.load(ks_ptr + bid * ssn + ni * ssb + kvh * ssh, mask=ok, other=0.0)[:, None]
            v = v.to(tl.float32) * tl.load(vs_ptr + bid * ssn + ni * ssb + kvh * ssh, mask=ok, other=0.0)[:, None]
        s = tl.dot(q, tl.trans(k), input_precision=PREC) * scale  # [BLOCK_G, BLOCK_N]
        s = tl.where(ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))  # finite: every block walked holds a visible key
        p = tl.exp(s - m_new[:, None])
        alpha = tl.exp(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PREC)
        m_i = m_new
    out = tl.where(l_i[:, None] > 0, acc / tl.maximum(l_i, 1e-30)[:, None], 0.0)
    tl.store(out_ptr + b * sob + heads[:, None] * soh + vi[None, :], out.to(out_ptr.dtype.element_ty),
             mask=(gi < g)[:, None] & (vi < dv)[None, :])


def paged_decode_attention(q, k_cache, v_cache, block_tables, seq_lens, scale, k_scale=None, v_scale=None,
                           blocks_per_step=16, meta=None, window=None) -> torch.Tensor:
    """q [B, Hq, D] over the paged cache k_cache [NB, BS, Hkv, D], v_cache [NB, BS, Hkv, Dv] -> [B, Hq, Dv]
    (paged_attention.paged_decode_attention; ``blocks_per_step`` and ``meta`` belong to the torch form)."""
    b, hq, d = q.shape
    _, bs, hkv, _ = k_cache.shape
    dv = v_cache.shape[-1]
    out = torch.empty(b, hq, dv, dtype=q.dtype, device=q.device)
    if b == 0:
        return out
    quant = k_cache.dtype == torch.int8
    if quant and (k_scale is None or v_scale is None):
        raise ValueError("an int8 cache needs k_scale and v_scale [NB, BS, Hkv]")
    if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("the cache's last dimension must be contiguous")
    q = q if q.stride(-1) == 1 else q.contiguous()
    tables, lens = block_tables.contiguous(), seq_lens.contiguous()
    ks, vs = (k_scale.contiguous(), v_scale.contiguous()) if quant else (k_cache, v_cache)
    sst = ks.stride()[:3] if quant else (0, 0, 0)
    g = hq // hkv
    _paged_decode[(b, hkv)](q, k_cache, v_cache, ks, vs, tables, lens, out, scale, q.stride(0), q.stride(1),
                            *k_cache.stride()[:3], *v_cache.stride()[:3], *sst, tables.stride(0),
                            out.stride(0), out.stride(1), g, d, dv, bs, int(window or 0), QUANT=quant,
                            PREC="ieee" if quant else precision(q.dtype), BLOCK_G=pow2(g), BLOCK_D=pow2(d),
                            BLOCK_DV=pow2(dv), BLOCK_N=pow2(bs))
    return out


@triton.jit
def _varlen(q_ptr, k_ptr, v_ptr, cuq_ptr, cuk_ptr, out_ptr, scale, sqt, sqh, skt, skh, svt, svh, sot, soh,
            g, d, dv, window, CAUSAL: tl.constexpr, PREC: tl.constexpr, BLOCK_M: tl.constexpr,
            BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr):
    b = tl.program_id(0)
    h = tl.program_id(1).to(tl.int64)
    tile = tl.program_id(2)
    q0 = tl.load(cuq_ptr + b).to(tl.int64)
    lq = tl.load(cuq_ptr + b + 1).to(tl.int64) - q0
    k0 = tl.load(cuk_ptr + b).to(tl.int64)
    lk = tl.load(cuk_ptr + b + 1).to(tl.int64) - k0
    if tile * BLOCK_M < lq:
        kvh = h // g
        shift = lk - lq  # key position of the sequence's first query
        rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)
        di = tl.arange(0, BLOCK_D)
        vi = tl.arange(0, BLOCK_DV)
        rm = rows < lq
        q = tl.load(q_ptr + (q0 + rows)[:, None] * sqt + h * sqh + di[None, :], mask=rm[:, None] & (di < d)[None, :],
                    other=0.0)
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
        lo = 0
        hi = lk
        if CAUSAL:
            hi = tl.minimum(lk, shift + (tile + 1) * BLOCK_M)
            if window > 0:
                lo = tl.maximum(shift + tile * BLOCK_M - window + 1, 0)
        for c0 in range(lo, hi, BLOCK_N):
            cols = c0 + tl.arange(0, BLOCK_N)
            cm = cols < hi
            k = tl.load(k_ptr + (k0 + cols)[:, None] * skt + kvh * skh + di[None, :],
                        mask=cm[:, None] & (di < d)[None, :], other=0.0)
            v = tl.load(v_ptr + (k0 + cols)[:, None] * svt + kvh * svh + vi[None, :],
                        mask=cm[:, None] & (vi < dv)[None, :], other=0.0)
            s = tl.dot(q, tl.trans(k), input_precision=PREC) * scale  # [BLOCK_M, BLOCK_N]
            ok = cm[None, :] & rm[:, None]
            if CAUSAL:
                ok = ok & (cols[None, :] <= shift + rows[:, None])
                if window > 0:
                    ok = ok & (cols[None, :] > shift + rows[:, None] - window)
            s = tl.where(ok, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows that see no key yet
            p = tl.exp(s - m_safe[:, None])
            alpha = tl.exp(m_i - m_safe)
            l_i = l_i * alpha + tl.sum(p, axis=1)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PREC)
            m_i = m_new
        out = tl.where(l_i[:, None] > 0, acc / tl.maximum(l_i, 1e-30)[:, None], 0.0)
        tl.store(out_ptr + (q0 + rows)[:, None] * sot + h * soh + vi[None, :], out.to(out_ptr.dtype.element_ty),
                 mask=rm[:, None] & (vi < dv)[None, :])


def varlen_attention(q, k, v, cu_seqlens, scale, causal=True, cu_seqlens_k=None, q_tile=64, k_tile=64,
                     window=None) -> torch.Tensor:
    """q [Tq, Hq, D] over k [Tk, Hkv, D], v [Tk, Hkv, Dv] per sequence -> [Tq, Hq, Dv] (attention.varlen_attention;
    ``q_tile`` / ``k_tile`` are the tile rows here too, rounded up to powers of two of at least 16)."""
    if window is not None and not causal:
        raise ValueError("a sliding window needs causal attention")
    tq, hq, d = q.shape
    hkv, dv = k.shape[1], v.shape[2]
    if hq % hkv:
        raise ValueError("query heads must be a multiple of kv heads")
    cu_k = cu_seqlens if cu_seqlens_k is None else cu_seqlens_k
    qb, kb = cu_seqlens.tolist(), cu_k.tolist()
    for i in range(len(qb) - 1):
        lq, lk = qb[i + 1] - qb[i], kb[i + 1] - kb[i]
        if lq and (lk == 0 or (causal and lk < lq)):
            raise ValueError(f"sequence {i}: {lq} queries over {lk} keys")
    out = torch.empty(tq, hq, dv, dtype=q.dtype, device=q.device)
    max_q = max((qb[i + 1] - qb[i] for i in range(len(qb) - 1)), default=0)
    if max_q == 0:
        return out
    q, k, v = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, k, v))
    bm, bn = pow2(min(q_tile, max_q)), pow2(min(k_tile, max(kb[i + 1] - kb[i] for i in range(len(kb) - 1))))
    grid = (len(qb) - 1, hq, triton.cdiv(max_q, bm))
    _varlen[grid](q, k, v, cu_seqlens.contiguous(), cu_k.contiguous(), out, scale, q.stride(0), q.stride(1),
                  k.stride(0), k.stride(1), v.stride(0), v.stride(1), out.stride(0), out.stride(1), hq // hkv, d, dv,
                  int(window or 0), CAUSAL=causal, PREC=precision(q.dtype), BLOCK_M=bm, BLOCK_N=bn,
                  BLOCK_D=pow2(d), BLOCK_DV=pow2(dv))
    return out


def mla_prefill(q_nope, q_pe, c_kv, k_pe, kv_b_weight, v_head_dim, cu_seqlens, scale, causal=True,
                cu_seqlens_k=None) -> torch.Tensor:
    """MLA prefill (mla.mla_prefill): the latents decompressed by kv_b_proj (a GEMM), then the varlen kernel."""
    q, k, v = decompress(q_nope, q_pe, c_kv, k_pe, kv_b_weight, v_head_dim)
    return varlen_attention(q, k, v, cu_seqlens, scale, causal=causal, cu_seqlens_k=cu_seqlens_k)
