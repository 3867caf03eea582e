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
    from adapt.runtime.backends.cpu_layouts import experts_form

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


@pytest.mark.parametrize("scheme", ["int8", "int4", "fp8", "int4+lm_head"])
def test_runtime_weight_bytes_match_profile(llama, tmp_path, scheme):
    """stats.weight_bytes (resident, measured) against `adapt profile`'s weights line (from the layout: the
    stored bytes of each format, scales included): within 2%; with lm_head quantized (tied source) too."""
    import subprocess
    import sys

    out = tmp_path / scheme
    if scheme.endswith("+lm_head"):
        src = save_tiny("llama_tied", tmp_path / "src")[1]
        shard(src, out, quantize=scheme.split("+")[0], group_size=32, quantize_lm_head=True)
    else:
        shard(llama, out, quantize=scheme, group_size=32)
    prof = subprocess.run([sys.executable, "-m", "adapt", "profile", str(out), "--format", "json"],
                          capture_output=True, text=True, check=True)
    want = json.loads(prof.stdout)["memory"]["weights_bytes"]
    got = Engine.from_pretrained(out, dtype="float32").weight_bytes
    assert abs(got - want) <= 0.02 * want, (got, want)


def _hf_logits(out, tmp_path):
    """transformers' float32 logits of PROMPT from a tp1 shard output (its compressed-tensors integration)."""
    import transformers

    hf_dir = tmp_path / "hf"
    hf_dir.mkdir()
    (hf_dir / "config.json").write_text((out / "config.json").read_text())
    (hf_dir / "model.safetensors").symlink_to(next((out / "rank-00000").glob("*.safetensors")))
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32).eval()
    with torch.no_grad():
        return hf, hf(torch.tensor([PROMPT])).logits[0]


@pytest.mark.parametrize("family", ["llama_tied", "llama"])
@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_quantize_lm_head(tmp_path, family, scheme):
    """--quantize-lm-head: lm_head is held quantized (a tied head untied: lm_head written from the embedding,
    which stays float for the lookup); logits vs the twin within 1e-5 in float32; the head's bytes drop by the
    format's ratio; verify --source checks the head against the embedding it came from; transformers loads it."""
    src = save_tiny(family, tmp_path / "src")[1]
    plain, out = tmp_path / "plain", tmp_path / "head"
    shard(src, plain, quantize=scheme, group_size=32)
    shard(src, out, quantize=scheme, group_size=32, quantize_lm_head=True)
    rep = verify(out, source=src)
    assert rep.ok, [p.line() for p in rep.problems]
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["quantization_config"]["ignore"] == [] and cfg.get("tie_word_embeddings") is not True
    names = {t.name: t for f in load_manifest(out).files for t in f.tensors}
    head = "lm_head.weight" if scheme == "int8" else "lm_head.weight_packed"
    assert names[head].transform.startswith("quantize:")
    assert names[head].source == ("model.embed_tokens.weight" if family == "llama_tied" else "lm_head.weight")
    assert names["model.embed_tokens.weight"].transform == "none"

    fused = Engine.from_pretrained(out, dtype="float32")
    twin = Engine.from_pretrained(out, dtype="float32", kernels="reference")
    lm = fused.model.lm_head
    assert isinstance(lm.weight, QuantizedWeight) and lm.tied is None
    assert fused.model.embed.weight.dtype == torch.float32
    a, b = fused.prefill_logits(PROMPT), twin.prefill_logits(PROMPT)
    assert torch.allclose(a, b, atol=1e-5, rtol=1e-5), (a - b).abs().max()
    # the twin's head is the dequantized weight: the logits are x @ dequant(W)^T, W quantized from the source head
    w_src = (fused.model.embed.weight if family == "llama_tied" else
             Engine.from_pretrained(plain, dtype="float32", prepack="off").model.lm_head.weight).float()
    deq = lm.weight.dequantized()
    step = w_src.abs().amax(dim=1, keepdim=True) / (127 if scheme == "int8" else 7)
    assert ((deq - w_src).abs() <= step / 2 + 1e-6).all()  # round-to-nearest: within half a step per row
    base = Engine.from_pretrained(plain, dtype="float32")
    v, h = cfg["vocab_size"], cfg["hidden_size"]
    saved = base.weight_bytes - fused.weight_bytes
    if family == "llama_tied":  # the tied base holds the table once; now it is held twice, once quantized
        assert saved == -lm.weight.nbytes()
    else:
        assert saved == 4 * v * h - lm.weight.nbytes()
    assert lm.weight.nbytes() < (0.3 if scheme == "int8" else 0.2) * 4 * v * h
    pytest.importorskip("compressed_tensors", reason="compressed-tensors is not installed: transformers cannot "
                                                     "load the checkpoint here")
    hf, ref = _hf_logits(out, tmp_path)
    assert hf.lm_head.weight.data_ptr() != hf.model.embed_tokens.weight.data_ptr()  # untied
    assert torch.allclose(a, ref, atol=1e-4, rtol=1e-4), (a - ref).abs().max()


def test_quantize_lm_head_needs_int(llama, tmp_path):
    for kw, msg in ((dict(quantize="fp8"), "--quantize-lm-head needs --quantize int8 or int4 \\(DeepSeek"),
                    (dict(), "--quantize-lm-head needs --quantize int8 or int4")):
        out = tmp_path / "x"
        with pytest.raises(ShardError, match=msg):
            shard(llama, out, quantize_lm_head=True, **kw)
        assert not out.exists()
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-m", "adapt", "shard", str(llama), "--out", str(out), "--quantize", "fp8",
                        "--quantize-lm-head"], capture_output=True, text=True)
    assert r.returncode != 0 and "--quantize-lm-head needs" in r.stderr and "Traceback" not in r.stderr
    assert not out.exists()


@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_int8_activations(tmp_path, scheme):
    """--activations int8: the config declares dynamic per-token int8 inputs (W8A8 / W4A8), the runtime quantizes
    each linear's input rows (the vpdpbusd decode at these widths, the buffered path on the dequantized rows in
    prefill) and agrees with its twin; the weights are those of the weight-only shard."""
    src = save_tiny("llama", tmp_path / "src", hidden_size=128, intermediate_size=256, num_attention_heads=4,
                    num_key_value_heads=2, head_dim=32)[1]
    out, plain = tmp_path / "a8", tmp_path / "w"
    shard(src, out, quantize=scheme, activations="int8", quantize_lm_head=True)
    shard(src, plain, quantize=scheme, quantize_lm_head=True)
    assert verify(out, source=src).ok
    acts = json.loads((out / "config.json").read_text())["quantization_config"]["config_groups"]["group_0"]
    assert acts["input_activations"]["strategy"] == "token" and acts["input_activations"]["dynamic"] is True
    fused = Engine.from_pretrained(out, dtype="float32")
    twin = Engine.from_pretrained(out, dtype="float32", kernels="reference")
    held = [m for m in fused.model.modules() if isinstance(m, QuantizedWeight)]
    assert held and {m.act for m in held} == {"int8"}
    a, b = fused.prefill_logits(PROMPT), twin.prefill_logits(PROMPT)
    assert torch.allclose(a, b, atol=1e-5, rtol=1e-5), (a - b).abs().max()
    w = Engine.from_pretrained(plain, dtype="float32")
    assert (w.prefill_logits(PROMPT) - a).abs().max() > 1e-4  # the inputs really are quantized
    assert fused.weight_bytes == w.weight_bytes
    from adapt.runtime.sampling import SamplingParams

    sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    got = fused.generate([PROMPT], sp)[0].token_ids
    assert got == twin.generate([PROMPT], sp)[0].token_ids
    forms = fused.last_stats["weights"]["quantized"]
    assert all(f.endswith("int8 activations per token") for f in forms), forms


def test_bad_activations_options(llama, tmp_path):
    with pytest.raises(ShardError, match="--activations must be none or int8"):
        shard(llama, tmp_path / "a", quantize="int8", activations="fp8")
    with pytest.raises(ShardError, match="--activations int8 needs --quantize int8 or int4"):
        shard(llama, tmp_path / "b", activations="int8")
    with pytest.raises(ShardError, match=r"--activations int8 needs --quantize int8 or int4 \(W8A8"):
        shard(llama, tmp_path / "c", quantize="fp8", activations="int8")
    assert not any((tmp_path / d).exists() for d in "abc")
