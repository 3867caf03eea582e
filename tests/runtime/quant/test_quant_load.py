"""Quantized checkpoints run directly: fp8 blocks (DeepSeek-V3 layout) and compressed-tensors int8 / int4."""

from __future__ import annotations

import pytest
import torch

from adapt.runtime.engine import Engine
from adapt.runtime.quant.weight import QuantizedWeight
from adapt.runtime.sampling import SamplingParams
from tests.fixtures.quant import save_quantized

PROMPTS = [[1, 5, 9, 33, 2], [7, 100, 3]]


def _hf_greedy(path, prompt, n):
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, eos_token_id=None,
                             pad_token_id=0)
    return out[0, len(prompt):].tolist()


@pytest.mark.parametrize("block", [(128, 128), (32, 16)])
def test_fp8_deepseek_v3_runs_directly_and_matches_transformers(tmp_path, block):
    qdir, ddir = save_quantized("deepseek_v3", tmp_path, "fp8", block=block)
    eng = Engine.from_pretrained(qdir, dtype="float32")
    held = [m for m in eng.model.modules() if isinstance(m, QuantizedWeight)]
    assert held and all(m.kind == "fp8" for m in held)
    assert {m.q.dtype for m in held} == {torch.float8_e4m3fn}
    # gate|up rows (96) start the up rows off a 128-row block edge: held with one scale row per weight row
    assert any(m.rb == 1 for m in held) == (block[0] == 128)
    ref = Engine.from_pretrained(ddir, dtype="float32")
    assert eng.weight_bytes < ref.weight_bytes
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    got = [r.token_ids for r in eng.generate(PROMPTS, params)]
    want = [_hf_greedy(ddir, p, 8) for p in PROMPTS]
    assert got == want
    st = eng.last_stats
    assert st["weight_bytes"] == eng.weight_bytes
    assert st["moe_experts"].startswith("quantized (fp8")  # routed experts stay fp8 too
    forms = st["weights"]["quantized"]
    assert sum(g["tensors"] for g in forms.values()) == len(held)


@pytest.mark.parametrize("scheme,kw", [("int8", {}), ("int4", {"group": 32}), ("int4", {"group": 16, "symmetric": False}),
                                       ("int4", {"group": None})])
def test_compressed_tensors_llama_against_twin(tmp_path, scheme, kw):
    qdir, ddir = save_quantized("llama", tmp_path, scheme, **kw)
    fused = Engine.from_pretrained(qdir, dtype="float32")
    twin = Engine.from_pretrained(qdir, dtype="float32", kernels="reference")
    held = [m for m in fused.model.modules() if isinstance(m, QuantizedWeight)]
    assert held and all(m.kind == scheme for m in held)
    for p in PROMPTS:
        a, b = fused.prefill_logits(p), twin.prefill_logits(p)
        assert torch.allclose(a, b, atol=1e-5, rtol=1e-5), (a - b).abs().max()
        # and transformers on the dequantized weights (the same values, summed in another order)
        import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(str(ddir), dtype=torch.float32).eval()
    with torch.no_grad():
        ref = hf(torch.tensor([PROMPTS[0]])).logits[0]
    assert torch.allclose(fused.prefill_logits(PROMPTS[0]), ref, atol=1e-4, rtol=1e-4)
    dense = Engine.from_pretrained(ddir, dtype="float32", prepack="off")
    assert fused.weight_bytes < dense.weight_bytes


def test_weights_dtype_dequantizes_at_load(tmp_path):
    qdir, ddir = save_quantized("deepseek_v3", tmp_path, "fp8", block=(32, 16))
    eng = Engine.from_pretrained(qdir, dtype="float32", weights_dtype="fp32")
    assert not any(isinstance(m, QuantizedWeight) for m in eng.model.modules())
    ref = Engine.from_pretrained(ddir, dtype="float32")
    p = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    assert [r.token_ids for r in eng.generate(PROMPTS, p)] == [r.token_ids for r in ref.generate(PROMPTS, p)]
