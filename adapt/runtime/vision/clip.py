"""llava-1.5's vision side: the CLIP ViT and the two-layer projector.

# Legend: N images, C channels, S image side (pixels), P patches per image, Hv tower width, H text width.

CLIP (transformers' CLIPVisionTransformer): patch convolution (no bias), the class embedding prepended,
learned positions added, ``pre_layrnorm``, then pre-LN encoder layers (attention with biased q/k/v/out,
quick_gelu MLP). llava reads the hidden states after layer ``vision_feature_layer`` (-2: the second to
last layer; hidden_states[0] is the pre-layernorm output), so only the layers up to it are built, and
``post_layernorm`` is never used. Strategy 'default' drops the class token, 'full' keeps it. The
projector is linear_1 -> gelu -> linear_2.

Captured (``capture`` dict): ``vision.embed``, ``vision.layers.{i}``, ``vision.features`` (the selected
layer, after the strategy), ``projector`` ([tokens, H], what is scattered into the prompt).
"""

from __future__ import annotations

import torch
import torch.nn as nn

from adapt.errors import ConfigError
from adapt.runtime.models.layers import ColumnParallelLinear, Linear
from adapt.runtime.vision.common import LayerNorm, Weight, activation, tower_attention
from adapt.spec import VisionSpec
from adapt.runtime.module import Module


class ClipLayer(Module):
    def __init__(self, v: VisionSpec, p: str):
        super().__init__()
        hv = v.hidden_size
        self.num_heads, self.head_dim = v.num_heads, hv // v.num_heads
        self.ln1 = LayerNorm(f"{p}.layer_norm1", hv, v.norm_eps)
        self.ln2 = LayerNorm(f"{p}.layer_norm2", hv, v.norm_eps)
        a = f"{p}.self_attn"
        # q | k | v as one GEMM over the normed input (one pass over it, one wider N), replicated (ctx unused)
        self.qkv = ColumnParallelLinear([(f"{a}.{n}.weight", f"{a}.{n}.bias", hv)
                                         for n in ("q_proj", "k_proj", "v_proj")], hv, None)
        self.o = Linear(f"{a}.out_proj.weight", hv, hv, f"{a}.out_proj.bias")
        self.fc1 = Linear(f"{p}.mlp.fc1.weight", hv, v.intermediate_size, f"{p}.mlp.fc1.bias")
        self.fc2 = Linear(f"{p}.mlp.fc2.weight", v.intermediate_size, hv, f"{p}.mlp.fc2.bias")
        self.act = activation(v.hidden_act)

    def forward(self, x: torch.Tensor, cu: torch.Tensor, kernels) -> torch.Tensor:
        """x [N * P, Hv], images packed; cu [N + 1] their offsets."""
        t, h, d = x.shape[0], self.num_heads, self.head_dim
        y = self.ln1(x)
        q, k, v = self.qkv(y).view(t, 3, h, d).unbind(1)  # [T, h, d] each
        o = tower_attention(kernels, q, k, v, cu, d ** -0.5)
        x = x + self.o(o.reshape(t, h * d))
        return x + self.fc2(self.act(self.fc1(self.ln2(x))))


class ClipVisionTower(Module):
    def __init__(self, v: VisionSpec, prefix: str = "vision_tower."):
        super().__init__()
        self.spec = v
        hv, p = v.hidden_size, v.patch_size
        self.num_patches = (v.image_size // p) ** 2
        e = f"{prefix}embeddings"
        self.patch = Weight(f"{e}.patch_embedding.weight", hv, v.in_channels, p, p)
        self.cls = Weight(f"{e}.class_embedding", hv)
        self.pos = Weight(f"{e}.position_embedding.weight", self.num_patches + 1, hv)
        self.pre_ln = LayerNorm(f"{prefix}pre_layrnorm", hv, v.norm_eps)
        n = v.num_layers + 1  # hidden_states entries: the pre-LN output, then each layer's
        if not -n <= v.feature_layer < n:
            raise ConfigError(f"vision_feature_layer {v.feature_layer} is outside the tower's {n} hidden states")
        self.depth = v.feature_layer % n
        self.layers = nn.ModuleList(ClipLayer(v, f"{prefix}encoder.layers.{i}") for i in range(self.depth))

    def forward(self, pixels: torch.Tensor, kernels, capture: dict | None = None) -> torch.Tensor:
        """pixels [N, C, S, S] -> selected features [N, P (+1 with 'full'), Hv]."""
        n, hv = pixels.shape[0], self.spec.hidden_size
        w = self.patch.weight
        x = torch.nn.functional.conv2d(pixels.to(w.dtype), w, stride=self.spec.patch_size)  # [N, Hv, S/p, S/p]
        x = x.flatten(2).transpose(1, 2)  # [N, P, Hv]
        if x.shape[1] != self.num_patches:
            raise ConfigError(f"image of {tuple(pixels.shape[-2:])} pixels gives {x.shape[1]} patches; the tower "
                              f"takes {self.num_patches} ({self.spec.image_size}x{self.spec.image_size})")
        x = torch.cat((self.cls.weight.expand(n, 1, hv), x), dim=1) + self.pos.weight  # [N, P + 1, Hv]
        x = self.pre_ln(x)
        _record(capture, "vision.embed", x)
        length = x.shape[1]
        cu = torch.arange(0, (n + 1) * length, length, dtype=torch.int32, device=x.device)
        x = x.reshape(n * length, hv)
        for i, layer in enumerate(self.layers):
            x = layer(x, cu, kernels)
            _record(capture, f"vision.layers.{i}", x.view(n, length, hv))
        x = x.view(n, length, hv)
        return x[:, 1:] if self.spec.select_strategy == "default" else x


class LlavaProjector(Module):
    def __init__(self, v: VisionSpec, text_hidden: int, prefix: str = "multi_modal_projector."):
        super().__init__()
        b = v.projector_bias
        self.linear_1 = Linear(f"{prefix}linear_1.weight", v.hidden_size, text_hidden,
                               f"{prefix}linear_1.bias" if b else None)
        self.linear_2 = Linear(f"{prefix}linear_2.weight", text_hidden, text_hidden,
                               f"{prefix}linear_2.bias" if b else None)
        self.act = activation(v.projector_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_2(self.act(self.linear_1(x)))


def image_tokens(v: VisionSpec) -> int:
    """Placeholder tokens one image takes in the prompt (the processor's expansion)."""
    n = (v.image_size // v.patch_size) ** 2
    return n + 1 if v.select_strategy == "full" else n


def _record(capture: dict | None, name: str, x: torch.Tensor) -> None:
    if capture is not None:
        capture[name] = x.detach().clone()
