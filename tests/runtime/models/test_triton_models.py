"""``adapt run MODEL --kernels triton --dtype float32`` under Triton's CPU interpreter gives transformers'
greedy tokens for tiny llama, qwen3_moe, mixtral and deepseek_v3 models, and its stats name each op's backend."""

import json
import os

import pytest

os.environ.setdefault("TRITON_INTERPRET", "1")  # before the Triton kernels are decorated (on first use)
pytest.importorskip("triton", reason="triton is not installed (pip install 'adapt[triton]')")

from tests.runtime.models.test_models_vs_transformers import _hf_greedy  # noqa: E402

PROMPT = [1, 20, 30, 40, 50, 60, 70]
TRITON_OPS = {"varlen_attention", "paged_decode_attention", "write_kv_cache", "fused_add_rms_norm", "rms_norm"}


@pytest.mark.parametrize("family", ["llama", "qwen3_moe", "mixtral", "deepseek_v3"])
def test_adapt_run_triton_interpreter_matches_transformers(family, tiny_dir, capsys, monkeypatch, tmp_path):
    from adapt.cli.main import main

    hf, path = tiny_dir(family)
    want = _hf_greedy(hf, PROMPT, 6)
    monkeypatch.setenv("ADAPT_CACHE", str(tmp_path))
    code = 0
    try:
        main(["run", str(path), "--prompt-ids", ",".join(map(str, PROMPT)), "--kernels", "triton", "--dtype",
              "float32", "--max-tokens", "6", "--ignore-eos", "--kv-cache-memory", "4MiB", "--format", "json"])
    except SystemExit as e:
        code = e.code or 0
    assert code == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["outputs"][0]["token_ids"] == want
    ops = doc["stats"]["kernels"]["ops"]
    moe = {"moe_experts_fused", "sigmoid_grouped_topk" if family == "deepseek_v3" else "router_softmax_topk"}
    attn = {"mla_prefill", "mla_decode", "write_mla_cache"} if family == "deepseek_v3" else TRITON_OPS
    assert all(ops[o] == "triton" for o in attn | (moe if family != "llama" else set())), ops
    assert ops["quantize_int8"] == "torch"  # no Triton kernel: the torch form
