"""One prompt through one parallel layout, from a single process: what ``adapt validate`` compares with one rank.

    run = run_layout("ckpt/", [1, 5, 9], tp=2, max_new_tokens=4)   # LayoutRun(logits [T, V] float32, tokens)
    logits = run_layout_logits("ckpt/", [1, 5, 9], tp=2, ep=2)      # the logits alone

The checkpoint is sharded for the layout into a temporary directory (``adapt.shard.shard``), the ranks
are started by torchrun (``launch``) in a subprocess running this module, rank 0 writes the prefill
logits and greedy tokens to a safetensors file, the caller reads them back and the directory is removed.
An ``adapt shard`` output whose plan is the layout asked runs as it is; one for another layout is
re-sharded from the source checkpoint its manifest records (refused, with the reason, when that source
is gone or changed since). A rank that fails, or ranks that pass ``timeout_s``, raise DistributedError
naming the rank.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import torch

from adapt.errors import CheckpointError, DistributedError

ERROR_PREFIX = "adapt-layout-error: "
MODULE = "adapt.runtime.distributed.layout"  # not __name__: that is __main__ under python -m
DEGREES = ("tp", "pp", "ep", "dp")


@dataclass
class LayoutRun:
    logits: torch.Tensor  # [T, V] float32 prefill logits of the prompt
    tokens: list[int]  # greedy continuation (ignore_eos)
    layout: str  # the plan's label, tp2.pp1.ep1.dp1
    seconds: float  # shard + launch + run, wall clock
    resharded: bool  # False when the target already had this layout


def label(degrees: dict[str, int]) -> str:
    return ".".join(f"{k}{degrees[k]}" for k in DEGREES)


def _manifest(path: Path) -> dict | None:
    p = path / "manifest.json"
    if not p.is_file():
        return None
    try:
        return json.loads(p.read_text())
    except ValueError as e:
        raise CheckpointError(f"{p}: malformed JSON ({e})") from None


def shard_for_layout(path: str | Path, out: Path, degrees: dict[str, int]) -> tuple[Path, bool]:
    """(shard output to run, whether it was written now): ``path`` itself when it is a shard output of
    that layout, else ``path`` (an HF dir) or the source checkpoint recorded in its manifest sharded into
    ``out``. Raises PlanError when the model cannot divide the layout."""
    from adapt.shard import shard

    path = Path(path)
    man = _manifest(path)
    src, dtype = path, "keep"
    if man is not None:
        have = {k: int((man.get("plan") or {}).get("degrees", {}).get(k, 1)) for k in DEGREES}
        if have == degrees:
            return path, False
        src = Path((man.get("source") or {}).get("dir", ""))
        dtype = str(man.get("dtype", "keep"))
        why = _source_problem(src, man)
        if why:
            raise CheckpointError(f"{path} is sharded for {label(have)}; running {label(degrees)} needs a re-shard "
                                  f"from the source checkpoint its manifest records, but {why}; shard the "
                                  f"checkpoint for that layout (adapt shard CKPT --out OUT ...) and run that output")
    shard(src, out, tp=degrees["tp"], pp=degrees["pp"], ep=degrees["ep"], dp=degrees["dp"], dtype=dtype)
    return out, True


def _source_problem(src: Path, man: dict) -> str:
    """Why the manifest's source cannot be re-sharded ('' when it can): missing, or files of other sizes."""
    if not str(src) or not (src / "config.json").is_file():
        return f"{src or 'no source directory'} is not present here"
    for f in (man.get("source") or {}).get("files", []):
        p = src / f["name"]
        if not p.is_file() or p.stat().st_size != int(f["size"]):
            return f"{p} is missing or changed since it was sharded"
    return ""


def run_layout(path: str | Path, prompt_ids: Sequence[int], *, device: str = "cpu", dtype: str = "float32",
               tp: int = 1, pp: int = 1, ep: int = 1, dp: int = 1, max_new_tokens: int = 4,
               timeout_s: float = 180.0, kv_cache_memory: str | int = "64MiB") -> LayoutRun:
    """Prefill logits and greedy tokens of ``prompt_ids`` on the layout's ranks (see the module docstring)."""
    t0 = time.perf_counter()
    degrees = dict(tp=int(tp), pp=int(pp), ep=int(ep), dp=int(dp))
    world = degrees["tp"] * degrees["pp"] * degrees["dp"]
    tmp = Path(tempfile.mkdtemp(prefix="adapt-layout-"))
    try:
        shard_dir, resharded = shard_for_layout(path, tmp / "shard", degrees)
        req = dict(prompt=[int(t) for t in prompt_ids], max_new_tokens=int(max_new_tokens), device=device,
                   dtype=dtype, kv_cache_memory=kv_cache_memory, dist_timeout=max(10.0, timeout_s / 2),
                   out=str(tmp / "result.safetensors"))
        (tmp / "request.json").write_text(json.dumps(req))
        cmd = [sys.executable, "-m", MODULE, str(shard_dir), str(tmp / "request.json"), str(world)]
        env = dict(os.environ, OMP_NUM_THREADS="1")
        try:
            p = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout_s)
        except subprocess.TimeoutExpired:
            raise DistributedError(f"layout {label(degrees)}: the {world} ranks did not finish within "
                                   f"{timeout_s:g} s") from None
        if p.returncode != 0:
            raise DistributedError(f"layout {label(degrees)}: {_failure(p.stderr, p.returncode)}")
        from safetensors.torch import load_file

        got = load_file(str(tmp / "result.safetensors"))
        return LayoutRun(got["logits"], [int(t) for t in got["tokens"].tolist()], label(degrees),
                         time.perf_counter() - t0, resharded)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def run_layout_logits(path: str | Path, prompt_ids: Sequence[int], *, device: str = "cpu", dtype: str = "float32",
                      tp: int = 1, pp: int = 1, ep: int = 1, dp: int = 1, timeout_s: float = 180.0) -> torch.Tensor:
    """Prefill logits [T, V] float32 of ``prompt_ids`` on the layout (``run_layout`` without decoding)."""
    return run_layout(path, prompt_ids, device=device, dtype=dtype, tp=tp, pp=pp, ep=ep, dp=dp, max_new_tokens=0,
                      timeout_s=timeout_s).logits


def _failure(stderr: str, rc: int) -> str:
    lines = [ln for ln in stderr.splitlines() if ln.startswith(ERROR_PREFIX)]
    if lines:
        return lines[-1][len(ERROR_PREFIX):]
    ranks = [ln for ln in stderr.splitlines() if ln.startswith("rank ")]
    tail = ranks[-1] if ranks else (stderr.strip().splitlines() or [f"exit code {rc}"])[-1]
    return f"the launcher exited with code {rc}: {tail}"


# -- inside the subprocess -----------------------------------------------------------------------------

def _rank(shard_dir: str, req: dict) -> None:
    from safetensors.torch import save_file

    from adapt.runtime.sampling import SamplingParams

    from .generate import generate, open_distributed

    torch.set_num_threads(1)
    eng, ctx = open_distributed(shard_dir, req["device"], req["dtype"], timeout_s=req["dist_timeout"],
                                kv_cache_memory=req["kv_cache_memory"])
    ids = req["prompt"]
    logits = eng.prefill_logits(ids).float().cpu()
    tokens: list[int] = []
    if req["max_new_tokens"] > 0:
        res = generate(eng, ctx, [ids], SamplingParams(temperature=0.0, max_tokens=req["max_new_tokens"],
                                                       ignore_eos=True))
        tokens = list(res[0].token_ids) if res is not None else []
    if ctx.is_driver:
        save_file({"logits": logits.contiguous(), "tokens": torch.tensor(tokens, dtype=torch.int64)}, req["out"])
    ctx.barrier()
    # Every rank is past the barrier and rank 0's file is written. Tearing the gloo groups down (or
    # letting interpreter exit destroy them) intermittently aborts a rank with "terminate called without
    # an active exception" on this 2-core machine, turning a finished run into a failure; leave at once.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def main(argv: Sequence[str]) -> int:
    shard_dir, req_path, nproc = argv[0], argv[1], int(argv[2])
    from .faults import rank_guard
    from .launch import in_launcher, launch

    if in_launcher():
        with rank_guard():
            _rank(shard_dir, json.loads(Path(req_path).read_text()))
        return 0
    try:
        return launch([shard_dir, req_path, str(nproc)], nproc, ["--standalone"], module=MODULE)
    except DistributedError as e:
        print(ERROR_PREFIX + str(e), file=sys.stderr, flush=True)
        return 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
