"""bench/quant_bench.py --smoke: the bench runs on tiny models; without llama-cpp-python it says the llama.cpp peer
is absent and still reports adapt's forms; with it (slow), the GGUF of the same weights is the same model
(F32 greedy tokens equal adapt float32's, logits close) and the Q8_0 / Q4_0 ratios are reported."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "quant_bench.py"


def _run(tmp_path: Path, *args: str, hide_llama_cpp: bool = False) -> dict:
    env = dict(os.environ)
    if hide_llama_cpp:  # a llama_cpp that fails to import, ahead of any installed one
        (tmp_path / "hide").mkdir()
        (tmp_path / "hide" / "llama_cpp.py").write_text("raise ImportError('hidden by the test')\n")
        env["PYTHONPATH"] = os.pathsep.join([str(tmp_path / "hide"), env.get("PYTHONPATH", "")])
    p = subprocess.run([sys.executable, str(SCRIPT), "--smoke", "--models", "dense", *args], capture_output=True,
                       text=True, env=env, timeout=600)
    assert p.returncode == 0, p.stderr[-2000:]
    return json.loads(p.stdout)["dense"]


def test_smoke_without_llama_cpp_reports_the_peer_absent(tmp_path):
    r = _run(tmp_path, "--batches", "1", "--lm-head", "plain", hide_llama_cpp=True)
    assert "llama-cpp-python is not installed" in r["llama_cpp"]["absent"]
    assert r["decode_b1"]["int8_tok_s"] > 0 and r["decode_b1"]["int4_tok_s"] > 0
    assert not any("llama.cpp" in k for k in r["decode_b1"])


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("llama_cpp") is None or importlib.util.find_spec("gguf") is None,
                    reason="llama-cpp-python / gguf are not installed: the bench's llama.cpp peer is absent")
def test_smoke_with_llama_cpp_times_the_same_model(tmp_path):
    r = _run(tmp_path, "--lm-head", "plain")
    peer = r["llama_cpp"]
    check = peer["f32_vs_adapt_fp32"]
    assert check["greedy_equal"] and check["top1_agreement"] == 1.0 and check["logits_max_abs"] < 1e-3, check
    assert peer["bytes_per_weight"] == {"llama.cpp bf16": 2.0, "llama.cpp q8_0": 34 / 32, "llama.cpp q4_0": 18 / 32}
    for b in (1, 16):
        row = r[f"decode_b{b}"]
        for k in ("bf16_vs_llama.cpp bf16", "int8_vs_llama.cpp q8_0", "int4_vs_llama.cpp q4_0"):
            assert row[k] > 0, (b, k, row)
    top1 = peer["top1_vs_adapt_fp32"]
    assert set(top1) == {"bf16", "int8", "int4", "llama.cpp bf16", "llama.cpp q8_0", "llama.cpp q4_0"}
    assert top1["llama.cpp q8_0"] >= 0.5 and top1["int8"] >= 0.5, top1
