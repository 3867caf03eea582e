"""DeepSeek-V2, DeepSeek-V3 and Kimi-K2: multi-head latent attention, dense first layers then MoE with
shared experts. Rope covers the qk_rope_head_dim slice; transformers applies DeepSeek-V2's in complex
form (pairs kept interleaved) and V3's de-interleaved when ``rope_interleave`` (the default)."""

from __future__ import annotations

from adapt.runtime.models.attention import MLAAttention, Rotary, rope_scaling
from adapt.runtime.models.decoder import CausalLM


class DeepseekForCausalLM(CausalLM):
    def make_attention(self, spec, n, i, ctx):
        return MLAAttention(spec, n, i, ctx)

    def setup_rope(self, spec, kernels):
        a = spec.attention
        if spec.model_type == "deepseek_v2":
            layout = "interleave_pairs"
        else:
            layout = "interleave" if spec.rope.interleave else "rotate_half"
        rotary = Rotary(spec, a.qk_rope_head_dim, layout, kernels)
        scale = kernels.mla_softmax_scale(a.head_dim, rope_scaling(spec.rope, spec.max_position_embeddings))
        for layer in self.layers:
            layer.attn.rotary = rotary
            layer.attn.scale = scale
