"""Built-in tiny models: configs of real architectures at toy size, so every stage runs with no download.

``tiny-k2`` has the Kimi-K2 / DeepSeek-V3 architecture: MLA with q_lora, a dense first layer, routed
plus shared experts, sigmoid scoring with group-limited top-k and a correction bias, yarn rope.
The runtime's ``adapt init-model`` writes random weights and a tokenizer for them.
"""

from __future__ import annotations

import copy

_COMMON = dict(vocab_size=512, bos_token_id=0, eos_token_id=1, pad_token_id=2, rms_norm_eps=1e-6, tie_word_embeddings=False,
               torch_dtype="float32", hidden_act="silu")

BUILTIN_CONFIGS: dict[str, dict] = {
    "tiny-k2": dict(
        _COMMON, architectures=["DeepseekV3ForCausalLM"], model_type="deepseek_v3", hidden_size=128,
        intermediate_size=256, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4,
        q_lora_rank=64, kv_lora_rank=32, qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32,
        n_routed_experts=16, num_experts_per_tok=4, n_shared_experts=1, moe_intermediate_size=64,
        first_k_dense_replace=1, moe_layer_freq=1, n_group=4, topk_group=2, topk_method="noaux_tc",
        scoring_func="sigmoid", norm_topk_prob=True, routed_scaling_factor=2.5, num_nextn_predict_layers=0,
        max_position_embeddings=32768, rope_theta=10000.0,
        rope_scaling=dict(type="yarn", factor=8.0, original_max_position_embeddings=4096, beta_fast=32,
                          beta_slow=1, mscale=1.0, mscale_all_dim=1.0)),
    "tiny-llama": dict(
        _COMMON, architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=128, intermediate_size=256,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32768,
        rope_theta=500000.0,
        rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                          original_max_position_embeddings=4096)),
    "tiny-qwen3-moe": dict(
        _COMMON, architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", hidden_size=128,
        intermediate_size=256, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
        num_experts=8, num_experts_per_tok=2, moe_intermediate_size=64, norm_topk_prob=True,
        decoder_sparse_step=1, mlp_only_layers=[], max_position_embeddings=32768, rope_theta=1000000.0),
}


def builtin_config(name: str) -> dict | None:
    """A copy of the config of a built-in model, or None."""
    cfg = BUILTIN_CONFIGS.get(name)
    return copy.deepcopy(cfg) if cfg is not None else None
