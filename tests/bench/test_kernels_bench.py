"""bench/kernels_bench.py: its --interpret-smoke mode runs every case's paths (Triton under TRITON_INTERPRET=1,
the torch forms, SDPA) on tiny float32 shapes on CPU and checks their outputs against the torch forms; without
CUDA the timed mode says so in one line and exits 0; the peak-bandwidth table picks the specific name first."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "kernels_bench.py"


def _run(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    env.pop("TRITON_INTERPRET", None)  # the script sets it itself for the smoke mode
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, env=env, timeout=300)


def _module():
    spec = importlib.util.spec_from_file_location("kernels_bench", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_interpret_smoke_runs_every_case_and_matches_the_torch_forms():
    pytest.importorskip("triton", reason="triton is not installed: the bench's Triton paths cannot run")
    p = _run("--interpret-smoke")
    assert p.returncode == 0, p.stderr[-2000:]
    r = json.loads(p.stdout)
    assert r["interpreted"] and r["dtype"] == "float32"
    names = [c["case"] for c in r["cases"]]
    for kind in ("decode_attention", "mla_decode", "moe_layer"):
        assert sum(n.startswith(kind) for n in names) == 2, names
    for c in r["cases"]:
        peers = {"torch", "sdpa"} if not c["case"].startswith("moe") else {"torch"}
        assert set(c["ms"]) == {"triton"} | peers
        assert set(c["triton_speedup"]) == {f"vs_{k}" for k in peers}
        assert all(v <= 1e-4 for v in c["max_diff_vs_torch"].values()), c
        assert c["bytes_read"] > 0
    # one table line per case on stderr
    assert sum(line.split()[0] in ("decode_attention", "mla_decode", "moe_layer")
               for line in p.stderr.splitlines() if line.strip()) == len(names)


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is present: the bench would time it")
def test_without_cuda_one_line_and_exit_0():
    p = _run()
    assert p.returncode == 0
    assert p.stdout == ""
    assert len(p.stderr.strip().splitlines()) == 1 and "no CUDA device" in p.stderr


def test_bad_cases_one_line_nonzero():
    p = _run("--cases", "decode,flash")
    assert p.returncode == 2 and "flash" in p.stderr and "Traceback" not in p.stderr


def test_peak_bandwidth_by_device_name():
    peak = _module().peak_gbps
    assert peak("NVIDIA H100 80GB HBM3") == 3350
    assert peak("NVIDIA H100 PCIe") == 2000
    assert peak("NVIDIA H200") == 4800
    assert peak("NVIDIA A100-SXM4-80GB") == 2039
    assert peak("NVIDIA A100-SXM4-40GB") == 1555
    assert peak("Some New Accelerator") is None
