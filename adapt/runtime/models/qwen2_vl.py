"""Qwen2.5-VL: the Qwen2 language model with M-RoPE (vision/mrope.py), fed by its vision tower
(vision/qwen_vit.py). Without an image in the step, the three position streams are equal and the rope
is the plain one; a prefill with images carries ``ForwardBatch.mrope_positions``."""

from __future__ import annotations

from dataclasses import replace

import torch

from adapt.runtime.models.attention import Rotary
from adapt.runtime.models.llama import LlamaForCausalLM
from adapt.runtime.vision.mrope import mrope_cos_sin
from adapt.runtime.vision.qwen_vit import QwenVisionTower


class MRotary(Rotary):
    def __init__(self, spec, rotary_dim, layout, kernels):
        base = spec if spec.rope.type != "mrope" else replace(spec, rope=replace(spec.rope, type="default"))
        super().__init__(base, rotary_dim, layout, kernels)  # mrope's frequencies are the default rope's
        self.section = tuple(dict(spec.rope.params).get("mrope_section", ()))

    def cos_sin(self, batch, dtype):
        if batch.mrope_positions is None or not self.section:
            return super().cos_sin(batch, dtype)
        key = (id(self), dtype)
        if key not in batch.rope:
            batch.rope[key] = mrope_cos_sin(self, batch.mrope_positions, batch.kernels, self.section, dtype)
        return batch.rope[key]


class Qwen2_5_VLForConditionalGeneration(LlamaForCausalLM):
    def __init__(self, spec, layout, ctx, kernels):
        super().__init__(spec, layout, ctx, kernels)
        self.visual = QwenVisionTower(spec.vision) if ctx.is_first_stage else None

    def setup_rope(self, spec, kernels):
        rotary = MRotary(spec, spec.rope.rotary_dim or spec.attention.head_dim, "rotate_half", kernels)
        for layer in self.layers:
            layer.attn.rotary = rotary

    def encode_images(self, images: list, kernels, capture: dict | None = None) -> torch.Tensor:
        dev = self.visual.patch.weight.device
        patches = torch.cat([im.pixel_values for im in images]).to(dev)
        return self.visual(patches, [im.grid_thw for im in images], kernels, capture)
