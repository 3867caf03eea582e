"""Memory model: KV cache bytes per token (MLA-aware) and peak activation bytes of a prefill.

KV cache, per token and layer:
  GQA / MHA: K and V of every KV head: num_kv_heads * (head_dim + v_head_dim) elements.
  MLA: the compressed latent c_KV (kv_lora_rank) plus the shared rope key (qk_rope_head_dim), one
       vector for all heads (DeepSeek-V2 paper, sec. 2.1.2: (d_c + d_h^R) * l elements per token).
  int8 adds one float32 scale per token and KV head for K and for V (MLA: one per token), as
  ``adapt.runtime.cache.kv_pool`` stores them; fp8 uses a per-tensor scale (no per-token bytes).
Sliding-window attention keeps at most ``sliding_window`` tokens per sequence.
"""

from __future__ import annotations

from adapt.spec import ModelSpec, dtype_bytes, normalize_dtype

# Context lengths of memory.kv_bytes_by_context (binary: 1K = 1024 tokens, 1M = 1,048,576 tokens).
KV_CONTEXTS = {"1K": 1 << 10, "8K": 8 << 10, "32K": 32 << 10, "128K": 128 << 10, "1M": 1 << 20}


def kv_bytes_per_token_per_layer(spec: ModelSpec, kv_dtype: str = "bfloat16") -> float:
    """KV cache bytes one token takes in one decoder layer."""
    kv = normalize_dtype(kv_dtype)
    e = dtype_bytes(kv)
    a = spec.attention
    if a.kind == "mla":
        return (a.kv_lora_rank + a.qk_rope_head_dim) * e + (4 if kv == "int8" else 0)
    return a.num_kv_heads * (a.head_dim + a.v_head_dim) * e + (2 * a.num_kv_heads * 4 if kv == "int8" else 0)


def kv_bytes_per_token(spec: ModelSpec, kv_dtype: str = "bfloat16") -> int:
    """KV cache bytes one token takes across all decoder layers (MTP layers excluded).

    DeepSeek-V3 at bf16: 61 x (512 + 64) x 2 = 70,272; Llama-3.1-405B: 126 x 2 x 8 x 128 x 2 = 516,096.
    """
    return int(spec.num_layers * kv_bytes_per_token_per_layer(spec, kv_dtype))


def kv_cached_tokens(spec: ModelSpec, context: int) -> int:
    """Tokens the cache holds per sequence and layer at ``context``: a sliding window caps its layers (a
    cache that drops what left the window); with some layers windowed (Qwen's max_window_layers) the
    mean over layers, so that x layers x bytes per token per layer is the whole cache."""
    a = spec.attention
    if not a.sliding_window:
        return context
    n = spec.num_layers
    windowed = n if a.window_layers is None else len(a.window_layers)
    return round((windowed * min(context, a.sliding_window) + (n - windowed) * context) / n)


def kv_bytes(spec: ModelSpec, context: int, batch: int = 1, kv_dtype: str = "bfloat16") -> int:
    """KV cache bytes of ``batch`` sequences at ``context`` tokens each."""
    return int(batch * kv_cached_tokens(spec, context) * kv_bytes_per_token(spec, kv_dtype))


def kv_bytes_by_context(spec: ModelSpec, kv_dtype: str = "bfloat16", batch: int = 1) -> dict[str, int]:
    """KV cache bytes at 1K, 8K, 32K, 128K and 1M tokens (binary K/M), for ``batch`` sequences."""
    return {k: kv_bytes(spec, n, batch, kv_dtype) for k, n in KV_CONTEXTS.items()}


def activation_peak_bytes(spec: ModelSpec, batch: int, context: int, act_dtype: str = "bfloat16") -> int:
    """Peak live activation bytes of an inference prefill of ``batch`` x ``context`` tokens.

    Model (no autograd, one layer alive at a time, weights and KV cache not included):
      peak = residual stream + normed input (2 * T * hidden)
             + the largest sublayer's transient buffers:
               attention: q, k, v and the output (flash attention: the L x L scores are never stored;
                          MLA prefill also holds the q_a / kv_a latents and the decompressed kv_b output)
               dense MLP: gate, up and act(gate) * up outputs (3 * T * intermediate)
               MoE:       routed copies of the tokens in and out (2 * T * k * hidden), their gate, up and
                          product (3 * T * k * moe_intermediate), fp32 router logits (T * E * 4), plus
                          the shared expert's 3 * T * shared_intermediate
             + fp32 logits of the last position of each sequence (batch * vocab * 4).
    T = batch * context. Chunked prefill would divide the T-proportional terms by the number of chunks.
    """
    a = dtype_bytes(normalize_dtype(act_dtype))
    t = batch * context
    h = spec.hidden_size
    at = spec.attention
    if at.kind == "mla":
        hq = at.num_heads
        attn = t * (hq * at.head_dim  # q
                    + (at.q_lora_rank or 0) + at.kv_lora_rank + at.qk_rope_head_dim  # latents
                    + hq * (at.qk_nope_head_dim + at.v_head_dim)  # kv_b output
                    + hq * at.head_dim  # assembled k
                    + hq * at.v_head_dim)  # attention output
    else:
        attn = t * (at.num_heads * at.head_dim + at.num_kv_heads * (at.head_dim + at.v_head_dim)
                    + at.num_heads * at.v_head_dim)
    mlp = 0
    if "dense" in spec.layer_kinds:
        mlp = 3 * t * spec.intermediate_size
    if spec.moe is not None and "moe" in spec.layer_kinds:
        m = spec.moe
        moe = 2 * t * m.top_k * h + 3 * t * m.top_k * m.intermediate_size + 3 * t * m.shared_intermediate_size
        moe = moe * a + t * m.num_experts * 4
        mlp = max(mlp * a, moe) / a
    transient = max(attn, mlp)
    return int(2 * t * h * a + transient * a + batch * spec.vocab_size * 4)
