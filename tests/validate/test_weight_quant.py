"""weight_quant_impact on tiny quantized checkpoints (tests/fixtures/quant.py): correct int8 / int4 / fp8 pass
against their unquantized source, a broken down_proj scale fails and names its layer, a plain model skips,
the quantized checkpoint as its own reference (dequantized at load where transformers cannot read it) passes,
and the item reaches report.html and the signed baseline. Expected rounding error vs the real one."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from adapt.quantize import pack_int4, quantize_fp8_blocks, quantize_int4_groups, quantize_int8_channel
from adapt.runtime.quant.weight import QuantizedWeight
from adapt.validate.quant_error import expected_rel_error
from adapt.validate.reference import HFReference
from adapt.validate.runner import run_validation, validate
from tests.fixtures.quant import save_quantized

SCHEMES = {"int8": ("llama", {}), "int4": ("llama", {"group": 32}), "fp8": ("deepseek_v3", {"block": (32, 32)})}


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, tuple[Path, Path, Path]]:
    """scheme -> (quantized dir, unquantized source dir, float32 dequantized twin dir)."""
    root = tmp_path_factory.mktemp("wq")
    out = {}
    for scheme, (family, kw) in SCHEMES.items():
        qdir, ddir = save_quantized(family, root / scheme, scheme, **kw)
        out[scheme] = (qdir, root / scheme / "src", ddir)
    return out


def _item(target: Path, reference: Path, dtype: str = "float32"):
    report, _ = run_validation(target, reference, only={"weight_quant"}, dtype=dtype)
    (item,) = report.items
    assert item.id == "weight_quant_impact"
    return item


def _broken(src: Path, dst: Path, name: str, factor: float) -> Path:
    shutil.copytree(src, dst)
    t = load_file(str(dst / "model.safetensors"))
    assert name in t
    t[name] = t[name] * factor
    save_file(t, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


@pytest.mark.parametrize("scheme", list(SCHEMES))
def test_correct_quantization_passes_against_its_source(models, scheme):
    qdir, src, _ = models[scheme]
    it = _item(qdir, src)
    m = it.metrics
    assert it.status == "pass", it.message
    assert m["baseline"] == "source" and "first_broken_layer" not in m
    assert 0 < m["top1_positions"] < 76 and m["top1_agreement"] >= 0.9 and "nats" in it.message
    assert m["kl_mean"] > 0 and m["layer_rel_err"] > 1e-3  # the rounding is seen, not hidden
    assert m["layer_growth"] <= 6.0
    mlps = [r for r in m["layers"] if r["name"].endswith(".mlp")]
    assert mlps and all(r["weight_rel_err_expected"] > 0 for r in mlps)


def test_expected_weight_error_orders_the_schemes(models):
    got = {s: _item(models[s][0], models[s][1]).metrics["weight_rel_err_expected"] for s in ("int8", "int4")}
    assert 0.002 < got["int8"] < 0.02 < got["int4"] < 0.2, got


@pytest.mark.parametrize("scheme,tensor,factor,layer", [
    ("int8", "model.layers.1.mlp.down_proj.weight_scale", 1.5, "layers.1.mlp"),
    ("int4", "model.layers.0.mlp.down_proj.weight_scale", 50.0, "layers.0.mlp"),
    ("fp8", "model.layers.2.mlp.shared_experts.down_proj.weight_scale_inv", 50.0, "layers.2.mlp"),
])
def test_broken_scale_fails_and_names_its_layer(models, tmp_path, scheme, tensor, factor, layer):
    qdir, src, _ = models[scheme]
    it = _item(_broken(qdir, tmp_path / "broken", tensor, factor), src)
    assert it.status == "fail"
    assert it.metrics["first_broken_layer"] == layer
    assert f"first layer that breaks: {layer} " in it.message
    assert it.metrics["layer_growth"] > 6.0


def test_not_quantized_skips_with_the_reason(models):
    _, src, _ = models["int8"]
    it = _item(src, src)
    assert it.status == "skip" and "not quantized" in it.message


def test_fp8_deepseek_against_itself_uses_the_dequantized_checkpoint(models):
    qdir, _, _ = models["fp8"]
    it = _item(qdir, qdir)
    m = it.metrics
    assert it.status == "pass", it.message
    assert m["baseline"] == "dequantized" and "weight_rel_err_expected" not in m
    assert "not the rounding" in it.message
    assert m["layer_rel_err"] < 1e-4 and m["top1_agreement_all"] == 1.0
    try:
        import accelerate  # noqa: F401
    except ImportError:  # transformers then cannot read the fp8 checkpoint: adapt dequantized it, and says so
        assert "dequantized at load by adapt, since transformers could not load it quantized" in it.message


def test_reference_of_a_quantized_checkpoint_is_its_dequantized_twin(models):
    qdir, _, ddir = models["int4"]
    ref, twin = HFReference(qdir), HFReference(ddir)
    assert torch.equal(ref.logits(0), twin.logits(0))
    if ref.dequantized_because:
        assert "dequantized at load by adapt" in ref.description


def test_item_reaches_the_report_and_the_baseline(models, tmp_path):
    qdir, src, _ = models["int8"]
    res = validate(qdir, src, tmp_path / "out", only={"weight_quant"}, write_baseline_to=tmp_path / "b.json",
                   signer="Ada")
    html = (tmp_path / "out" / "report.html").read_text()
    assert "weight_quant_impact" in html and "layer_growth" in html
    assert "weight_quant_impact" in (tmp_path / "b.json").read_text()
    data = json.loads((tmp_path / "out" / "report.json").read_text())
    (item,) = [x for x in data["items"] if x["id"] == "weight_quant_impact"]
    assert item["status"] == "pass" and res.exit_code == 0


@pytest.mark.parametrize("scheme", ["int8", "int4", "fp8"])
def test_expected_rounding_error_matches_the_real_one_and_ignores_the_scale(scheme):
    g = torch.Generator().manual_seed(0)
    w = torch.randn(64, 128, generator=g)
    name = "model.layers.0.mlp.down_proj.weight"
    if scheme == "fp8":
        q, s = quantize_fp8_blocks(w, (32, 32))
        qw = QuantizedWeight("fp8", 64, 128, 32, 32, False, [(name, 0, 64)], False)
    elif scheme == "int8":
        q, s = quantize_int8_channel(w)
        qw = QuantizedWeight("int8", 64, 128, 1, 128, False, [(name, 0, 64)], False)
    else:
        q, s, _ = quantize_int4_groups(w, 32)
        q = pack_int4(q).view(torch.uint8)
        qw = QuantizedWeight("int4", 64, 128, 1, 32, False, [(name, 0, 64)], False)
    with torch.no_grad():
        qw.q.copy_(q.view(qw.q.dtype) if q.dtype != qw.q.dtype and q.element_size() == 1 else q)
        qw.scale.copy_(s.float().view(qw.scale.shape))
    real = float((qw.dequantized() - w).norm() / w.norm())
    exp = expected_rel_error(qw)
    assert 0.8 < real / exp < 1.1, (real, exp)
    with torch.no_grad():
        qw.scale.mul_(50.0)
    assert expected_rel_error(qw) == pytest.approx(exp, rel=1e-9)
