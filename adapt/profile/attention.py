"""Attention rows of one decoder layer: GQA/MHA, and MLA (DeepSeek-V2/V3, Kimi-K2).

Attention-core FLOPs are the two matmuls, QK^T and PV: 2 * (d_qk + d_v) per (query, key) pair and head
(FlashAttention-2 paper, sec. 4.1, counts 4 * seqlen^2 * head_dim * heads for d_qk = d_v, halved for a
causal mask); softmax (~5 FLOPs per score) is left out. Prefill is causal: a sequence of L tokens has
L(L+1)/2 pairs (sliding window W: sum of min(i + 1, W)). Decode at context L: the new token attends
the L cached keys (the cache holds L tokens once this one is appended).

MLA (DeepSeek-V2 paper, sec. 2.1): prefill runs the decompressed form (kv_b_proj expands the latent
to per-head K and V, like transformers); decode runs the weight-absorbed form (W_UK folded into the
query, W_UV applied after attention, attention over the cached latent), as DeepSeek's inference code
does. ``absorb=False`` profiles decode as transformers runs it: kv_b_proj re-expands every cached
latent each step.
"""

from __future__ import annotations

from adapt.profile.costs import Dtypes, linear, norm, rope
from adapt.profile.memory import kv_bytes_per_token_per_layer, kv_cached_tokens
from adapt.profile.rows import ModuleRow
from adapt.spec import ModelSpec


def causal_pairs(length: int, window: int | None) -> int:
    """(query, key) pairs of one causal sequence of ``length`` tokens, with an optional sliding window."""
    if not window or window >= length:
        return length * (length + 1) // 2
    return window * (window + 1) // 2 + (length - window) * window


def _core(phase: str, kind: str, batch: int, q_len: int, pairs: int, heads: int, d_qk: int, d_v: int,
          kv_heads: int, k_len: int, kv_read: float, kv_write: float, dt: Dtypes, note: str,
          q_dim: int | None = None, k_dim: int | None = None, act_kv: bool = True) -> ModuleRow:
    a = dt.a
    q_dim = q_dim if q_dim is not None else d_qk
    read = batch * q_len * heads * q_dim * a
    if act_kv:  # K and V come from activations (prefill; decompressed decode)
        read += batch * k_len * kv_heads * ((k_dim if k_dim is not None else d_qk) + d_v) * a
    return ModuleRow("self_attn.attn", phase, "attention", "self_attn.attn", None, kind,
                     2.0 * batch * heads * pairs * (d_qk + d_v), 0.0, read, batch * q_len * heads * d_v * a,
                     kv_read, kv_write, input_shape=(batch, heads, q_len, q_dim),
                     output_shape=(batch, heads, q_len, d_v), compute_dtype=dt.act, note=note)


def attention_rows(spec: ModelSpec, phase: str, kind: str, batch: int, context: int, dt: Dtypes,
                   absorb: bool = True) -> list[ModuleRow]:
    """Rows of the attention sublayer (input norm included) of one layer of ``kind``."""
    at, h = spec.attention, spec.hidden_size
    prefill = phase == "prefill"
    q_len = context if prefill else 1
    t = batch * q_len
    keys = kv_cached_tokens(spec, context)
    pairs = causal_pairs(context, at.sliding_window) if prefill else keys
    kvpl = kv_bytes_per_token_per_layer(spec, dt.kv)
    kv_write = t * kvpl
    kv_read = 0.0 if prefill else batch * keys * kvpl
    rows = [norm("input_layernorm", phase, kind, t, h, dt)]
    if at.kind != "mla":
        hq, hk, d = at.num_heads, at.num_kv_heads, at.head_dim
        rows += [linear("self_attn.q_proj", phase, kind, t, h, hq * d, dt, at.qkv_bias),
                 linear("self_attn.k_proj", phase, kind, t, h, hk * d, dt, at.qkv_bias),
                 linear("self_attn.v_proj", phase, kind, t, h, hk * at.v_head_dim, dt, at.qkv_bias)]
        if at.qk_norm:
            rows += [norm("self_attn.q_norm", phase, kind, t, d, dt, hq), norm("self_attn.k_norm", phase, kind, t, d, dt, hk)]
        rows.append(rope("self_attn.rope", phase, kind, t, hq, hk, spec.rope.rotary_dim or d, dt))
        note = ("flash, causal" if prefill else f"{keys} cached keys") + (
            f", sliding window {at.sliding_window}" if at.sliding_window else "")
        rows.append(_core(phase, kind, batch, q_len, pairs, hq, d, at.v_head_dim, hk, q_len if prefill else 0,
                          kv_read, kv_write, dt, note, act_kv=prefill))
        rows.append(linear("self_attn.o_proj", phase, kind, t, hq * at.v_head_dim, h, dt, at.o_bias))
        return rows
    hq, nope, rdim, r, dv = at.num_heads, at.qk_nope_head_dim, at.qk_rope_head_dim, at.kv_lora_rank, at.v_head_dim
    if at.q_lora_rank:
        rows += [linear("self_attn.q_a_proj", phase, kind, t, h, at.q_lora_rank, dt),
                 norm("self_attn.q_a_layernorm", phase, kind, t, at.q_lora_rank, dt),
                 linear("self_attn.q_b_proj", phase, kind, t, at.q_lora_rank, hq * at.head_dim, dt)]
    else:
        rows.append(linear("self_attn.q_proj", phase, kind, t, h, hq * at.head_dim, dt))
    rows += [linear("self_attn.kv_a_proj_with_mqa", phase, kind, t, h, r + rdim, dt),
             norm("self_attn.kv_a_layernorm", phase, kind, t, r, dt)]
    rope_row = rope("self_attn.rope", phase, kind, t, hq, 1, rdim, dt)
    if prefill or not absorb:
        m = t if prefill else batch * keys  # decode without absorption re-expands every cached latent
        kvb = linear("self_attn.kv_b_proj", phase, kind, m, r, hq * (nope + dv), dt,
                     note="decompress latent to per-head K, V" + ("" if prefill else " for every cached token"))
        note = "decompressed MLA, flash, causal" if prefill else f"decompressed MLA, {keys} cached keys"
        core = _core(phase, kind, batch, q_len, pairs, hq, nope + rdim, dv, hq, q_len if prefill else keys,
                     kv_read, kv_write, dt, note)
        rows += [kvb, rope_row, core]
    else:
        # Weight absorption: q_nope . W_UK -> a query in latent space; attention over the latent cache
        # (scores on r + rope dims, values on r dims); W_UV maps the r-dim output back to v_head_dim.
        w_kvb = dt.matrix(hq * (nope + dv), r)
        w_uk, w_uv = w_kvb * nope / (nope + dv), w_kvb * dv / (nope + dv)
        a = dt.a
        uk = ModuleRow("self_attn.kv_b_proj.k_absorb", phase, "gemm", "self_attn.kv_b_proj.k_absorb", None, kind,
                       2.0 * t * hq * nope * r, w_uk, t * hq * nope * a, t * hq * r * a, input_shape=(t, hq, nope),
                       output_shape=(t, hq, r), compute_dtype=dt.gemm_compute,
                       note="weight-absorbed MLA: q_nope x W_UK (kv_b_proj K part)")
        core = ModuleRow("self_attn.attn", phase, "attention", "self_attn.attn", None, kind,
                         2.0 * batch * hq * keys * (r + rdim) + 2.0 * batch * hq * keys * r, 0.0,
                         t * hq * (r + rdim) * a, t * hq * r * a, kv_read, kv_write,
                         input_shape=(batch, hq, 1, r + rdim), output_shape=(batch, hq, 1, r), compute_dtype=dt.act,
                         note=f"weight-absorbed MLA over the latent cache, {keys} cached keys")
        uv = ModuleRow("self_attn.kv_b_proj.v_absorb", phase, "gemm", "self_attn.kv_b_proj.v_absorb", None, kind,
                       2.0 * t * hq * r * dv, w_uv, t * hq * r * a, t * hq * dv * a, input_shape=(t, hq, r),
                       output_shape=(t, hq, dv), compute_dtype=dt.gemm_compute,
                       note="weight-absorbed MLA: attention output x W_UV (kv_b_proj V part)")
        rows += [rope_row, uk, core, uv]
    rows.append(linear("self_attn.o_proj", phase, kind, t, hq * dv, h, dt, at.o_bias))
    return rows
