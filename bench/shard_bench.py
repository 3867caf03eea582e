"""adapt shard throughput and memory on a synthetic >= 2 GB checkpoint, against peers in the same run.

Prints one JSON document: adapt's GB/s (one worker, and the default one per core), `cp` of the same files on
the same disk (with and without `sync`, since adapt fsyncs every file), a load-everything-then-split
baseline, and adapt's peak RSS against the largest tensor; all warm (source in the page cache), then adapt
and `cp + sync` again cold (source pages evicted before each, as for a checkpoint larger than RAM). Also the
sha256 rate (hashlib's and adapt's own, two streams a core at a time where the SHA extensions are): adapt hashes
every source and every output byte, which bounds it on few cores when warm; and,
for a checkpoint as `hf download --local-dir` leaves it (the bench's own has that metadata), adapt trusting
the sha256 the hub client recorded, which halves the hashing.
Goals: adapt >= 0.7 x cp; peak RSS <= 2 x largest tensor + 300 MB.
Usage: python bench/shard_bench.py [--gb 2.2] [--tp 2] [--rounds 2] [--dir /tmp] [--checkpoint DIR (reuse)]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

BASELINE = r'''
import sys, json, time
from pathlib import Path
import torch
from safetensors.torch import load_file, save_file
from adapt.layout import WeightLayout
from adapt.plan import ParallelPlan, rank_tensors
from adapt.spec import ModelSpec
src, out, tp = Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3])
t0 = time.perf_counter()
spec = ModelSpec.from_hf_config(json.loads((src / "config.json").read_text()))
sd = {}
for f in sorted(src.glob("*.safetensors")):
    sd.update(load_file(str(f)))           # the whole model in memory
layout, plan = WeightLayout.from_spec(spec), ParallelPlan.build(spec, tp=tp)
for r in range(plan.world_size):
    part = {}
    for t, s in rank_tensors(layout, plan, r):
        x = sd[t.name]
        part[t.name] = x if s.whole else x.narrow(s.dim, s.start, s.stop - s.start).contiguous()
    (out / f"rank-{r:05d}").mkdir(parents=True)
    save_file(part, str(out / f"rank-{r:05d}" / "model.safetensors"))
print(time.perf_counter() - t0)
'''


def make_checkpoint(d: Path, gb: float) -> tuple[int, int]:
    """A llama-shaped bf16 checkpoint of about `gb` GB in ~500 MB files; returns (bytes, largest tensor)."""
    import torch
    from safetensors.torch import save_file

    from adapt.layout import WeightLayout
    from adapt.spec import ModelSpec

    per_layer = (4 * 4096 * 4096 + 3 * 4096 * 11008) * 2
    layers = max(1, round((gb * 1e9 - 2 * 32000 * 4096 * 2) / per_layer))
    cfg = dict(model_type="llama", hidden_size=4096, intermediate_size=11008, num_hidden_layers=layers,
               num_attention_heads=32, num_key_value_heads=32, vocab_size=32000, torch_dtype="bfloat16")
    (d / "config.json").write_text(json.dumps(cfg))
    layout = WeightLayout.from_spec(ModelSpec.from_hf_config(cfg))
    noise = torch.randn(64 << 20, dtype=torch.bfloat16)  # 128 MB of random bf16, tiled
    files, cur, size, weight_map = [], {}, 0, {}
    for t in list(layout) + [None]:
        if t is None or (size and size + t.nbytes > 500e6):
            name = f"model-{len(files) + 1:05d}.safetensors"
            save_file(cur, str(d / name), metadata={"format": "pt"})
            weight_map.update({k: name for k in cur})
            files.append(name)
            cur, size = {}, 0
            if t is None:
                break
        n = t.numel
        cur[t.name] = noise.repeat(-(-n // noise.numel()))[:n].view(t.shape).clone()
        size += t.nbytes
    (d / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return sum(t.nbytes for t in layout), max(t.nbytes for t in layout)


def run_child(cmd: list[str], **kw) -> tuple[float, int, subprocess.CompletedProcess | None]:
    """(wall seconds, peak RSS bytes of that child alone via wait4, stdout)."""
    t0 = time.perf_counter()
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, **kw)
    out = p.stdout.read()
    _, status, ru = os.wait4(p.pid, 0)
    wall = time.perf_counter() - t0
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"{cmd[:4]} failed with {status}")
    return wall, ru.ru_maxrss * 1024, out


def _sizes(d: Path) -> tuple[int, int]:
    from adapt.shard.header import read_header

    sizes = [v.end - v.begin for f in sorted(d.glob("*.safetensors")) for v in read_header(f).tensors.values()]
    return sum(sizes), max(sizes)


def _meta_dir(d: Path) -> Path:
    return d / ".cache" / "huggingface" / "download"


def write_local_dir_metadata(d: Path) -> None:
    """What `hf download --local-dir` leaves beside a download: commit, etag (= sha256 for LFS), time."""
    import hashlib

    _meta_dir(d).mkdir(parents=True, exist_ok=True)
    for f in sorted(d.glob("*.safetensors")):
        h = hashlib.sha256()
        with open(f, "rb") as fh:
            while chunk := fh.read(1 << 24):
                h.update(chunk)
        (_meta_dir(d) / f"{f.name}.metadata").write_text(f"{'0' * 40}\n{h.hexdigest()}\n{time.time()}\n")


def has_local_dir_metadata(d: Path) -> bool:
    return all((_meta_dir(d) / f"{f.name}.metadata").is_file() for f in d.glob("*.safetensors"))


def drop_cache(d: Path) -> None:
    """Evict a directory's file pages from the page cache (fadvise DONTNEED needs no root once clean)."""
    subprocess.run(["sync"], check=True)
    for f in d.iterdir():
        fd = os.open(f, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def _sha256_rates() -> tuple[float, float]:
    """sha256 GB/s of one core on cache-resident 1 MiB buffers (adapt hashes each chunk right after reading
    it, from the same core's cache): hashlib's, and adapt's own (two streams at a time where the native form
    is in use: adapt.shard.hashing; else hashlib's again)."""
    import hashlib

    from adapt.shard import hashing

    buf = memoryview(bytearray(os.urandom(1 << 20)))
    h, t0 = hashlib.sha256(), time.perf_counter()
    for _ in range(512):
        h.update(buf)
    lib_rate = 512 * len(buf) / (time.perf_counter() - t0) / 1e9
    a, b, batch = hashing.Sha256(), hashing.Sha256(), hashing.Batch()
    t0 = time.perf_counter()
    for _ in range(256):
        batch.add(a, buf)
        batch.add(b, buf)
        batch.flush()
    return lib_rate, 512 * len(buf) / (time.perf_counter() - t0) / 1e9


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gb", type=float, default=2.2)
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--dir", default=None)
    ap.add_argument("--rounds", type=int, default=2, help="each contender's best of this many runs")
    ap.add_argument("--checkpoint", default=None, help="an existing safetensors checkpoint to use")
    ap.add_argument("--make", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.make:
        print(json.dumps(make_checkpoint(Path(a.make), a.gb)))
        return
    if a.dir is not None and not Path(a.dir).is_dir():
        ap.error(f"--dir {a.dir}: no such directory")
    if a.checkpoint is not None and not Path(a.checkpoint).is_dir():
        ap.error(f"--checkpoint {a.checkpoint}: no such directory")
    root = Path(tempfile.mkdtemp(prefix="adapt-shard-bench-", dir=a.dir))
    try:
        if a.checkpoint:
            src = Path(a.checkpoint)
            total, largest = _sizes(src)
        else:
            src = root / "ckpt"
            src.mkdir()
            # built in a child: Linux carries ru_maxrss across fork+exec, so a parent that held the 1 GB of
            # generation buffers would inflate every child's measured peak RSS
            made = subprocess.run([sys.executable, __file__, "--make", str(src), "--gb", str(a.gb)], check=True,
                                  capture_output=True, text=True)
            total, largest = json.loads(made.stdout)
            write_local_dir_metadata(src)
        load_before = os.getloadavg()
        subprocess.run(f"cat {src}/*.safetensors > /dev/null", shell=True, check=True)  # same cache state for all
        subprocess.run(["sync"], check=True)
        res: dict = dict(checkpoint_bytes=total, largest_tensor_bytes=largest, tp=a.tp)

        def adapt_run(key: str, workers: int, cold: bool, hub: bool = False) -> None:
            out = root / f"out-{key}"
            if cold:
                drop_cache(src)
            # --rehash-source: the worst case, a checkpoint whose sha256 nobody recorded, unless `hub`
            wall, rss, so = run_child([sys.executable, "-m", "adapt", "shard", str(src), "--out", str(out), "--tp",
                                       str(a.tp), "--workers", str(workers), "--format", "json"]
                                      + ([] if hub else ["--rehash-source"]))
            s = json.loads(so)
            # removed whether or not this round is the best: a later round would otherwise resume into it and
            # write nothing (with --rounds 3 or more, that round's 0 bytes in 1.6 s)
            shutil.rmtree(out)
            subprocess.run(["sync"], check=True)
            assert s["bytes_written"] == s["bytes_total"], f"{key}: a fresh run wrote {s['bytes_written']} bytes"
            if key in res and res[key]["wall_s"] <= wall:
                return  # best of the rounds
            res[key] = dict(wall_s=round(wall, 3), inner_s=s["seconds"], bytes=s["bytes_written"],
                            workers=s["workers"], gb_per_s=round(s["bytes_written"] / wall / 1e9, 3),
                            peak_rss_bytes=rss, io=s.get("io"))  # O_DIRECT or the page cache, and why

        def cp_run(key: str, cold: bool) -> None:
            if cold:
                drop_cache(src)
            t0 = time.perf_counter()
            subprocess.run(["cp", "-r", str(src), str(root / "cp")], check=True)
            cp_s = time.perf_counter() - t0
            subprocess.run(["sync"], check=True)
            cp_sync_s = time.perf_counter() - t0
            shutil.rmtree(root / "cp")
            subprocess.run(["sync"], check=True)
            if not cold and (key not in res or res[key]["wall_s"] > cp_s):
                res[key] = dict(wall_s=round(cp_s, 3), gb_per_s=round(total / cp_s / 1e9, 3))
            if key + "_sync" not in res or res[key + "_sync"]["wall_s"] > cp_sync_s:
                res[key + "_sync"] = dict(wall_s=round(cp_sync_s, 3), gb_per_s=round(total / cp_sync_s / 1e9, 3))

        # Best of --rounds, the order reversed every other round: on a VM the first writer into memory the
        # guest has not touched yet pays for faulting it in (measured 0.4 vs 4 GB/s page-cache writes here),
        # which would otherwise penalise whichever contender runs first.
        runs = [lambda: adapt_run("adapt_w1", 1, cold=False), lambda: adapt_run("adapt_auto", 0, cold=False),
                lambda: cp_run("cp", cold=False),  # warm: every source page cached, cp only copies memory
                # cold: the source pages evicted before each contender, as for a checkpoint larger than RAM (a
                # trillion-parameter one is 1-2 TB); both include making their output durable
                lambda: cp_run("cp_cold", cold=True), lambda: adapt_run("adapt_auto_cold", 0, cold=True)]
        if has_local_dir_metadata(src):
            # downloaded with `hf download --local-dir`: the hub client recorded every file's sha256, so
            # adapt hashes only its output (the common case for a fresh release)
            runs.append(lambda: adapt_run("adapt_auto_hub_local_dir", 0, cold=False, hub=True))
        for r in range(a.rounds):
            for fn in (runs if r % 2 == 0 else runs[::-1]):
                fn()
                subprocess.run(f"cat {src}/*.safetensors > /dev/null", shell=True, check=True)  # warm again
        drop_cache(src)
        t0 = time.perf_counter()
        subprocess.run(f"cat {src}/*.safetensors > /dev/null", shell=True, check=True)
        res["cold_read_gb_per_s"] = round(total / (time.perf_counter() - t0) / 1e9, 3)
        subprocess.run(f"cat {src}/*.safetensors > /dev/null", shell=True, check=True)  # warm again
        wall, rss, _ = run_child([sys.executable, "-c", BASELINE, str(src), str(root / "naive"), str(a.tp)])
        t0 = time.perf_counter()
        subprocess.run(["sync"], check=True)
        wall_sync = wall + time.perf_counter() - t0
        res["load_all_then_split"] = dict(wall_s=round(wall, 3), wall_with_sync_s=round(wall_sync, 3),
                                          gb_per_s=round(total / wall / 1e9, 3), peak_rss_bytes=rss)
        best = max(res["adapt_w1"]["gb_per_s"], res["adapt_auto"]["gb_per_s"])
        rss1 = max(res[k]["peak_rss_bytes"] for k in ("adapt_w1", "adapt_auto", "adapt_auto_cold"))
        lib_sha, sha = _sha256_rates()
        cores = min(2, os.cpu_count() or 1)
        # adapt must sha256 every source byte and every output byte (the manifest's checksums): with perfect
        # overlap on the cores present, throughput can not exceed this, whatever the disk does
        res["sha256_hashlib_gb_per_s_per_core"] = round(lib_sha, 3)
        res["sha256_adapt_gb_per_s_per_core"] = round(sha, 3)  # as adapt hashes: two streams at a time if native
        res["hash_bound_gb_per_s"] = round(sha * cores / 2, 3)
        res["ratio_vs_cp"] = round(best / res["cp"]["gb_per_s"], 3)
        res["ratio_vs_cp_sync"] = round(best / res["cp_sync"]["gb_per_s"], 3)
        res["ratio_cold_vs_cp_sync_cold"] = round(res["adapt_auto_cold"]["gb_per_s"] /
                                                  res["cp_cold_sync"]["gb_per_s"], 3)
        res["goal_ratio"] = 0.7
        if "adapt_auto_hub_local_dir" in res:
            res["ratio_hub_local_dir_vs_cp_sync"] = round(res["adapt_auto_hub_local_dir"]["gb_per_s"] /
                                                          res["cp_sync"]["gb_per_s"], 3)
        res["ratio_vs_load_all"] = round(best / res["load_all_then_split"]["gb_per_s"], 3)
        res["rss_goal_bytes"] = 2 * largest + 300 * 2**20
        res["rss_ok"] = rss1 <= res["rss_goal_bytes"]
        # the warm goal is reachable at all only if hashing alone, perfectly spread over the cores, beats it
        res["warm_goal_reachable_by_hash_bound"] = res["hash_bound_gb_per_s"] >= 0.7 * res["cp"]["gb_per_s"]
        res["ratio_vs_hash_bound"] = round(best / res["hash_bound_gb_per_s"], 3)
        res["peak_rss_bytes"] = rss1
        res["env"] = dict(python=platform.python_version(), cpus=os.cpu_count(), machine=platform.machine(),
                          loadavg_before=[round(x, 2) for x in load_before],
                          loadavg_after=[round(x, 2) for x in os.getloadavg()])
        print(json.dumps(res, indent=2))
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    main()
