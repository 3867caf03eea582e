"""Weights the vision towers hold besides linears: LayerNorm (weight + bias) and plain tensors
(class embedding, patch convolution, position table); and the activations the towers name."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from adapt.errors import UnsupportedModelError
from adapt.runtime.models.layers import Loader, _param, slot_loader


class Weight(nn.Module):
    """One named checkpoint tensor held as ``self.weight``."""

    def __init__(self, name: str, *shape: int):
        super().__init__()
        self.name = name
        self.weight = _param(*shape)

    def hf_weights(self) -> dict[str, Loader]:
        return {self.name: slot_loader(self, "weight", self.name)}


class LayerNorm(nn.Module):
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
