"""Llama-style models: llama, mistral, qwen2, qwen3 (q/k norm), and the MoE variants mixtral,
qwen2_moe, qwen3_moe. GQA attention, neox rope (rotate_half) over the first ``rotary_dim`` dims."""

from __future__ import annotations

from adapt.runtime.models.attention import GQAAttention, Rotary
from adapt.runtime.models.decoder import CausalLM


class LlamaForCausalLM(CausalLM):
    def make_attention(self, spec, n, i, ctx):
        return GQAAttention(spec, n, i, ctx)

    def setup_rope(self, spec, kernels):
        rotary = Rotary(spec, spec.rope.rotary_dim or spec.attention.head_dim, "rotate_half", kernels)
        for layer in self.layers:
            layer.attn.rotary = rotary
