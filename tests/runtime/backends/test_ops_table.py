"""`adapt ops MODEL`: the operator-mapping table (JSON {"ops": [{"op", "layers", "impl", "candidates",
"fallback"}]}), from the CLI in this process."""

import json

import pytest

from adapt.runtime.backends import triton_backend


def _ops(capsys, *args):
    from adapt.cli.main import main

    code = 0
    try:
        main(["ops", *args])
    except SystemExit as e:
        code = e.code or 0
    out = capsys.readouterr()
    return code, out.out, out.err


@pytest.mark.skipif(triton_backend.missing() is not None, reason="triton is not installed")
def test_tiny_k2_on_cuda_lists_every_op_with_its_impl(capsys):
    code, out, _ = _ops(capsys, "tiny-k2", "--device", "cuda", "--format", "json")
    assert code == 0
    rows = json.loads(out)["ops"]
    assert len(rows) >= 8 and all({"op", "layers", "impl", "candidates", "fallback"} <= set(r) for r in rows)
    by = {r["op"]: r for r in rows}
    assert by["mla_decode"]["impl"] == "triton" and by["mla_decode"]["layers"] == [0, 1, 2]
    assert by["moe_experts_fused"]["layers"] == [1, 2]  # first_k_dense_replace: layer 0 is dense
    assert by["sigmoid_grouped_topk"]["impl"] == "triton" and not by["sigmoid_grouped_topk"]["fallback"]


def test_cpu_shows_the_cpp_kernels_and_the_torch_fallbacks(capsys):
    code, out, _ = _ops(capsys, "tiny-llama", "--device", "cpu", "--dtype", "float32", "--format", "json")
    by = {r["op"]: r for r in json.loads(out)["ops"]}
    assert code == 0 and by["paged_decode_attention"]["impl"] == "cpu" and by["paged_decode_attention"]["form"] == "C++ fused"
    assert by["varlen_attention"]["impl"] == "torch" and by["varlen_attention"]["fallback"]
    assert "mla_decode" not in by and by["rms_norm"]["layers"] == [0]
    code, md, _ = _ops(capsys, "tiny-llama", "--format", "md")
    assert code == 0 and "| paged_decode_attention | 0-1 | cpu | C++ fused |" in md


def test_a_plugin_shows_up_as_impl_for_its_ops(acme, capsys):
    code, out, _ = _ops(capsys, "tiny-k2", "--device", "npu", "--format", "json")
    doc = json.loads(out)
    by = {r["op"]: r for r in doc["ops"]}
    assert code == 0 and by["rms_norm"]["impl"] == "acme" and by["silu_and_mul"]["impl"] == "acme"
    assert by["mla_decode"]["impl"] == "torch" and by["mla_decode"]["fallback"]
    assert {"name": "acme", "origin": "plugin acme-backend 0.1", "available": True, "why": None, "ops": 2} in doc["backends"]


@pytest.mark.parametrize("args,msg", [(["tiny-k2", "--format", "xml"], "--format must be one of table, json, md"),
                                      (["tiny-k2", "--kernels", "fast"], "--kernels must be one of auto"),
                                      (["tiny-k2", "--device", "cuda", "--kernels", "cpu"], "runs on cpu, not cuda"),
                                      (["no-such-model-33"], "is not a directory"),
                                      (["tiny-k2", "--dtype", "fp4"], "--dtype must be one of")])
def test_bad_input_is_one_line(capsys, args, msg):
    code, out, err = _ops(capsys, *args)
    assert code == 1 and out == "" and msg in err and "Traceback" not in err and len(err.strip().splitlines()) == 1
