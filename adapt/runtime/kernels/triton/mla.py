"""Triton MLA decode over the paged latent cache, weight-absorbed (twin: mla.mla_decode_ref).

# Legend: B sequences, H heads, Dn / Dr / Dv nope / rope / value head dims, R kv_lora_rank,
# NB cache blocks, BS tokens per block.

The latent cache holds one row [c_kv (R) | k_pe (Dr)] per token, shared by every head. The query is
absorbed into the latent space (q_lat = q_nope W_UK, [B, H, R]) so that the cache is never decompressed:
score = q_lat . c + q_pe . k_pe, and the output latent o = softmax . c is projected by W_UV afterwards.
One program per sequence takes all H heads as the rows of one tile and reads each latent row once for
both the scores and the values (FlashMLA's layout of the work); absorption and projection are GEMMs.
"""

import torch
import triton
import triton.language as tl

from . import pow2, precision


@triton.jit
def _mla_decode(ql_ptr, qp_ptr, lat_ptr, tab_ptr, len_ptr, out_ptr, scale, sqb, sqh, spb, sph, sln, slb, stb,
                sob, soh, h, r, dr, bs, PREC: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_R: tl.constexpr,
                BLOCK_DR: tl.constexpr, BLOCK_N: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    n = tl.load(len_ptr + b).to(tl.int64)
    hi = tl.arange(0, BLOCK_H)
    ri = tl.arange(0, BLOCK_R)
    pi = tl.arange(0, BLOCK_DR)
    ni = tl.arange(0, BLOCK_N)
    hm = hi < h
    ql = tl.load(ql_ptr + b * sqb + hi[:, None] * sqh + ri[None, :], mask=hm[:, None] & (ri < r)[None, :], other=0.0)
    qp = tl.load(qp_ptr + b * spb + hi[:, None] * sph + pi[None, :], mask=hm[:, None] & (pi < dr)[None, :],
                 other=0.0)
    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_R], tl.float32)
    for blk in range(0, (n + bs - 1) // bs):
        bid = tl.load(tab_ptr + b * stb + blk).to(tl.int64)
        ok = (ni < bs) & (blk * bs + ni < n)
        row = lat_ptr + bid * sln + ni[:, None] * slb
        c = tl.load(row + ri[None, :], mask=ok[:, None] & (ri < r)[None, :], other=0.0).to(tl.float32)
        kp = tl.load(row + r + pi[None, :], mask=ok[:, None] & (pi < dr)[None, :], other=0.0).to(tl.float32)
        s = (tl.dot(ql, tl.trans(c), input_precision=PREC) + tl.dot(qp, tl.trans(kp), input_precision=PREC)) * scale
        s = tl.where(ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        p = tl.exp(s - m_new[:, None])
        alpha = tl.exp(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p, c, input_precision=PREC)
        m_i = m_new
    out = tl.where(l_i[:, None] > 0, acc / tl.maximum(l_i, 1e-30)[:, None], 0.0)
    tl.store(out_ptr + b * sob + hi[:, None] * soh + ri[None, :], out, mask=hm[:, None] & (ri < r)[None, :])


def mla_decode(q_nope, q_pe, latent_cache, block_tables, seq_lens, kv_b_weight, v_head_dim, scale) -> torch.Tensor:
    """q_nope [B, H, Dn], q_pe [B, H, Dr] over latent_cache [NB, BS, R + Dr] -> [B, H, Dv] (mla.mla_decode).
    Absorption, attention and projection in float32, as the torch form."""
    b, h, dn = q_nope.shape
    nb, bs, w = latent_cache.shape
    r = kv_b_weight.shape[1]
    wkv = kv_b_weight.float().view(h, dn + v_head_dim, r)
    w_uk, w_uv = wkv[:, :dn], wkv[:, dn:]  # [H, Dn, R], [H, Dv, R]
    q_lat = torch.einsum("bhn,hnr->bhr", q_nope.float(), w_uk).contiguous()  # [B, H, R]
    q_pe = q_pe.float().contiguous()
    lat = latent_cache if latent_cache.stride(-1) == 1 else latent_cache.contiguous()
    o_lat = torch.empty(b, h, r, dtype=torch.float32, device=q_nope.device)
    if b:
        tables, lens = block_tables.contiguous(), seq_lens.contiguous()
        _mla_decode[(b,)](q_lat, q_pe, lat, tables, lens, o_lat, scale, q_lat.stride(0), q_lat.stride(1),
                          q_pe.stride(0), q_pe.stride(1), lat.stride(0), lat.stride(1), tables.stride(0),
                          o_lat.stride(0), o_lat.stride(1), h, r, w - r, bs, PREC=precision(torch.float32),
                          BLOCK_H=pow2(h), BLOCK_R=pow2(r), BLOCK_DR=pow2(w - r), BLOCK_N=pow2(bs))
    return torch.einsum("bhr,hvr->bhv", o_lat, w_uv).to(q_nope.dtype)  # [B, H, Dv]
