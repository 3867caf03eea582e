"""Attention of the decoder layers: GQA/MHA/MQA (llama family) and DeepSeek's multi-head latent (MLA).

# Legend: T tokens (all sequences concatenated), B sequences, H this rank's query heads, Hkv its kv heads, D head dim,
# Dn / Dr / Dv MLA nope / rope / value head dims, R kv_lora_rank.

Prefill attends over the step's own keys with the tiled varlen kernel and writes them to the paged
cache; decode writes the new token's keys and attends over the cache. MLA caches one latent
[c_kv | k_pe] (R + Dr values) per token and decodes with the weight-absorbed kernel.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from adapt.runtime.models.batch import ForwardBatch
from adapt.runtime.models.layers import ColumnParallelLinear, Linear, RMSNorm, RowParallelLinear
from adapt.runtime.models.names import LayoutNames
from adapt.runtime.parallel import ParallelContext
from adapt.spec import ModelSpec, RopeSpec
from adapt.runtime.kernels import fused, kv_write, norm, rope
from adapt.runtime.module import Module

_JOINED = (torch.float32, torch.bfloat16)  # the dtypes of the fused qk_norm_rope


def rope_scaling(rope: RopeSpec, max_position_embeddings: int) -> dict:
    """The transformers rope_parameters dict of a RopeSpec (what rope_inv_freq / mla_softmax_scale read)."""
    if rope.type == "default":
        return {}
    p = {**dict(rope.params), "rope_type": rope.type, "factor": rope.factor}
    if rope.type == "yarn":
        p.setdefault("original_max_position_embeddings", max_position_embeddings)
    return p


class Rotary:
    """inv_freq and attention factor of the model's rope; cos/sin [T, Dr] computed once per step."""

    def __init__(self, spec: ModelSpec, rotary_dim: int, layout: str, kernels):
        self.layout = layout
        scaling = rope_scaling(spec.rope, spec.max_position_embeddings)
        with torch.device("cpu"):  # the model is built on the meta device; this is real data
            self.inv_freq, self.factor = kernels.rope_inv_freq(rotary_dim, spec.rope.theta, scaling,
                                                               spec.max_position_embeddings)
        self._on: dict = {}

    def freq_on(self, device: torch.device) -> torch.Tensor:
        if device not in self._on:
            self._on[device] = self.inv_freq.to(device)
        return self._on[device]

    def cos_sin(self, batch: ForwardBatch, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        key = (id(self), dtype)
        if key not in batch.rope:
            batch.rope[key] = batch.kernels.rope_cos_sin(self.freq_on(batch.positions.device), batch.positions,
                                                         self.factor, dtype)
        return batch.rope[key]


class GQAAttention(Module):
    def __init__(self, spec: ModelSpec, n: LayoutNames, i: int, ctx: ParallelContext):
        super().__init__()
        a = spec.attention
        self.head_dim = d = a.head_dim
        self.num_heads = a.num_heads // ctx.tp_size
        self.num_kv_heads = max(1, a.num_kv_heads // ctx.tp_size)  # replicated when tp > kv heads
        self.scale = d ** -0.5
        self.qkv_proj = ColumnParallelLinear(
            [(n(i, "attn_q"), n.get(i, "attn_q_bias"), self.num_heads * d),
             (n(i, "attn_k"), n.get(i, "attn_k_bias"), self.num_kv_heads * d),
             (n(i, "attn_v"), n.get(i, "attn_v_bias"), self.num_kv_heads * d)], spec.hidden_size, ctx)
        self.o_proj = RowParallelLinear(n(i, "attn_o"), n.get(i, "attn_o_bias"), self.num_heads * d,
                                        spec.hidden_size, ctx)
        self.q_norm = RMSNorm(n(i, "q_norm"), d, spec.rms_norm_eps) if a.qk_norm else None
        self.k_norm = RMSNorm(n(i, "k_norm"), d, spec.rms_norm_eps) if a.qk_norm else None
        self.window = a.window_of(i)  # sliding window of this layer, None for full attention
        self.rotary: Rotary | None = None  # set by the model (shared by every layer)

    def _joined(self, k_, qkv: torch.Tensor, cos: torch.Tensor, cache):
        """The fused C++ qk_norm_rope when it computes exactly what this layer's kernels would: they are the
        fused forms of rms_norm, apply_rope and write_kv_cache that it joins (kernels/norm.py, rope.py,
        kv_write.py, whose row functions it runs in the same order) and every tensor is one they take;
        else None."""
        ext = fused.vectorized()
        if (ext is None or k_.apply_rope is not rope.apply_rope or self.rotary.layout != "rotate_half"
                or qkv.device.type != "cpu" or qkv.dtype not in _JOINED or qkv.requires_grad or not qkv.shape[0]
                or qkv.stride(1) != 1 or cos.dtype != qkv.dtype or cos.shape[-1] != self.head_dim):
            return None
        qn, kn = self.q_norm, self.k_norm
        if qn is not None and (k_.rms_norm is not norm.rms_norm or qn.eps != kn.eps
                               or qn.weight.dtype != qkv.dtype or kn.weight.dtype != qkv.dtype
                               or qn.weight.requires_grad or kn.weight.requires_grad):
            return None
        if cache is not None and (k_.write_kv_cache is not kv_write.write_kv_cache or cache.k_scale is not None
                                  or cache.k.dtype != qkv.dtype or cache.v.dtype != qkv.dtype
                                  or cache.k.stride(-1) != 1 or cache.v.stride(-1) != 1):
            return None
        return ext

    def forward(self, x: torch.Tensor, batch: ForwardBatch, layer: int) -> torch.Tensor:
        k_ = batch.kernels
        t = x.shape[0]
        h, hkv, d = self.num_heads, self.num_kv_heads, self.head_dim
        qkv = self.qkv_proj(x)  # [T, (H + 2 Hkv) D]
        cos, sin = self.rotary.cos_sin(batch, qkv.dtype)
        cache = batch.kv[layer] if batch.kv is not None else None
        slots = batch.slot_mapping if cache is not None else None
        if slots is not None and slots.dtype != torch.long:
            slots = slots.long()
        ext = self._joined(k_, qkv, cos, cache if slots is not None else None)
        v = None
        if ext is not None:  # norms, rope and the cache write in one call
            qn, kn = self.q_norm, self.k_norm
            w = slots is not None
            q, k = ext.qk_norm_rope(qkv, h, hkv, qn.weight if qn is not None else None,
                                    kn.weight if kn is not None else None, qn.eps if qn is not None else 0.0, cos,
                                    sin, cache.k if w else None, cache.v if w else None,
                                    slots.contiguous() if w else None)
        else:
            v = qkv[:, (h + hkv) * d:].view(t, hkv, d)  # [T, Hkv, D]
            if self.q_norm is None:  # q and k are adjacent columns: rotate them as one [T, H + Hkv, D] tensor
                qk = k_.apply_rope(qkv[:, : (h + hkv) * d].view(t, h + hkv, d), cos, sin, self.rotary.layout)
                q, k = qk.split([h, hkv], dim=1)  # [T, H, D], [T, Hkv, D]
            else:
                q = k_.rms_norm(qkv[:, : h * d].view(t, h, d), self.q_norm.weight, self.q_norm.eps)
                k = k_.rms_norm(qkv[:, h * d: (h + hkv) * d].view(t, hkv, d), self.k_norm.weight, self.k_norm.eps)
                q = k_.apply_rope(q, cos, sin, self.rotary.layout)
                k = k_.apply_rope(k, cos, sin, self.rotary.layout)
            if slots is not None:
                k_.write_kv_cache(k, v, cache.k, cache.v, batch.slot_mapping, cache.k_scale, cache.v_scale,
                                  checked=batch.slots_checked())
        if batch.is_prefill:
            if v is None:
                v = qkv[:, (h + hkv) * d:].view(t, hkv, d)
            qt, kt = batch.attn_tiles
            cu_k = None
            if batch.context_slots is not None:  # keys of the cached prefix too, read back from the cache
                k = _gather_cache(k_, cache.k, cache.k_scale, batch.context_slots, k.dtype)
                v = _gather_cache(k_, cache.v, cache.v_scale, batch.context_slots, v.dtype)
                cu_k = batch.cu_seqlens_k
            o = k_.varlen_attention(q, k, v, batch.cu_seqlens, self.scale, True, cu_k, qt, kt, self.window)
        else:
            o = k_.paged_decode_attention(q, cache.k, cache.v, batch.block_tables, batch.seq_lens, self.scale,
                                          cache.k_scale, cache.v_scale, meta=batch.decode_meta(cache.k.shape[1]),
                                          window=self.window)
        return self.o_proj(o.reshape(t, self.num_heads * self.head_dim))


class MLAAttention(Module):
    def __init__(self, spec: ModelSpec, n: LayoutNames, i: int, ctx: ParallelContext):
        super().__init__()
        a = spec.attention
        self.num_heads = a.num_heads // ctx.tp_size
        self.dn, self.dr, self.dv, self.r = a.qk_nope_head_dim, a.qk_rope_head_dim, a.v_head_dim, a.kv_lora_rank
        h, qd = spec.hidden_size, a.qk_nope_head_dim + a.qk_rope_head_dim
        eps = spec.rms_norm_eps
        if a.q_lora_rank:
            self.q_a_proj = Linear(n(i, "attn_q_a"), h, a.q_lora_rank)
            self.q_a_norm = RMSNorm(n(i, "q_a_norm"), a.q_lora_rank, eps)
            self.q_proj = ColumnParallelLinear([(n(i, "attn_q_b"), None, self.num_heads * qd)], a.q_lora_rank, ctx)
        else:
            self.q_a_proj = self.q_a_norm = None
            self.q_proj = ColumnParallelLinear([(n(i, "attn_q"), None, self.num_heads * qd)], h, ctx)
        self.kv_a_proj = Linear(n(i, "attn_kv_a"), h, self.r + self.dr)
        self.kv_a_norm = RMSNorm(n(i, "kv_a_norm"), self.r, eps)
        self.kv_b_proj = ColumnParallelLinear([(n(i, "attn_kv_b"), None, self.num_heads * (self.dn + self.dv))],
                                              self.r, ctx)
        self.kv_b_proj.any_layout = False  # the absorbed decode reads its weight per head
        self.o_proj = RowParallelLinear(n(i, "attn_o"), n.get(i, "attn_o_bias"), self.num_heads * self.dv, h, ctx)
        self.scale: float = qd ** -0.5  # set by the model with the yarn mscale
        self.rotary: Rotary | None = None

    def forward(self, x: torch.Tensor, batch: ForwardBatch, layer: int) -> torch.Tensor:
        k_ = batch.kernels
        t = x.shape[0]
        if self.q_a_proj is not None:
            qa = self.q_a_proj(x)
            q = self.q_proj(k_.rms_norm(qa, self.q_a_norm.weight, self.q_a_norm.eps))
        else:
            q = self.q_proj(x)
        q_nope, q_pe = q.view(t, self.num_heads, self.dn + self.dr).split([self.dn, self.dr], -1)
        c_kv, k_pe = self.kv_a_proj(x).split([self.r, self.dr], -1)  # [T, R], [T, Dr]
        c_kv = k_.rms_norm(c_kv, self.kv_a_norm.weight, self.kv_a_norm.eps)
        cos, sin = self.rotary.cos_sin(batch, q.dtype)
        q_pe = k_.apply_rope(q_pe, cos, sin, self.rotary.layout)
        k_pe = k_.apply_rope(k_pe[:, None, :], cos, sin, self.rotary.layout)[:, 0]
        cache = batch.kv[layer] if batch.kv is not None else None
        w = self.kv_b_proj.weight
        if cache is not None and batch.slot_mapping is not None:
            if cache.k_scale is None:
                k_.write_mla_cache(c_kv, k_pe, cache.k, batch.slot_mapping)
            else:
                _write_int8_latent(k_, c_kv, k_pe, cache, batch.slot_mapping)
        if batch.is_prefill:
            cu_k = None
            if batch.context_slots is not None:  # the cached prefix's latents too, read back from the cache
                lat = _gather_cache(k_, cache.k, cache.k_scale[..., 0] if cache.k_scale is not None else None,
                                    batch.context_slots, c_kv.dtype)  # [Tk, R + Dr]
                c_kv, k_pe = lat[:, : self.r], lat[:, self.r:]
                cu_k = batch.cu_seqlens_k
            o = k_.mla_prefill(q_nope, q_pe, c_kv, k_pe, w, self.dv, batch.cu_seqlens, self.scale,
                               cu_seqlens_k=cu_k)
        else:
            latent, tables = cache.k, batch.block_tables
            if cache.k_scale is not None:
                latent, tables = _dequantize_used_blocks(k_, cache, tables, batch.seq_lens, q.dtype)
            o = k_.mla_decode(q_nope, q_pe, latent, tables, batch.seq_lens, w, self.dv, self.scale)
        return self.o_proj(o.reshape(t, self.num_heads * self.dv))


def _gather_cache(k_, cache: torch.Tensor, scale: torch.Tensor | None, slots: torch.Tensor,
                  dtype: torch.dtype) -> torch.Tensor:
    """Rows of the paged cache [NB, BS, ...] at ``slots`` [Tk] -> [Tk, ...] in ``dtype`` (int8 dequantized)."""
    flat = cache.view(cache.shape[0] * cache.shape[1], *cache.shape[2:])
    rows = flat.index_select(0, slots)
    if scale is None:
        return rows.to(dtype)
    s = scale.reshape(scale.shape[0] * scale.shape[1], *scale.shape[2:]).index_select(0, slots)
    return k_.dequantize_int8(rows, s, dtype)


def _write_int8_latent(k_, c_kv, k_pe, cache, slots) -> None:
    # int8 latent cache: one scale per token ([NB, BS, 1]), quantized over the whole latent
    keep = slots >= 0
    nb, bs, w = cache.k.shape
    q, s = k_.quantize_int8(torch.cat((c_kv[keep], k_pe[keep]), dim=-1))  # [T', R + Dr], [T']
    idx = slots[keep].long()
    cache.k.view(nb * bs, w).index_copy_(0, idx, q)
    cache.k_scale.view(nb * bs, 1).index_copy_(0, idx, s[:, None].to(cache.k_scale.dtype))


def _dequantize_used_blocks(k_, cache, tables, seq_lens, dtype):
    # The absorbed MLA kernel reads a float latent cache: dequantize only the blocks this batch uses
    # into a compact pool and renumber the block tables into it.
    bs = cache.k.shape[1]
    nblk = (seq_lens.long() + bs - 1) // bs  # [B]
    valid = torch.arange(tables.shape[1], device=tables.device)[None, :] < nblk[:, None]
    used, inverse = torch.unique(tables.long().clamp(min=0)[valid], return_inverse=True)
    compact = k_.dequantize_int8(cache.k[used], cache.k_scale[used, :, 0], dtype)  # [U, BS, R + Dr]
    new_tables = torch.zeros_like(tables)
    new_tables[valid] = inverse.to(tables.dtype)
    return compact, new_tables
