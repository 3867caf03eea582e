"""`adapt shard --quantize int8|int4|fp8`: compressed-tensors / DeepSeek-fp8 checkpoints adapt and transformers read."""

from __future__ import annotations

import json

import pytest
import torch

from adapt.errors import ShardError
from adapt.runtime.engine import Engine
from adapt.runtime.quant.weight import QuantizedWeight
from adapt.shard import load_manifest, shard, verify
from tests.fixtures.quant import save_quantized
from tests.fixtures.tiny import save_tiny

PROMPT = [1, 5, 9, 33, 2, 7]


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return save_tiny("llama", tmp_path_factory.mktemp("llama") / "src")[1]


def _linear_ratio(eng: Engine) -> float:
    held = [m for m in eng.model.modules() if isinstance(m, QuantizedWeight)]
    assert held
    return sum(m.nbytes() for m in held) / sum(4 * m.n * m.k for m in held)


@pytest.mark.parametrize("scheme,limit", [("int8", 0.4), ("int4", 0.25)])
def test_compressed_tensors_output(llama, tmp_path, scheme, limit):
    out = tmp_path / scheme
    shard(llama, out, quantize=scheme, group_size=32)
    rep = verify(out, source=llama)
    assert rep.ok, [p.line() for p in rep.problems]
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["quantization_config"]["quant_method"] == "compressed-tensors"
    transforms = {t.transform for f in load_manifest(out).files for t in f.tensors}
    assert transforms == {"none", "quantize:int8" if scheme == "int8" else "quantize:int4:g32"}
    fused = Engine.from_pretrained(out, dtype="float32")
    twin = Engine.from_pretrained(out, dtype="float32", kernels="reference")
    a, b = fused.prefill_logits(PROMPT), twin.prefill_logits(PROMPT)
    assert torch.allclose(a, b, atol=1e-5, rtol=1e-5), (a - b).abs().max()
    ratio = _linear_ratio(fused)
    assert ratio < limit, ratio
    dense = Engine.from_pretrained(llama, dtype="float32", prepack="off")
    assert fused.weight_bytes < dense.weight_bytes
    # what transformers reads (its compressed-tensors integration decompresses on load)
    pytest.importorskip("compressed_tensors", reason="compressed-tensors is not installed: transformers cannot "
                                                     "load the checkpoint here")
    import transformers

    hf_dir = tmp_path / "hf"
    hf_dir.mkdir()
    (hf_dir / "config.json").write_text((out / "config.json").read_text())
    (hf_dir / "model.safetensors").symlink_to(next((out / "rank-00000").glob("*.safetensors")))
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32).eval()
    with torch.no_grad():
        ref = hf(torch.tensor([PROMPT])).logits[0]
    assert torch.allclose(a, ref, atol=1e-4, rtol=1e-4), (a - ref).abs().max()


def test_fp8_output_and_fp8_source_to_int4(tmp_path, llama):
    out = tmp_path / "fp8"
    shard(llama, out, quantize="fp8")
    assert verify(out, source=llama).ok
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["quantization_config"]["weight_block_size"] == [128, 128]
    eng = Engine.from_pretrained(out, dtype="float32")
    assert {m.kind for m in eng.model.modules() if isinstance(m, QuantizedWeight)} == {"fp8"}
    # a DeepSeek-V3 fp8 checkpoint re-quantized to int4 groups (Kimi-K2-Thinking's form): dequantized first
    src, _ = save_quantized("deepseek_v3", tmp_path / "ds", "fp8", block=(32, 32))
    out4 = tmp_path / "ds-int4"
    shard(src, out4, quantize="int4", group_size=16)
    rep = verify(out4, source=src)
    assert rep.ok, [p.line() for p in rep.problems]
    e4 = Engine.from_pretrained(out4, dtype="float32")
    assert {m.kind for m in e4.model.modules() if isinstance(m, QuantizedWeight)} == {"int4"}
    from adapt.runtime.models.moe import experts_form

    assert experts_form(e4.model) == "quantized (int4 g16)"
    t4 = Engine.from_pretrained(out4, dtype="float32", kernels="reference")
    assert torch.allclose(e4.prefill_logits(PROMPT), t4.prefill_logits(PROMPT), atol=1e-5, rtol=1e-5)


def test_bad_quantize_options(llama, tmp_path):
    with pytest.raises(ShardError, match="--quantize must be one of"):
        shard(llama, tmp_path / "a", quantize="int3")
    out = tmp_path / "b"
    # o_proj's K is 4 heads x 24 = 96; tp 2 gives each rank 48 columns, which groups of 32 do not tile
    with pytest.raises(ShardError, match=r"o_proj.weight: --group-size 32 does not divide K = 48"):
        shard(llama, out, tp=2, quantize="int4", group_size=32)
    assert not out.exists()


@pytest.mark.parametrize("scheme", ["int8", "int4", "fp8"])
def test_runtime_weight_bytes_match_profile(llama, tmp_path, scheme):
    """stats.weight_bytes (resident, measured) against `adapt profile`'s weights line (from the layout: the
    stored bytes of each format, scales included): within 2%."""
    import subprocess
    import sys

    out = tmp_path / scheme
    shard(llama, out, quantize=scheme, group_size=32)
    prof = subprocess.run([sys.executable, "-m", "adapt", "profile", str(out), "--format", "json"],
                          capture_output=True, text=True, check=True)
    want = json.loads(prof.stdout)["memory"]["weights_bytes"]
    got = Engine.from_pretrained(out, dtype="float32").weight_bytes
    assert abs(got - want) <= 0.02 * want, (got, want)
