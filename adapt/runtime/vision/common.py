"""Weights the vision towers hold besides linears: LayerNorm (weight + bias) and plain tensors
(class embedding, patch convolution, position table); and the activations the towers name."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from adapt.errors import UnsupportedModelError
from adapt.runtime.models.layers import Loader, _param, slot_loader
from adapt.runtime.module import Module


class Weight(Module):
    """One named checkpoint tensor held as ``self.weight``."""

    def __init__(self, name: str, *shape: int):
        super().__init__()
        self.name = name
        self.weight = _param(*shape)

    def hf_weights(self) -> dict[str, Loader]:
        return {self.name: slot_loader(self, "weight", self.name)}


class LayerNorm(Module):
    def __init__(self, prefix: str, size: int, eps: float):
        super().__init__()
        self.prefix, self.eps = prefix, eps
        self.weight = _param(size)
        self.bias = _param(size)

    def hf_weights(self) -> dict[str, Loader]:
        return {f"{self.prefix}.weight": slot_loader(self, "weight", f"{self.prefix}.weight"),
                f"{self.prefix}.bias": slot_loader(self, "bias", f"{self.prefix}.bias")}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, (x.shape[-1],), self.weight, self.bias, self.eps)


def _quick_gelu(x: torch.Tensor) -> torch.Tensor:
    return x * torch.sigmoid(1.702 * x)


ACTIVATIONS = {
    "quick_gelu": _quick_gelu,
    "gelu": F.gelu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
    "silu": F.silu,
}


def activation(name: str):
    fn = ACTIVATIONS.get(name)
    if fn is None:
        raise UnsupportedModelError(f"vision activation {name!r} is not supported ({', '.join(ACTIVATIONS)})")
    return fn


def tower_attention(kernels, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu: torch.Tensor,
                    scale: float) -> torch.Tensor:
    """Bidirectional attention within each packed segment (an image, or a Qwen2.5-VL window): q, k, v
    [T, h, d], cu [S + 1] the segment offsets -> [T, h, d]. Segments of equal length are batched into one
    call of torch's fused scaled_dot_product_attention ([n, h, L, d], no mask: every row sees its whole
    segment), so CLIP's one segment per image and the windows of a Qwen2.5-VL image (a few distinct lengths)
    cost a handful of calls instead of the tiled loop over every segment that the causal prefill kernel runs.
    The fused kernel never holds the [L, L] scores (a 4096-patch full-attention block included) and keeps the
    softmax in float32 for 16-bit inputs: 2.6-3.6x the unfused matmul-softmax-matmul it replaced on CPU, and
    closer to float32 in bfloat16. The reference kernel set keeps its twin (kernels.varlen_attention, the
    test oracle)."""
    if kernels.impl == "reference":
        return kernels.varlen_attention(q, k, v, cu, scale, False)
    bounds = cu.tolist()
    by_len: dict[int, list[int]] = {}
    for i in range(len(bounds) - 1):
        if bounds[i + 1] > bounds[i]:
            by_len.setdefault(bounds[i + 1] - bounds[i], []).append(bounds[i])
    out = torch.empty_like(q)
    h, d = q.shape[1], q.shape[2]
    for length, starts in by_len.items():
        if len(starts) == 1:
            idx = None
            sl = slice(starts[0], starts[0] + length)
            qs, ks, vs = (x[sl].unsqueeze(0) for x in (q, k, v))
        else:
            idx = (torch.tensor(starts, device=q.device)[:, None]
                   + torch.arange(length, device=q.device)[None, :]).reshape(-1)
            qs, ks, vs = (x.index_select(0, idx).view(len(starts), length, h, d) for x in (q, k, v))
        o = F.scaled_dot_product_attention(*(x.transpose(1, 2) for x in (qs, ks, vs)), scale=scale)  # [n, h, L, d]
        o = o.transpose(1, 2)  # [n, L, h, d]
        if idx is None:
            out[sl] = o[0]
        else:
            out.index_copy_(0, idx, o.reshape(-1, h, d))
    return out
