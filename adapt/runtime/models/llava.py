"""llava-1.5: a llama-family language model fed CLIP features through the projector (vision/clip.py).

The vision side lives on the first pipeline stage (where the embedding is) and is replicated over tp.
"""

from __future__ import annotations

import torch

from adapt.runtime.models.llama import LlamaForCausalLM
from adapt.runtime.vision.clip import ClipVisionTower, LlavaProjector


class LlavaForConditionalGeneration(LlamaForCausalLM):
    def __init__(self, spec, layout, ctx, kernels):
        super().__init__(spec, layout, ctx, kernels)
        self.vision_tower = self.projector = None
        if ctx.is_first_stage:
            self.vision_tower = ClipVisionTower(spec.vision)
            self.projector = LlavaProjector(spec.vision, spec.hidden_size)

    def encode_images(self, images: list, kernels, capture: dict | None = None) -> torch.Tensor:
        """Preprocessed images (vision/processor.ImageInput) -> features [sum of their tokens, H]."""
        pixels = torch.stack([im.pixel_values for im in images]).to(self.vision_tower.patch.weight.device)
        feats = self.vision_tower(pixels, kernels, capture)  # [N, P, Hv]
        if capture is not None:
            capture["vision.features"] = feats.detach().clone()
        out = self.projector(feats).reshape(-1, self.spec.hidden_size)
        if capture is not None:
            capture["projector"] = out.detach().clone()
        return out
