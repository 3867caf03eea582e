"""Model-level figures the planner takes from ``adapt.profile``: KV bytes per token, FLOPs of attention.

The planner depends on the profile through this one file. Everything per rank (which part of the weights a
rank holds) comes from the layout in ``weights.py``; what this file gives is per token and per layer.
"""

from __future__ import annotations

import adapt.profile as profile
from adapt.profile.memory import kv_cached_tokens
from adapt.spec import ModelSpec, dtype_bytes


def kv_bytes_per_token_layer(spec: ModelSpec, kv_dtype: str) -> float:
    """KV cache bytes one token adds in one decoder layer, for the whole model before any split (the
    profile's MLA-aware figure: GQA kv_heads x (head_dim + v_head_dim); MLA kv_lora_rank + qk_rope_head_dim,
    the same for every head, so tp does not split it; int8 adds its scales)."""
    return profile.kv_bytes_per_token_per_layer(spec, kv_dtype)


def kv_tokens(spec: ModelSpec, context: int) -> int:
    """Tokens cached per sequence at ``context`` (a sliding window caps it)."""
    return kv_cached_tokens(spec, context)


def kv_split(spec: ModelSpec, tp: int) -> int:
    """How many ways tp splits one layer's KV cache: GQA by KV heads (replicated beyond them), MLA not at all."""
    a = spec.attention
    if a.kind == "mla":
        return 1
    return min(tp, a.num_kv_heads)


def attention_flops(spec: ModelSpec, tokens: int, context: int, tp: int, prefill: bool) -> float:
    """Attention-core FLOPs (scores and weighted values) of one layer on one tp rank.

    Decode (one new token against ``context`` cached): 2 x heads/tp x (d_qk + d_v) x context per token.
    MLA decode runs absorbed (q and output in the latent space): d_qk = kv_lora + rope, d_v = kv_lora.
    Prefill of ``tokens`` causal tokens: the same with context ~ tokens/2 on average.
    """
    a = spec.attention
    heads = a.num_heads / tp
    if a.kind == "mla" and not prefill:
        d = (a.kv_lora_rank + a.qk_rope_head_dim) + a.kv_lora_rank
    else:
        d = a.head_dim + a.v_head_dim
    ctx = tokens / 2 if prefill else context
    return 2.0 * heads * d * ctx * tokens


def activation_peak_bytes(spec: ModelSpec, tokens: int, tp: int, act_dtype: str) -> float:
    """Peak transient activations of one prefill forward of ``tokens`` tokens on one tp rank: the profile's
    peak (``adapt.profile.activation_peak_bytes``, flash attention, one layer alive) with the residual stream
    and normed input (2 x tokens x hidden) replicated and the sublayer transients split over tp."""
    full = profile.activation_peak_bytes(spec, 1, tokens, act_dtype)
    resid = 2 * tokens * spec.hidden_size * dtype_bytes(act_dtype)
    return resid + (full - resid) / tp
