"""Model-level figures the planner takes from ``adapt.profile``: KV bytes per token, FLOPs of attention.

The planner depends on the profile through this one file. Everything per rank (which part of the weights a
rank holds) comes from the layout in ``weights.py``; what this file gives is per token and per layer.
"""

from __future__ import annotations

from adapt.spec import ModelSpec, dtype_bytes


def kv_bytes_per_token_layer(spec: ModelSpec, kv_dtype: str) -> float:
    """KV cache bytes one token adds in one decoder layer, for the whole model (before any split).

    GQA: keys and values of every KV head, (head_dim + v_head_dim) x kv_heads. MLA: the compressed latent
    plus the rope key, kv_lora_rank + qk_rope_head_dim (the same for every head, so tp does not split it).
    """
    a, b = spec.attention, dtype_bytes(kv_dtype)
    if a.kind == "mla":
        return (a.kv_lora_rank + a.qk_rope_head_dim) * b
    return a.num_kv_heads * (a.head_dim + a.v_head_dim) * b


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
    """Peak transient activations of one forward of ``tokens`` tokens on one tp rank (flash attention: no
    score matrix). The residual and normed hidden (2h) stay live while the larger of the attention block
    (q, k/v or the MLA up-projected k/v, output, each split by tp) or the MLP (gate, up, product: 3 x the
    widest intermediate over tp; routed experts see top-k x tokens over the tp x dp ranks, which is
    top_k x moe_inter / tp per rank in expectation) is in flight."""
    a, h = spec.attention, spec.hidden_size
    if a.kind == "mla":
        attn = a.num_heads * (a.head_dim + a.qk_nope_head_dim + 2 * a.v_head_dim) / tp + a.kv_lora_rank
    else:
        attn = (a.num_heads * (a.head_dim + a.v_head_dim) + a.num_kv_heads * (a.head_dim + a.v_head_dim)) / tp
    mlp = 3 * spec.intermediate_size / tp if "dense" in spec.layer_kinds else 0.0
    if spec.moe:
        m = spec.moe
        mlp = max(mlp, 3 * m.top_k * m.intermediate_size / tp + 3 * m.shared_intermediate_size / tp)
    return tokens * (2 * h + max(attn, mlp)) * dtype_bytes(act_dtype)
