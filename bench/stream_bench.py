"""The layer-streamed reference dump on a ~1.5 GB float32 DeepSeek-V3-shaped MoE checkpoint, against reading its
bytes once in the same run.

Prints one JSON document: the checkpoint's weight bytes; the peer, every safetensors file read once with pread
into one buffer (warm: the files were just written and read once untimed, so both sides read the page cache);
`adapt validate dump --stream` in a fresh process, its wall time and its own time (golden.json's
``streamed.seconds``: the passes, without the interpreter's start), the bytes it read, and its peak RSS beside the
baseline RSS it measured at its start. Two dumps: ``short`` (one 8-token prompt, 4 greedy tokens: the memory
figure, few experts touched) and ``default`` (the 4 default prompts, 16 greedy tokens: the time figure).
Then both again cold (pages evicted before each with posix_fadvise DONTNEED), as for a model larger than RAM.
Goals (issue 34): peak RSS - baseline < 40% of the weight bytes (short); default dump within 3x of the read.
Usage: python bench/stream_bench.py [--dir /tmp] [--checkpoint DIR (reuse)] [--experts 128] [--layers 8]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def make_checkpoint(d: Path, layers: int = 8, experts: int = 128, hidden: int = 512, inter: int = 256,
                    seed: int = 0) -> int:
    """A float32 DeepSeek-V3-layout checkpoint (config by transformers, weights from the WeightLayout, one file
    per layer); returns its weight bytes."""
    import torch
    import transformers
    from safetensors.torch import save_file

    from adapt.layout import WeightLayout
    from adapt.spec import ModelSpec

    d.mkdir(parents=True, exist_ok=True)
    cfg = transformers.AutoConfig.for_model(
        "deepseek_v3", hidden_size=hidden, intermediate_size=2 * hidden, moe_intermediate_size=inter,
        num_hidden_layers=layers, num_attention_heads=8, num_key_value_heads=8, q_lora_rank=128, kv_lora_rank=64,
        qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32, n_routed_experts=experts, n_shared_experts=1,
        num_experts_per_tok=2, n_group=8, topk_group=4, first_k_dense_replace=1, routed_scaling_factor=2.5,
        norm_topk_prob=True, vocab_size=1024, max_position_embeddings=512, num_nextn_predict_layers=0,
        rope_scaling=None, dtype="float32")
    cfg.save_pretrained(d)
    spec = ModelSpec.from_hf_config(json.loads((d / "config.json").read_text()))
    layout = WeightLayout.from_spec(spec)
    g = torch.Generator().manual_seed(seed)
    groups: dict[str, dict] = {}
    for t in layout.main():
        if t.role in ("norm", "q_a_norm", "kv_a_norm"):
            x = torch.rand(t.shape, generator=g) * 0.4 + 0.8
        elif t.role == "router_bias":
            x = torch.randn(t.shape, generator=g) * 0.1
        else:
            x = torch.randn(t.shape, generator=g) * 0.02
        f = f"layer-{t.layer:03d}.safetensors" if t.layer is not None else "other.safetensors"
        groups.setdefault(f, {})[t.name] = x
    weight_map = {}
    total = 0
    for f, ts in groups.items():
        save_file(ts, str(d / f), metadata={"format": "pt"})
        weight_map.update({n: f for n in ts})
        total += sum(x.numel() * 4 for x in ts.values())
    (d / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": total},
                                                                 "weight_map": weight_map}))
    return total


def evict(d: Path) -> None:
    """Ask the kernel to drop d's safetensors pages from the page cache (cold reads, as for a model larger than RAM)."""
    for f in d.glob("*.safetensors"):
        fd = os.open(f, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def read_once(d: Path) -> float:
    """Seconds to pread every safetensors file of d into one reused 64 MB buffer."""
    buf = bytearray(64 << 20)
    view = memoryview(buf)
    t0 = time.perf_counter()
    for f in sorted(d.glob("*.safetensors")):
        fd = os.open(f, os.O_RDONLY)
        try:
            off = 0
            while True:
                n = os.preadv(fd, [view], off)
                if n <= 0:
                    break
                off += n
        finally:
            os.close(fd)
    return time.perf_counter() - t0


def dump(ckpt: Path, out: Path, *args: str) -> dict:
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-m", "adapt", "validate", "dump", str(ckpt), "--out", str(out), "--stream",
                    *args], check=True, stdout=subprocess.DEVNULL)
    wall = time.perf_counter() - t0
    st = json.loads((out / "golden.json").read_text())["streamed"]
    return {"wall_s": round(wall, 3), "dump_s": st["seconds"], "bytes_read": st["bytes_read"],
            "passes": st["passes"], "peak_rss_bytes": st["rss"]["peak_bytes"],
            "baseline_rss_bytes": st["rss"]["baseline_bytes"], "peak_weight_bytes": st["peak_weight_bytes"],
            "experts_touched_max": max((len(v) for v in st["experts_per_layer"].values()), default=0)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", default=None)
    ap.add_argument("--checkpoint", default=None)
    ap.add_argument("--experts", type=int, default=128)
    ap.add_argument("--layers", type=int, default=8)
    a = ap.parse_args()
    with tempfile.TemporaryDirectory(dir=a.dir) as tmp:
        tmp = Path(tmp)
        ckpt = Path(a.checkpoint) if a.checkpoint else tmp / "ckpt"
        if a.checkpoint:
            weights = sum(f.stat().st_size for f in ckpt.glob("*.safetensors"))
        else:
            weights = make_checkpoint(ckpt, a.layers, a.experts)
        read_once(ckpt)  # warm: both sides read the page cache
        peer = min(read_once(ckpt) for _ in range(3))
        short = dump(ckpt, tmp / "g-short", "--prompt-lengths", "8", "--max-new-tokens", "4")
        default = dump(ckpt, tmp / "g-default")
        evict(ckpt)
        cold_peer = read_once(ckpt)
        evict(ckpt)
        cold = dump(ckpt, tmp / "g-cold")
        import torch
        import transformers

        print(json.dumps({
            "weight_bytes": weights, "read_once_s": round(peer, 3), "read_once_gb_s": round(weights / peer / 1e9, 2),
            "short": short | {"rss_over_baseline_fraction_of_weights":
                              round((short["peak_rss_bytes"] - short["baseline_rss_bytes"]) / weights, 4)},
            "default": default | {"dump_over_read_once": round(default["dump_s"] / peer, 2),
                                  "wall_over_read_once": round(default["wall_s"] / peer, 2),
                                  "bytes_read_over_weights": round(default["bytes_read"] / weights, 3)},
            "cold": {"read_once_s": round(cold_peer, 3), "dump": cold,
                     "dump_over_read_once": round(cold["dump_s"] / cold_peer, 2)},
            "goals": {"short_rss_below_40pct": (short["peak_rss_bytes"] - short["baseline_rss_bytes"]) < 0.4 * weights,
                      "default_within_3x_warm": default["dump_s"] <= 3 * peer,
                      "default_within_3x_cold": cold["dump_s"] <= 3 * cold_peer},
            "host": {"cpus": os.cpu_count(), "machine": platform.machine(), "python": platform.python_version(),
                     "torch": torch.__version__, "transformers": transformers.__version__,
                     "note": "shared, noisy machine (other sessions running)"},
        }, indent=1))


if __name__ == "__main__":
    main()
