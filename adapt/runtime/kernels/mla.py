"""DeepSeek multi-head latent attention (MLA): naive prefill and weight-absorbed paged decode.

# Legend: T packed tokens, B sequences, H heads, R kv_lora_rank, Dn qk_nope_head_dim,
# Dr qk_rope_head_dim, Dv v_head_dim, NB cache blocks, BS tokens per block, MAXB table width.

Per token and layer the cache keeps one vector latent = [c_kv (R, after kv_a_layernorm) | k_pe (Dr,
roped)], as latent_cache [NB, BS, R + Dr]. kv_b_proj.weight is [H * (Dn + Dv), R]; as in
transformers' DeepseekV3Attention.expand_kv, its rows are grouped per head, nope rows first:
W.view(H, Dn + Dv, R) = [W_UK (Dn rows) | W_UV (Dv rows)] for each head.

Naive form: k_nope, v = split(c_kv @ W^T), k = [k_nope | k_pe], q = [q_nope | q_pe], attention.
Absorbed form: q_nope . k_nope = q_nope . (W_UK c_kv) = (W_UK^T q_nope) . c_kv, so with
q_lat = W_UK^T q_nope [B, H, R] the scores are q_lat . c_kv + q_pe . k_pe: an MQA over the latent
cache with one kv head whose key is the whole latent and whose value is c_kv; the latent output
o_lat [B, H, R] is then mapped by W_UV to [B, H, Dv]. The decompressed K/V are never formed.
"""

import math
from collections.abc import Mapping

import torch
import torch.nn.functional as F

from .attention import varlen_attention
from .paged_attention import paged_decode_attention


def mla_softmax_scale(qk_head_dim: int, rope_scaling: Mapping | None = None) -> float:
    """qk_head_dim ** -0.5, times mscale ** 2 when yarn-style scaling with mscale_all_dim is set
    (transformers' yarn_apply_mscale: mscale = 0.1 * mscale_all_dim * ln(factor) + 1 if factor > 1)."""
    scaling = qk_head_dim ** (-0.5)
    p = rope_scaling or {}
    if p.get("rope_type", p.get("type", "default")) != "default":
        mscale_all_dim = p.get("mscale_all_dim", 0)
        if mscale_all_dim:
            factor = p["factor"]
            mscale = 1.0 if factor <= 1 else 0.1 * mscale_all_dim * math.log(factor) + 1.0
            scaling = scaling * mscale * mscale
    return scaling


def _split_kv_b(kv_b_weight: torch.Tensor, num_heads: int, v_head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    r = kv_b_weight.shape[1]
    w = kv_b_weight.view(num_heads, -1, r)  # [H, Dn + Dv, R]
    dn = w.shape[1] - v_head_dim
    return w[:, :dn], w[:, dn:]  # W_UK [H, Dn, R], W_UV [H, Dv, R]


def mla_prefill(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    c_kv: torch.Tensor,
    k_pe: torch.Tensor,
    kv_b_weight: torch.Tensor,
    v_head_dim: int,
    cu_seqlens: torch.Tensor,
    scale: float,
    causal: bool = True,
    cu_seqlens_k: torch.Tensor | None = None,
) -> torch.Tensor:
    """Naive MLA: q_nope [T, H, Dn], q_pe [T, H, Dr] (roped), c_kv [Tk, R] (normed), k_pe [Tk, Dr]
    (roped), kv_b_weight [H * (Dn + Dv), R], cu_seqlens [B + 1] -> out [T, H, Dv]. Keys are the queries'
    own tokens (Tk = T) unless cu_seqlens_k gives each sequence's keys (a cached prefix before its
    queries; causal masks bottom-right aligned)."""
    q, k, v = decompress(q_nope, q_pe, c_kv, k_pe, kv_b_weight, v_head_dim)
    return varlen_attention(q, k, v, cu_seqlens, scale, causal=causal, cu_seqlens_k=cu_seqlens_k)


def decompress(q_nope, q_pe, c_kv, k_pe, kv_b_weight, v_head_dim):
    """MLA's latents decompressed by kv_b_proj into per-head attention inputs: q [T, H, Dn + Dr],
    k [Tk, H, Dn + Dr], v [Tk, H, Dv] (what any varlen attention kernel then takes)."""
    h, dn = q_nope.shape[1], q_nope.shape[2]
    tk = c_kv.shape[0]
    kv = F.linear(c_kv, kv_b_weight).view(tk, h, dn + v_head_dim)  # [Tk, H, Dn + Dv]
    k_nope, v = kv.split([dn, v_head_dim], dim=-1)
    k = torch.cat((k_nope, k_pe[:, None, :].expand(tk, h, k_pe.shape[-1])), dim=-1)  # [Tk, H, Dn + Dr]
    return torch.cat((q_nope, q_pe), dim=-1), k, v


def mla_decode(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    latent_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    kv_b_weight: torch.Tensor,
    v_head_dim: int,
    scale: float,
) -> torch.Tensor:
    """Weight-absorbed MLA decode: q_nope [B, H, Dn], q_pe [B, H, Dr] (roped), latent_cache
    [NB, BS, R + Dr], block_tables [B, MAXB], seq_lens [B], kv_b_weight [H * (Dn + Dv), R]
    -> out [B, H, Dv] (q_nope.dtype). Absorption and projection run in float32."""
    r = kv_b_weight.shape[1]
    w_uk, w_uv = _split_kv_b(kv_b_weight.float(), q_nope.shape[1], v_head_dim)
    q_lat = torch.einsum("bhn,hnr->bhr", q_nope.float(), w_uk)  # [B, H, R]
    q = torch.cat((q_lat, q_pe.float()), dim=-1)  # [B, H, R + Dr]
    keys = latent_cache.unsqueeze(2)  # [NB, BS, 1, R + Dr]
    values = latent_cache[..., :r].unsqueeze(2)  # [NB, BS, 1, R], a view
    o_lat = paged_decode_attention(q, keys, values, block_tables, seq_lens, scale)  # [B, H, R] fp32
    return torch.einsum("bhr,hvr->bhv", o_lat, w_uv).to(q_nope.dtype)  # [B, H, Dv]


def write_mla_cache(
    c_kv: torch.Tensor, k_pe: torch.Tensor, latent_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Write [c_kv [T, R] | k_pe [T, Dr]] into latent_cache [NB, BS, R + Dr] in place at
    slot_mapping [T] (slot = block * BS + offset; negative slots are skipped)."""
    keep = slot_mapping >= 0
    nb, bs, w = latent_cache.shape
    rows = torch.cat((c_kv[keep], k_pe[keep]), dim=-1).to(latent_cache.dtype)  # [T', R + Dr]
    latent_cache.view(nb * bs, w).index_copy_(0, slot_mapping[keep].to(torch.long), rows)


def _mla_attend_ref(qn, qp, c, kp, kv_b_weight, v_head_dim, scale, allowed):
    # qn [Lq, H, Dn], qp [Lq, H, Dr], c [Lk, R], kp [Lk, Dr], allowed [Lq, Lk] -> [Lq, H, Dv]
    h, dn = qn.shape[1], qn.shape[2]
    kv = (c @ kv_b_weight.t()).view(c.shape[0], h, dn + v_head_dim)
    k_nope, v = kv[..., :dn], kv[..., dn:]
    k = torch.cat((k_nope, kp[:, None, :].expand(-1, h, -1)), dim=-1).transpose(0, 1)  # [H, Lk, Dn + Dr]
    q = torch.cat((qn, qp), dim=-1).transpose(0, 1)  # [H, Lq, Dn + Dr]
    scores = torch.matmul(q, k.transpose(1, 2)) * scale  # [H, Lq, Lk]
    scores = scores.masked_fill(~allowed, float("-inf"))
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(qn.dtype)
    return torch.matmul(probs, v.transpose(0, 1)).transpose(0, 1)


def mla_prefill_ref(q_nope, q_pe, c_kv, k_pe, kv_b_weight, v_head_dim, cu_seqlens, scale, causal=True,
                    cu_seqlens_k=None):
    """Reference twin of mla_prefill: per sequence, decompress and take a full softmax."""
    out = q_nope.new_zeros(q_nope.shape[0], q_nope.shape[1], v_head_dim)
    bounds = cu_seqlens.tolist()
    kb = bounds if cu_seqlens_k is None else cu_seqlens_k.tolist()
    for b in range(len(bounds) - 1):
        s0, s1 = bounds[b], bounds[b + 1]
        k0, k1 = kb[b], kb[b + 1]
        if s1 == s0:
            continue
        allowed = torch.ones(s1 - s0, k1 - k0, dtype=torch.bool, device=q_nope.device)
        allowed = allowed.tril(diagonal=(k1 - k0) - (s1 - s0)) if causal else allowed
        out[s0:s1] = _mla_attend_ref(
            q_nope[s0:s1], q_pe[s0:s1], c_kv[k0:k1], k_pe[k0:k1], kv_b_weight, v_head_dim, scale, allowed
        )
    return out


def mla_decode_ref(q_nope, q_pe, latent_cache, block_tables, seq_lens, kv_b_weight, v_head_dim, scale):
    """Reference twin of mla_decode: per sequence, gather the latent rows token by token,
    decompress them with the full kv_b_proj (no absorption) and take a plain softmax."""
    r = kv_b_weight.shape[1]
    bs = latent_cache.shape[1]
    out = q_nope.new_zeros(q_nope.shape[0], q_nope.shape[1], v_head_dim)
    for i in range(q_nope.shape[0]):
        n = int(seq_lens[i])
        if n == 0:
            continue
        rows = torch.stack([latent_cache[int(block_tables[i, j // bs]), j % bs] for j in range(n)])  # [n, R + Dr]
        rows = rows.to(q_nope.dtype)
        allowed = torch.ones(1, n, dtype=torch.bool, device=q_nope.device)
        out[i] = _mla_attend_ref(
            q_nope[i : i + 1], q_pe[i : i + 1], rows[:, :r], rows[:, r:], kv_b_weight, v_head_dim, scale, allowed
        )[0]
    return out


def write_mla_cache_ref(c_kv, k_pe, latent_cache, slot_mapping) -> None:
    """Reference twin of write_mla_cache: one token at a time."""
    bs = latent_cache.shape[1]
    for t in range(c_kv.shape[0]):
        slot = int(slot_mapping[t])
        if slot >= 0:
            latent_cache[slot // bs, slot % bs] = torch.cat((c_kv[t], k_pe[t])).to(latent_cache.dtype)
