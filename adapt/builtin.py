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
    # llava-1.5 at toy size: a 3-layer CLIP tower read at layer -2, 56-pixel crops (16 image tokens); <image> = 511
    "tiny-llava": dict(
        architectures=["LlavaForConditionalGeneration"], model_type="llava", image_token_index=511,
        vision_feature_layer=-2, vision_feature_select_strategy="default", projector_hidden_act="gelu",
        image_seq_length=16, tie_word_embeddings=False, torch_dtype="float32",
        text_config=dict(_COMMON, model_type="llama", hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
                         rope_theta=10000.0),
        vision_config=dict(model_type="clip_vision_model", hidden_size=64, intermediate_size=128,
                           num_hidden_layers=3, num_attention_heads=2, image_size=56, patch_size=14,
                           projection_dim=64, hidden_act="quick_gelu", layer_norm_eps=1e-5)),
    # Qwen2.5-VL at toy size: window attention (56-pixel windows) with full attention in block 1, M-RoPE;
    # <|vision_start|> 509, <|image_pad|> 510, <|vision_end|> 511
    "tiny-qwen2.5-vl": dict(
        architectures=["Qwen2_5_VLForConditionalGeneration"], model_type="qwen2_5_vl", image_token_id=510,
        vision_start_token_id=509, vision_end_token_id=511, video_token_id=508, tie_word_embeddings=False,
        torch_dtype="float32",
        text_config=dict(_COMMON, model_type="qwen2_5_vl_text", hidden_size=128, intermediate_size=256,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=4096, rope_theta=1000000.0,
                         rope_scaling={"type": "mrope", "mrope_section": [4, 6, 6]}),
        vision_config=dict(model_type="qwen2_5_vl_vision", depth=3, hidden_size=64, intermediate_size=128,
                           num_heads=2, out_hidden_size=128, patch_size=14, spatial_merge_size=2,
                           temporal_patch_size=2, window_size=56, fullatt_block_indexes=[1], in_channels=3,
                           hidden_act="silu", tokens_per_second=2)),
}

# the image processors of the multimodal built-ins (transformers' preprocessor_config.json fields)
BUILTIN_PROCESSORS: dict[str, dict] = {
    "tiny-llava": dict(image_processor_type="CLIPImageProcessor", do_resize=True, size={"shortest_edge": 56},
                       resample=3, do_center_crop=True, crop_size={"height": 56, "width": 56}, do_rescale=True,
                       rescale_factor=1 / 255, do_normalize=True, image_mean=[0.48145466, 0.4578275, 0.40821073],
                       image_std=[0.26862954, 0.26130258, 0.27577711], do_convert_rgb=True),
    "tiny-qwen2.5-vl": dict(image_processor_type="Qwen2VLImageProcessor", do_resize=True, resample=3,
                            do_rescale=True, rescale_factor=1 / 255, do_normalize=True,
                            image_mean=[0.48145466, 0.4578275, 0.40821073],
                            image_std=[0.26862954, 0.26130258, 0.27577711], do_convert_rgb=True,
                            min_pixels=28 * 28 * 4, max_pixels=28 * 28 * 64, patch_size=14, temporal_patch_size=2,
                            merge_size=2),
}
# the placeholder special tokens each takes at the top of the vocabulary, in id order
BUILTIN_IMAGE_TOKENS: dict[str, tuple[str, ...]] = {
    "tiny-llava": ("<image>",),
    "tiny-qwen2.5-vl": ("<|video_pad|>", "<|vision_start|>", "<|image_pad|>", "<|vision_end|>"),
}


def builtin_config(name: str) -> dict | None:
    """A copy of the config of a built-in model, or None."""
    cfg = BUILTIN_CONFIGS.get(name)
    return copy.deepcopy(cfg) if cfg is not None else None
