"""Bad quantized checkpoints: one line naming the tensor and the rule, non-zero exit."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from adapt.errors import ConfigError
from adapt.spec import ModelSpec
from tests.fixtures.quant import save_quantized
from tests.fixtures.tiny import tiny_config


@pytest.fixture
def _cli(tmp_path, capsys, monkeypatch):
    from tests.flows.test_run_cli import _run_here

    return lambda args, _capsys: _run_here(args, tmp_path / "cache", capsys, monkeypatch)


@pytest.fixture(scope="module")
def fp8_dir(tmp_path_factory):
    return save_quantized("deepseek_v3", tmp_path_factory.mktemp("q"), "fp8", block=(32, 32))[0]


def _edit(src, dst, change):
    dst.mkdir()
    (dst / "config.json").write_text((src / "config.json").read_text())
    ts = load_file(str(src / "model.safetensors"))
    change(ts)
    save_file(ts, str(dst / "model.safetensors"))
    return dst


def test_missing_scale(fp8_dir, tmp_path, capsys, _cli):
    name = "model.layers.0.self_attn.kv_a_proj_with_mqa.weight_scale_inv"
    bad = _edit(fp8_dir, tmp_path / "bad", lambda ts: ts.pop(name))
    code, out, err = _cli(["run", str(bad), "--prompt-ids", "1,2"], capsys)
    assert code != 0 and out == ""
    assert name in err and len(err.strip().splitlines()) == 1


def test_misshaped_scale(fp8_dir, tmp_path, capsys, _cli):
    names = ("model.layers.1.self_attn.kv_b_proj.weight_scale_inv",  # dequantized at load (read as a tensor)
             "model.layers.1.mlp.experts.3.down_proj.weight_scale_inv",  # held quantized (QuantizedExperts)
             "model.layers.0.mlp.up_proj.weight_scale_inv")  # held quantized (a linear)
    for n in names:
        d = tmp_path / n.replace(".", "_")

        def change(ts, n=n):
            ts[n] = torch.ones(ts[n].shape[0] + 1, ts[n].shape[1])

        bad = _edit(fp8_dir, d, change)
        code, out, err = _cli(["run", str(bad), "--prompt-ids", "1,2"], capsys)
        assert code != 0 and out == ""
        assert n in err and "ceil(N / block)" in err and len(err.strip().splitlines()) == 1, err


@pytest.mark.parametrize("q,msg", [
    (dict(quant_method="awq"), "quant_method 'awq'"),
    (dict(quant_method="fp8", fmt="e5m2"), "fmt must be e4m3"),
    (dict(quant_method="compressed-tensors", format="marlin-24", config_groups={"g": {"targets": ["Linear"]}}),
     "format 'marlin-24'"),
    (dict(quant_method="compressed-tensors", format="int-quantized", config_groups={"g": {
        "targets": ["Linear"], "weights": {"num_bits": 8, "type": "int", "strategy": "channel"},
        "input_activations": {"num_bits": 8, "type": "int", "dynamic": True}}}),
     "input activations must be dynamic symmetric int8 per token"),  # no strategy: not per token
    (dict(quant_method="compressed-tensors", format="int-quantized", config_groups={"g": {
        "targets": ["Linear"], "weights": {"num_bits": 8, "type": "int", "strategy": "channel"},
        "input_activations": {"num_bits": 8, "type": "float", "strategy": "token", "dynamic": True,
                              "symmetric": True}}}), "got num_bits=8, type='float'"),
    (dict(quant_method="compressed-tensors", format="int-quantized", config_groups={"g": {
        "targets": ["Linear"], "weights": {"num_bits": 8, "type": "int", "strategy": "channel"},
        "output_activations": {"num_bits": 8}}}), "quantized output activations"),
    (dict(quant_method="compressed-tensors", format="pack-quantized", config_groups={"g": {
        "targets": ["Linear"], "weights": {"num_bits": 4, "type": "int", "strategy": "group"}}}), "group_size"),
])
def test_unsupported_configs(q, msg, tmp_path, capsys, _cli):
    cfg = dict(tiny_config("llama"), quantization_config=q)
    with pytest.raises(ConfigError, match=msg):
        ModelSpec.from_hf_config(cfg)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    code, out, err = _cli(["run", str(tmp_path), "--prompt-ids", "1,2"], capsys)
    assert code != 0 and msg in err and len(err.strip().splitlines()) == 1


def test_parsed_formats():
    a8 = ModelSpec.from_hf_config(dict(tiny_config("llama"), quantization_config={
        "quant_method": "compressed-tensors", "format": "int-quantized", "config_groups": {"group_0": {
            "targets": ["Linear"], "weights": {"num_bits": 8, "type": "int", "strategy": "channel"},
            "input_activations": {"num_bits": 8, "type": "int", "strategy": "token", "dynamic": True,
                                  "symmetric": True, "group_size": None}}}}))
    assert a8.quant.activations == "int8"
    ct = ModelSpec.from_hf_config(dict(tiny_config("llama"), quantization_config={
        "quant_method": "compressed-tensors", "format": "pack-quantized", "ignore": ["lm_head", "re:.*k_proj"],
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
            "num_bits": 4, "type": "int", "symmetric": False, "strategy": "group", "group_size": 32}}}}))
    q = ct.quant
    assert (q.method, q.fmt, q.bits, q.group_size, q.symmetric, q.weight_dtype) == (
        "compressed-tensors", "pack-quantized", 4, 32, False, "int4")
    assert not q.quantizes("model.layers.0.self_attn.k_proj.weight") and q.quantizes("model.layers.0.mlp.up_proj.weight")
    from adapt.layout import WeightLayout

    names = {t.name: t for t in WeightLayout.from_spec(ct)}
    p = "model.layers.0.mlp.down_proj."
    assert names[p + "weight_packed"].stored_shape == (64, 12) and names[p + "weight_packed"].nbytes == 64 * 96 // 2
    assert names[p + "weight_scale"].shape == (64, 3) and names[p + "weight_zero_point"].stored_shape == (8, 3)
    assert "model.layers.0.self_attn.k_proj.weight" in names  # ignored: kept as it is
    ds = ModelSpec.from_hf_config(dict(tiny_config("deepseek_v3"), quantization_config={
        "quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128],
        "modules_to_not_convert": ["model.layers.0.mlp.down_proj"]}))
    assert ds.quant.block_size == (128, 128) and ds.weight_dtype == "float8_e4m3fn"
    assert not ds.quant.quantizes("model.layers.0.mlp.down_proj.weight")
