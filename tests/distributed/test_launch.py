"""`adapt run --nproc N` through torchrun: output on rank 0, faults end every rank with the rank named."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time

import pytest

from adapt.runtime.distributed.launch import strip_launcher_flags, torchrun_argv

ARGS = ["--prompt-ids", "1,5,9,33", "--prompt-ids", "1,7", "--temperature", "0"]


def test_torchrun_argv():
    argv = ["run", "OUT", "--nproc", "2", "--nnodes=2", "-n", "4"]
    rest, launcher = strip_launcher_flags(argv)
    assert rest == ["run", "OUT", "-n", "4"] and launcher == ["--nnodes", "2"]
    assert torchrun_argv(argv, 2) == ["--nproc-per-node", "2", "--nnodes", "2", "-m", "adapt", "run", "OUT", "-n", "4"]


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    from adapt.runtime.init_model import init_model
    from adapt.shard.run import shard

    root = tmp_path_factory.mktemp("launch")
    ckpt = init_model("tiny-llama", root / "llama")
    shard(ckpt, root / "tp2", tp=2)
    return root


def _adapt(*args, env=None, timeout=120):
    e = dict(os.environ, OMP_NUM_THREADS="1", **(env or {}))
    t = time.monotonic()
    p = subprocess.run([sys.executable, "-m", "adapt", *args], capture_output=True, text=True, env=e, timeout=timeout)
    return p, time.monotonic() - t


def test_nproc_matches_one_rank(shards):
    one, _ = _adapt("run", str(shards / "llama"), *ARGS, "-n", "5", "--ignore-eos", "--format", "json")
    two, _ = _adapt("run", str(shards / "tp2"), *ARGS, "-n", "5", "--ignore-eos", "--format", "json", "--nproc", "2",
                    "--collective-stats")
    assert one.returncode == 0 and two.returncode == 0, two.stderr[-2000:]
    a, b = json.loads(one.stdout), json.loads(two.stdout)  # stdout is rank 0's JSON alone
    assert [o["token_ids"] for o in a["outputs"]] == [o["token_ids"] for o in b["outputs"]]
    col = b["stats"]["collectives"]
    assert col["plan"] == "tp2.pp1.ep1.dp1" and len(col["ranks"]) == 2
    assert all(abs(r["planner"]["ratio"]["total"] - 1) <= 0.10 for r in col["ranks"])


@pytest.mark.parametrize("how", ["kill", "raise"])
def test_failed_rank_ends_every_rank(shards, how):
    p, dt = _adapt("run", str(shards / "tp2"), *ARGS, "-n", "400", "--ignore-eos", "--nproc", "2",
                   "--dist-timeout", "30", env={"ADAPT_INJECT_FAULT": f"1:4:{how}"})
    assert p.returncode != 0 and dt < 60
    want = "rank 1: killed by SIGKILL" if how == "kill" else "rank 1: RuntimeError: injected fault at step 4"
    assert want in p.stderr, p.stderr[-2000:]


def test_missing_shard_names_rank(shards, tmp_path):
    out = tmp_path / "tp2"
    shutil.copytree(shards / "tp2", out)
    shutil.rmtree(out / "rank-00001")
    p, dt = _adapt("run", str(out), *ARGS, "-n", "2", "--nproc", "2", "--dist-timeout", "30")
    assert p.returncode != 0 and dt < 60
    assert "rank 1:" in p.stderr and "rank-00001" in p.stderr, p.stderr[-2000:]
