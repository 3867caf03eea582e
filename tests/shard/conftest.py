from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from adapt.layout import WeightLayout
from adapt.spec import ModelSpec
from tests.fixtures.tiny import TINY, save_tiny


@pytest.fixture(scope="session")
def tiny_ckpts(tmp_path_factory) -> dict[str, Path]:
    """Every text family saved with save_pretrained, sharded into several files."""
    root = tmp_path_factory.mktemp("ckpts")
    out = {}
    for name in TINY:
        _, d = save_tiny(name, root / name, max_shard_size="20KB")
        assert len(list(d.glob("*.safetensors"))) > 1
        out[name] = d
    return out


@pytest.fixture()
def llama_ckpt(tiny_ckpts, tmp_path) -> Path:
    """A private copy of the tiny llama checkpoint that a test may damage."""
    import shutil

    return Path(shutil.copytree(tiny_ckpts["llama"], tmp_path / "llama"))


FP8_CONFIG = dict(TINY["deepseek_v3"], hidden_size=200, intermediate_size=264, q_lora_rank=72, kv_lora_rank=40,
                  moe_intermediate_size=136, n_routed_experts=4, n_group=2, topk_group=1, num_attention_heads=4,
                  num_key_value_heads=4, torch_dtype="bfloat16", num_nextn_predict_layers=1,
                  quantization_config=dict(quant_method="fp8", fmt="e4m3", activation_scheme="dynamic",
                                           weight_block_size=[128, 128]))


def write_fp8_checkpoint(d: Path, cfg: dict = FP8_CONFIG, with_mtp: bool = True, seed: int = 0) -> Path:
    """A DeepSeek-V3-layout FP8 checkpoint: float8_e4m3fn weights + float32 weight_scale_inv per block."""
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text(json.dumps(cfg))
    (d / "tokenizer_config.json").write_text("{}")
    layout = WeightLayout.from_spec(ModelSpec.from_hf_config(cfg))
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for t in layout:
        if t.mtp and not with_mtp:
            continue
        if t.dtype == "float8_e4m3fn":
            tensors[t.name] = (torch.randn(t.shape, generator=g) * 100).clamp(-448, 448).to(torch.float8_e4m3fn)
        elif t.scale_of:
            tensors[t.name] = torch.rand(t.shape, generator=g) * 1e-2 + 1e-4
        else:
            tensors[t.name] = torch.randn(t.shape, generator=g).to(torch.bfloat16)
    names = sorted(tensors)
    half = len(names) // 2
    parts = {"model-00001-of-00002.safetensors": names[:half], "model-00002-of-00002.safetensors": names[half:]}
    weight_map = {}
    for f, ns in parts.items():
        save_file({n: tensors[n] for n in ns}, str(d / f), metadata={"format": "pt"})
        weight_map.update({n: f for n in ns})
    (d / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return d
