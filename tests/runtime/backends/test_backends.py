import pytest
import torch

from adapt.errors import RuntimeConfigError
from adapt.runtime.backends import OPS, backends, choose, plugin_errors, select_kernels
from adapt.runtime.backends import triton_backend


def test_auto_on_cpu_takes_the_cpp_kernels_and_falls_back_op_by_op():
    c = choose("auto", "cpu", torch.float32)
    assert set(c) == set(OPS)
    assert c["rms_norm"].backend == "cpu" and not c["rms_norm"].fallback
    assert c["paged_decode_attention"].backend == "cpu"
    assert c["varlen_attention"].backend == "torch" and c["varlen_attention"].fallback  # no CPU-specific form
    assert "reference" not in c["rms_norm"].candidates  # the twins are the oracle, never a candidate


def test_a_named_backend_takes_its_ops_and_the_rest_from_torch():
    c = choose("cpu", "cpu", torch.bfloat16)
    assert c["fused_add_rms_norm"].backend == "cpu" and c["mla_prefill"].backend == "torch"
    assert {x.backend for x in choose("torch", "cpu", torch.float32).values()} == {"torch"}
    assert not any(x.fallback for x in choose("torch", "cpu", torch.float32).values())
    assert {x.backend for x in choose("reference", "cuda", torch.float32).values()} == {"reference"}
    assert choose("adapt", "cpu", torch.float32) == choose("auto", "cpu", torch.float32)  # the old name


@pytest.mark.skipif(triton_backend.missing() is not None, reason="triton is not installed")
def test_auto_on_cuda_takes_triton_where_it_has_a_kernel():
    c = choose("auto", "cuda", torch.bfloat16)
    assert c["paged_decode_attention"].backend == "triton" and c["moe_experts_fused"].backend == "triton"
    assert c["quantize_int8"].backend == "torch" and c["quantize_int8"].fallback
    assert c["rms_norm"].candidates == ("triton", "torch")  # the cpu backend does not serve cuda


def test_bad_names_and_unavailable_backends_are_one_line_errors(monkeypatch):
    with pytest.raises(RuntimeConfigError, match="--kernels must be one of auto, .*got 'fast'"):
        choose("fast", "cpu", torch.float32)
    with pytest.raises(RuntimeConfigError, match="cpu: unavailable on cuda .*runs on cpu, not cuda"):
        choose("cpu", "cuda", torch.float32)
    monkeypatch.setattr(triton_backend, "missing", lambda: "triton is not installed (pip install 'adapt[triton]')")
    with pytest.raises(RuntimeConfigError, match=r"triton is not installed \(pip install 'adapt\[triton\]'\)"):
        choose("triton", "cuda", torch.float32)
    assert choose("auto", "cuda", torch.float32)["rms_norm"].backend == "torch"  # auto goes on without it
    monkeypatch.setattr(triton_backend, "missing", lambda: None)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(RuntimeConfigError, match="TRITON_INTERPRET=1"):
        choose("triton", "cpu", torch.float32)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    with pytest.raises(RuntimeConfigError, match="no bfloat16"):
        choose("triton", "cpu", torch.bfloat16)
    assert choose("auto", "cpu", torch.float32)["rms_norm"].backend == "cpu"  # the interpreter is never auto's


def test_select_kernels_records_each_ops_backend():
    k = select_kernels("torch", "cpu", torch.float32)
    assert k.impl == "torch" and set(k.backends) == set(OPS) and set(k.backends.values()) == {"torch"}
    assert k.rope_cos_sin is not None  # the shared configuration math


def test_plugin_from_an_installed_dist_overrides_two_ops(acme):
    names = [b.name for b in backends()]
    assert "acme" in names and names.index("acme") < names.index("cpu")  # plugins rank first
    c = choose("auto", "cpu", torch.float32)
    assert c["rms_norm"].backend == "acme" and c["silu_and_mul"].backend == "acme"
    assert c["fused_add_rms_norm"].backend == "cpu"  # not overridden: adapt's own
    npu = choose("auto", "npu", torch.bfloat16)  # a device adapt has no kernels for: the plugin, then torch
    assert npu["rms_norm"].backend == "acme" and npu["apply_rope"].backend == "torch" and npu["apply_rope"].fallback
    named = choose("acme", "npu", torch.float32)
    assert named["silu_and_mul"].backend == "acme" and named["varlen_attention"].backend == "torch"
    acme_b = next(b for b in backends() if b.name == "acme")
    assert acme_b.origin == "plugin acme-backend 0.1" and plugin_errors() == []


def test_plugin_runs_in_the_engine(acme):
    from adapt.runtime.engine import Engine
    from adapt.runtime.sampling import SamplingParams

    ref = Engine.from_pretrained("tiny-llama", kernels="torch", kv_cache_memory="4MiB")
    eng = Engine.from_pretrained("tiny-llama", kernels="auto", kv_cache_memory="4MiB")
    before = dict(acme.CALLS)
    sp = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    assert eng.generate([[1, 5, 9]], sp)[0].token_ids == ref.generate([[1, 5, 9]], sp)[0].token_ids
    assert acme.CALLS["rms_norm"] > before["rms_norm"] and acme.CALLS["silu_and_mul"] > before["silu_and_mul"]
    ops = eng.last_stats["kernels"]["ops"]
    assert ops["rms_norm"] == "acme" and ops["silu_and_mul"] == "acme" and ops["fused_add_rms_norm"] == "cpu"


def test_broken_plugins_are_reported_not_raised(monkeypatch):
    from importlib import metadata

    from adapt.runtime.backends import plugins

    bad = metadata.EntryPoint("broken", "no_such_module_33:backend", "adapt.backends")
    monkeypatch.setattr(metadata, "entry_points", lambda group: [bad] if group == "adapt.backends" else [])
    try:
        assert plugins(refresh=True) == []
        assert plugin_errors()[0].startswith("backend plugin broken = no_such_module_33:backend: ModuleNotFoundError")
    finally:
        monkeypatch.undo()
        plugins(refresh=True)


def test_operator_alignment_runs_every_registered_backend_against_its_twin(acme, monkeypatch):
    from types import SimpleNamespace

    from adapt.validate.checks.operators import operator_alignment

    monkeypatch.setenv("TRITON_INTERPRET", "0")  # triton cannot run on CPU then: named with the reason
    out = operator_alignment({"kernels": ["rms_norm", "silu_and_mul", "apply_rope"]}, {}, SimpleNamespace(dtype="float32"))
    assert out.metrics["backend.acme.ops_checked"] == 2 and out.metrics["backend_ops_checked"] >= 2
    assert out.metrics["rms_norm[acme].max_abs"] <= 1e-5 and out.metrics["silu_and_mul[acme].max_abs"] <= 1e-5
    assert "apply_rope[acme].max_abs" not in out.metrics  # not an op it overrides
    if triton_backend.missing() is None:
        assert "triton (Triton runs on CPU tensors only under its interpreter" in out.message
        monkeypatch.setenv("TRITON_INTERPRET", "1")
        out = operator_alignment({"kernels": ["rms_norm", "apply_rope"]}, {}, SimpleNamespace(dtype="float32"))
        assert out.metrics["backend.triton.ops_checked"] == 2 and out.metrics["apply_rope[triton].max_abs"] <= 1e-5


@pytest.mark.skipif(triton_backend.missing() is not None, reason="triton is not installed")
def test_triton_imported_before_the_interpreter_was_on_is_named():
    import subprocess
    import sys

    code = ("import os, torch, triton\n"
            "os.environ['TRITON_INTERPRET'] = '1'\n"
            "from adapt.errors import RuntimeConfigError\n"
            "from adapt.runtime.backends import choose\n"
            "try:\n    choose('triton', 'cpu', torch.float32)\n"
            "except RuntimeConfigError as e:\n    print(e)\n")
    env = {k: v for k, v in __import__("os").environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert "triton was imported before TRITON_INTERPRET=1 was set" in out.stdout, out.stdout + out.stderr
