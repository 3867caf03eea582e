"""``shard()``: validate, plan, then stream every rank's files; resume what a killed run left.

Order of a run: read the config, the plan and every source header; check the checkpoint against the
layout (nothing is written if it does not match); plan all output files; mark OUT as ours and remove
an old manifest (un-commit); keep files a journal or old manifest vouches for and that still hash the
same; write the rest (atomically, ``--workers`` units at once within a memory budget: a unit is one source
file and the files it feeds, see :mod:`adapt.shard.fanout`); copy config and tokenizer files; write
``manifest.json`` last.
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable

from adapt.errors import PlanError, ShardError
from adapt.layout import WeightLayout
from adapt.plan import ParallelPlan
from adapt.shard.checkpoint import Checkpoint, check_against_layout, open_checkpoint
from adapt.shard.manifest import MANIFEST, Manifest, OutputFile, load_manifest
from adapt.shard.fanout import Unit, run_unit
from adapt.shard.iomode import direct_io, env_mode
from adapt.shard.planner import DEFAULT_MAX_FILE_SIZE, plan_outputs
from adapt.shard.transform import DTYPE_CHOICES, Quantize, activations_of, target_dtype
from adapt.shard.source_hash import hashed_digest, recorded_digest
from adapt.shard import hashing
from adapt.shard.writer import AtomicFile, remove_stale_tmp, write_bytes
from adapt.spec import ModelSpec
from adapt.source import read_config

MARKER = ".adapt-shard.json"
JOURNAL = ".adapt-shard.journal"
COPY_FILES = ("generation_config.json", "tokenizer.json", "tokenizer_config.json", "tokenizer.model",
              "special_tokens_map.json", "vocab.json", "merges.txt", "added_tokens.json", "chat_template.jinja",
              "chat_template.json", "preprocessor_config.json", "tiktoken.model")
DEFAULT_BUDGET = 4 << 30


@dataclass(frozen=True)
class ShardResult:
    out_dir: Path
    manifest: Manifest
    files_written: int
    files_kept: int
    bytes_written: int
    bytes_total: int
    seconds: float
    workers: int = 1
    io: str = ""  # how large files reached the device, and why (iomode.direct_io)
    hash: str = ""  # which sha256 hashed them (hashing.status)

    def to_dict(self) -> dict:
        gbps = self.bytes_written / self.seconds / 1e9 if self.seconds > 0 else 0.0
        return dict(out=str(self.out_dir), plan=self.manifest.plan["degrees"], world_size=self.manifest.world_size,
                    files=len(self.manifest.files), files_written=self.files_written, files_kept=self.files_kept,
                    bytes_written=self.bytes_written, bytes_total=self.bytes_total, seconds=round(self.seconds, 3),
                    gb_per_s=round(gbps, 3), dtype=self.manifest.dtype, workers=self.workers, io=self.io,
                    hash=self.hash)


class Budget:
    """Bytes of tensor slices in flight across workers; a request larger than the budget runs alone."""

    def __init__(self, total: int):
        self.total, self.used = max(1, total), 0
        self.cv = threading.Condition()

    def acquire(self, n: int) -> int:
        n = min(max(n, 1), self.total)
        with self.cv:
            while self.used + n > self.total:
                self.cv.wait()
            self.used += n
        return n

    def release(self, n: int) -> None:
        with self.cv:
            self.used -= n
            self.cv.notify_all()


def load_plan_file(path: Path, spec: ModelSpec) -> ParallelPlan:
    """plan.yaml -> ParallelPlan (adapt.plan's loader when it has one)."""
    import adapt.plan as plan_mod

    loader = getattr(plan_mod, "load_plan", None)
    if loader is not None:
        return loader(path, spec)
    import yaml

    try:
        d = yaml.safe_load(Path(path).read_text())
    except OSError as e:
        raise PlanError(f"cannot read {path}: {e.strerror}") from e
    except yaml.YAMLError as e:
        raise PlanError(f"{path}: malformed YAML ({str(e).splitlines()[0]})") from e
    return ParallelPlan.from_dict(d, spec, source=str(path))


def output_config(cfg: dict, dtype_choice: str, quantize: Quantize | None = None) -> dict:
    """The config written beside the shards: dequantized outputs drop quantization_config; quantized ones
    (``--quantize``) carry theirs."""
    target = target_dtype(dtype_choice)
    if quantize is not None:
        cfg = dict(cfg, quantization_config=quantize.config)
        if quantize.lm_head and cfg.get("tie_word_embeddings"):
            cfg["tie_word_embeddings"] = False  # lm_head.weight is written (quantized); the embedding stays
    if target is None:
        return cfg
    out = {k: v for k, v in cfg.items() if k != "quantization_config" or quantize is not None}
    for key in ("torch_dtype", "dtype"):
        if key in out or key == "torch_dtype":
            out[key] = target
    return out


def _check_out_dir(out: Path, force: bool) -> None:
    if out.exists() and not out.is_dir():
        raise ShardError(f"--out {out} exists and is not a directory")
    if not out.is_dir() or (out / MARKER).exists() or (out / MANIFEST).exists() or not any(out.iterdir()):
        return
    if not force:
        raise ShardError(f"--out {out} exists and is not an adapt shard output; pass --force to write into it")


MAX_FANOUT = 16  # output ranks one unit writes at once (open files); a larger world splits into rank groups


def usable_cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def auto_workers(n_units: int) -> int:
    """``--workers 0``: one unit at a time per usable core (each both hashes and copies), never more than there
    are units nor more than 8 (a bound on threads and their chunk buffers; more needs an explicit --workers)."""
    return max(1, min(usable_cores(), n_units, 8))


def plan_units(ckpt: Checkpoint, files: list[OutputFile], world: int, workers: int, rehash: set[str]) -> list[Unit]:
    """Units of work, largest first: each source file with the output files of a group of ranks that draw
    from it; the first group's unit also hashes the source when ``rehash`` names it.

    A source file is one unit (read once for all its ranks) unless: there are fewer files than workers (its
    ranks split so every worker has a unit); it is among the ``workers`` smallest files, which run last (split
    in two or more, so the workers finish together: a 2.1 GB tp=2 run of 5 files left one core idle for 15%
    of the run unsplit); or it feeds more than MAX_FANOUT ranks (open files). A split costs re-reading the
    ranks' part of the file, and whole rows for a row-parallel slice."""
    by_src: dict[str, list[OutputFile]] = {src: [] for src in ckpt.files}
    for f in files:
        by_src[f.tensors[0].source_file].append(f)
    size = {src: ckpt.sizes.get(src) or sum(f.nbytes for f in by_src[src]) for src in ckpt.files}
    base = max(-(-world // MAX_FANOUT), min(world, -(-workers // max(1, len(ckpt.files)))))
    tail = set(sorted(ckpt.files, key=lambda src: (-size[src], src))[-workers:]) if workers > 1 else set()
    units = []
    for src in ckpt.files:
        groups = min(world, max(base, 2)) if src in tail else base
        hash_it = src in rehash
        for g in range(groups):
            part = [f for f in by_src[src] if f.rank * groups // world == g]
            if part or hash_it:
                units.append(Unit(src, part, hash_it, sum(f.nbytes for f in part) + (size[src] if hash_it else 0)))
                hash_it = False
    return sorted(units, key=lambda u: -u.cost)


def _fingerprint(files: list[OutputFile], sources: list[dict]) -> str:
    body = json.dumps([[f.to_json() for f in files], sources], sort_keys=True).encode()
    return hashlib.sha256(body).hexdigest()


def _read_journal(out: Path) -> tuple[dict[str, dict], dict[str, dict]]:
    files, sources = {}, {}
    try:
        lines = (out / JOURNAL).read_text().splitlines()
    except OSError:
        return files, sources
    for line in lines:
        try:
            e = json.loads(line)
        except json.JSONDecodeError:
            continue  # a line cut by a crash
        (sources if "source" in e else files)[e.get("source") or e.get("path")] = e
    return files, sources


class _Journal:
    def __init__(self, out: Path):
        self.f = open(out / JOURNAL, "a")
        self.lock = threading.Lock()

    def add(self, entry: dict, sync: bool = True) -> None:
        """Append ``entry``; with ``sync``, durable before this returns (an fsync, which on ext4 waits for the
        data of every file written since the last journal commit: 0.9 s on a 0.4 GB/s disk)."""
        with self.lock:
            self.f.write(json.dumps(entry) + "\n")
            self.f.flush()
            if sync:
                os.fsync(self.f.fileno())


def shard(checkpoint: str | Path, out_dir: str | Path, plan: ParallelPlan | None = None, *, tp: int = 1,
          pp: int = 1, ep: int = 1, dp: int = 1, plan_file: str | Path | None = None, dtype: str = "keep",
          max_file_size: int = DEFAULT_MAX_FILE_SIZE, workers: int = 0, memory_budget: int = DEFAULT_BUDGET,
          force: bool = False, allow_pickle: bool = False, trust_hub_cache: bool = True,
          progress: Callable[[int, int], None] | None = None, quantize: str | None = None,
          group_size: int = 128, quantize_lm_head: bool = False, activations: str | None = None) -> ShardResult:
    """Shard a checkpoint directory into ``out_dir`` per the plan. ``progress(delta_bytes, total_bytes)``.
    ``quantize``: int8 | int4 | fp8, round-to-nearest (transform.Quantize; int4 in groups of ``group_size``);
    ``quantize_lm_head``: lm_head too (a tied head is untied, see Quantize); ``activations="int8"``: the output
    declares int8 per-token input activations (W8A8 / W4A8)."""
    t0 = time.perf_counter()
    src_dir, out = Path(checkpoint), Path(out_dir)
    if dtype not in DTYPE_CHOICES:
        raise ShardError(f"--dtype must be one of {', '.join(DTYPE_CHOICES)}; got {dtype!r}")
    if workers < 0:
        raise ShardError(f"--workers must be 0 (auto) or more, got {workers}")
    env_mode()  # a bad ADAPT_SHARD_DIRECT or ADAPT_SHARD_SHA is an error before OUT is touched
    hashing.native()  # and the native sha256 is built (once per host) or its absence stated
    cfg = read_config(Path(src_dir) / "config.json")
    spec = ModelSpec.from_hf_config(cfg, name=src_dir.name)
    if quantize_lm_head and not quantize:
        raise ShardError("--quantize-lm-head needs --quantize int8 or int4")
    if activations_of(activations) and not quantize:
        raise ShardError("--activations int8 needs --quantize int8 or int4")
    quant = Quantize.make(quantize, group_size, quantize_lm_head, activations) if quantize else None
    layout = WeightLayout.from_spec(spec)  # a stored format the layout cannot hold is refused here
    if spec.quant is not None and spec.quant.method != "fp8" and (dtype != "keep" or quant is not None):
        raise ShardError(f"{src_dir}: adapt shard slices {spec.quant.method} ({spec.quant.fmt}) checkpoints as stored "
                         f"(--dtype keep, no --quantize); got --dtype {dtype}"
                         + (f" --quantize {quantize}" if quant is not None else "") + "; adapt run reads them directly")
    if plan is None:
        plan = load_plan_file(Path(plan_file), spec) if plan_file else ParallelPlan.build(spec, tp, pp, ep, dp)
    import adapt.plan as plan_mod

    if hasattr(plan_mod, "coverage"):
        plan_mod.coverage(layout, plan)
    ckpt, _ = open_checkpoint(src_dir, allow_pickle)
    names = check_against_layout(ckpt, layout)
    out_layout = layout  # what the output holds: a tied head quantized is untied (lm_head.weight written)
    if quant is not None and quant.lm_head and spec.tie_word_embeddings:
        out_layout = WeightLayout.from_spec(replace(spec, tie_word_embeddings=False))
    files = plan_outputs(ckpt, out_layout, plan, names, dtype, max_file_size, quant)
    block = spec.quant.block_size if spec.quant else None
    src_stat = {f: (src_dir / f).stat() for f in ckpt.files}
    sources = [dict(name=f, size=s.st_size) for f, s in src_stat.items()]
    fp = _fingerprint(files, sources)

    if out.resolve() == src_dir.resolve():
        raise ShardError(f"--out {out} is the checkpoint directory itself")
    _check_out_dir(out, force)
    out.mkdir(parents=True, exist_ok=True)
    known, known_src = {}, {}
    try:
        marker = json.loads((out / MARKER).read_text())
    except (OSError, json.JSONDecodeError):
        marker = {}
    if marker.get("fingerprint") == fp:
        known, known_src = _read_journal(out)
        try:
            old = load_manifest(out)
            known.update({f.path: dict(path=f.path, size=f.size, sha256=f.sha256) for f in old.files})
            known_src.update({s["name"]: dict(s, source=s["name"]) for s in old.source_files})
        except ShardError:
            pass
    if (out / MANIFEST).exists():
        (out / MANIFEST).unlink()  # un-commit before anything changes
    if marker.get("fingerprint") != fp:
        (out / JOURNAL).unlink(missing_ok=True)
        write_bytes(out / MARKER, json.dumps(dict(adapt_shard=1, fingerprint=fp)).encode())
    rank_dirs = sorted({out / f.path.split("/")[0] for f in files})
    remove_stale_tmp(rank_dirs + [out])
    planned = {f.path for f in files}
    for d in out.glob("rank-*"):
        for p in d.glob("*.safetensors"):
            if f"{d.name}/{p.name}" not in planned:
                p.unlink()  # left by an earlier run with another plan

    journal = _Journal(out)
    total = sum(f.nbytes for f in files)
    tick = progress or (lambda n, t: None)
    tick(0, total)
    budget = Budget(memory_budget)
    sleep = float(os.environ.get("ADAPT_SHARD_TEST_SLEEP", "0") or 0)  # test hook: widen the kill window
    done: dict[str, OutputFile] = {}
    written = [0, 0]  # files, bytes
    lock = threading.Lock()

    src_entries = {}
    for name in ckpt.files:
        d = recorded_digest(src_dir / name, src_stat[name], known_src.get(name), trust_hub_cache)
        if d is not None:
            src_entries[name] = dict(name=name, **d)
    # outputs a journal or an old manifest vouches for are kept if they are there, of their size, and hash the same
    vouched = [f for f in files if f.path in known and (out / f.path).is_file()
               and (out / f.path).stat().st_size == known[f.path]["size"]]
    for f, got in zip(vouched, hashing.sha256_files([out / f.path for f in vouched], workers or usable_cores())):
        if got == known[f.path]["sha256"]:
            done[f.path] = replace(f, size=known[f.path]["size"], sha256=got)
            tick(f.nbytes, total)
    direct, io = direct_io(out, max((f.nbytes for f in files if f.path not in done), default=0))
    units = plan_units(ckpt, files, plan.world_size, workers or auto_workers(1 << 30),
                       set(ckpt.files) - set(src_entries))
    for u in units:
        u.kept = {f.path for f in u.files if f.path in done}
    workers = min(workers, len(units)) if workers else auto_workers(len(units))

    def on_file(f: OutputFile, size: int, sha: str) -> None:
        journal.add(dict(path=f.path, size=size, sha256=sha))
        with lock:
            done[f.path] = replace(f, size=size, sha256=sha)
            written[0] += 1
            written[1] += f.nbytes

    def work(u: Unit) -> None:
        digest = run_unit(ckpt, u, out, block=block, overlap=workers < usable_cores(), acquire=budget.acquire,
                          release=budget.release, on_bytes=lambda n: tick(n, total), on_file=on_file, sleep=sleep,
                          direct=direct, commits=commits)
        if digest is not None:
            entry = dict(name=u.source_file, **hashed_digest(src_stat[u.source_file], digest))
            # no fsync on the worker: a source hash only spares a resume the hashing, and the next file's commit
            # (or the manifest) makes it durable
            journal.add(dict(entry, source=u.source_file), sync=False)
            with lock:
                src_entries[u.source_file] = entry

    commits: list = []  # the files' commits, which run on while the workers go on to their next units
    try:
        try:
            with ThreadPoolExecutor(max_workers=workers) as pool:
                for fut in [pool.submit(work, u) for u in units]:
                    fut.result()
        finally:
            errors = [e for e in (fut.exception() for fut in commits) if e is not None]  # waits for each
        if errors:
            raise errors[0]
    finally:
        journal.f.close()
        ckpt.close()
    src_entries = [src_entries[name] for name in ckpt.files]
    extra = _copy_side_files(src_dir, out, cfg, dtype, quant)
    manifest = Manifest(spec.name, spec.model_type, plan.to_dict(), dtype, max_file_size, str(src_dir.resolve()),
                        cfg, tuple(src_entries), tuple(done[f.path] for f in files), tuple(extra), block)
    with AtomicFile(out / MANIFEST) as mf:  # the commit point
        mf.write(manifest.to_json().encode())
    (out / JOURNAL).unlink(missing_ok=True)
    return ShardResult(out, manifest, written[0], len(files) - written[0], written[1], total,
                       time.perf_counter() - t0, workers, io, hashing.status())


def _copy_side_files(src: Path, out: Path, cfg: dict, dtype: str, quant: Quantize | None = None) -> list[dict]:
    """config.json (rewritten for the output dtype) and tokenizer files, beside the rank directories."""
    entries = []
    size, sha = write_bytes(out / "config.json", (json.dumps(output_config(cfg, dtype, quant), indent=2) + "\n").encode())
    entries.append(dict(path="config.json", size=size, sha256=sha))
    for name in COPY_FILES:
        p = src / name
        if p.is_file() and not p.is_symlink() or (p.is_symlink() and p.resolve().is_file()):
            size, sha = write_bytes(out / name, p.read_bytes())
            entries.append(dict(path=name, size=size, sha256=sha))
    for p in sorted(src.glob("tokenization*.py")):  # a tiktoken tokenizer's pattern lives there (Kimi-K2)
        if p.is_file():
            size, sha = write_bytes(out / p.name, p.read_bytes())
            entries.append(dict(path=p.name, size=size, sha256=sha))
    return entries
