"""A quantized checkpoint's weights dequantized at load, for a transformers reference that cannot read the
quantized format (compressed-tensors not installed, FP8 needing accelerate or a GPU, or its loader failing).

The dequantization is the runtime's own (``runtime/quant/load.py``'s loaders: fp8 blocks, int8 channels, int4
groups with or without zero points, one rounding in float32); the other tensors are taken as stored.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn as nn
from safetensors import safe_open

from adapt.layout import WeightLayout
from adapt.runtime.quant.load import QuantLoaders, quantized_weights
from adapt.spec import ModelSpec


def dequantized_state_dict(path: str | Path) -> dict[str, torch.Tensor]:
    """{HF weight name: float32 tensor} of every quantized weight (int4's ``weight_packed`` named ``weight``),
    beside every other stored tensor (compressed-tensors' ``weight_shape`` dropped)."""
    p = Path(path)
    spec = ModelSpec.from_hf_config(json.loads((p / "config.json").read_text(encoding="utf-8")))
    layout = WeightLayout.from_spec(spec)
    mains = quantized_weights(layout)
    out: dict[str, torch.Tensor] = {}

    def keep(name: str):
        hf = name[: -len("_packed")] if name.endswith("weight_packed") else name
        return lambda t: out.__setitem__(hf, t)

    loaders = QuantLoaders(nn.Module(), spec, layout, {m: keep(m) for m in mains}).loaders
    for f in sorted(p.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as sf:
            for name in sf.keys():
                t = sf.get_tensor(name)
                if name in mains:
                    loaders[name](t)
                elif name in loaders:
                    loaders[name](t, None)
                else:
                    out[name] = t
    return out
