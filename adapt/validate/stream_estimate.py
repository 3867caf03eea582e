"""What a streamed dump will read, hold and take, from the WeightLayout and the prompts alone (``--dry-run``).

Passes mirror ``streamed.StreamedReference``: one prefill over every prompt, one per greedy step (one token
per prompt), one per long-context rung. In a pass every layer's non-expert tensors are read once; routed
experts are read once per pass when the layer's touched experts fit the budget beside the layer (the
experts touched are at most ``min(E, tokens x top_k)``: an upper bound, the router decides the rest),
else once per sequence in chunks. Held memory is float32: the layer's weights, the experts cached for the
pass and the stacked copy one sequence runs on, plus the KV cache of the prompts and the interpreter's
resident baseline. Time is the bytes over the read bandwidth (measured on the checkpoint's files, or
given); dequantization and compute are not in it.
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from adapt.errors import ValidationInputError
from adapt.layout import WeightLayout
from adapt.spec import ModelSpec

ASSUMED_BANDWIDTH = 1e9  # bytes/s when nothing can be measured (no weights): stated as assumed


class StreamBudgetError(ValidationInputError):
    """The memory budget cannot hold what one layer needs."""


def fmt_bytes(n: float) -> str:
    for unit, size in (("TiB", 2 ** 40), ("GiB", 2 ** 30), ("MiB", 2 ** 20), ("KiB", 2 ** 10)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{int(n)} B"


@dataclass(frozen=True)
class LayerCost:
    """One layer's bytes: stored (what is read) and float32 (what is held), experts apart."""

    layer: int
    kind: str
    stored: int
    f32: int
    num_experts: int = 0
    expert_stored: int = 0
    expert_f32: int = 0


def layer_costs(layout: WeightLayout) -> list[LayerCost]:
    """Per decoder layer (MTP excluded): non-expert and per-expert bytes, scales counted as stored."""
    spec = layout.spec
    out = []
    for i, kind in enumerate(spec.layer_kinds):
        stored = f32 = e_stored = e_f32 = 0
        experts = set()
        for t in layout.layer_tensors(i):
            if t.mtp:
                continue
            if t.expert is not None:
                experts.add(t.expert)
                if t.expert == 0:
                    e_stored += t.nbytes
                    e_f32 += 0 if t.scale_of else t.numel * 4
                continue
            stored += t.nbytes
            f32 += 0 if t.scale_of else t.numel * 4
        out.append(LayerCost(i, kind, stored, f32, len(experts), e_stored, e_f32))
    return out


def _named(layout: WeightLayout, role: str) -> tuple[int, int]:
    ts = [t for t in layout.main() if t.role == role and t.layer is None]
    names = {t.name for t in ts}
    scales = [t for t in layout.main() if t.scale_of in names]
    return sum(t.nbytes for t in ts + scales), sum(t.numel * 4 for t in ts)


def measure_read_bandwidth(path: Path, probe_bytes: int = 256 << 20) -> float | None:
    """Bytes/s of reading the largest safetensors file of ``path`` (its first ``probe_bytes``), after asking
    the kernel to drop those pages from the cache; None when there is nothing to read."""
    files = sorted(path.glob("*.safetensors"), key=lambda f: f.stat().st_size) if path.is_dir() else []
    if not files:
        return None
    f = files[-1]
    n = min(probe_bytes, f.stat().st_size)
    if n < 1 << 20:
        return None
    fd = os.open(f, os.O_RDONLY)
    try:
        if hasattr(os, "posix_fadvise"):
            os.posix_fadvise(fd, 0, n, os.POSIX_FADV_DONTNEED)
        buf = bytearray(8 << 20)
        view = memoryview(buf)
        t0 = time.perf_counter()
        done = 0
        while done < n:
            got = os.preadv(fd, [view[:min(len(buf), n - done)]], done)
            if got <= 0:
                break
            done += got
        dt = time.perf_counter() - t0
    finally:
        os.close(fd)
    return done / dt if dt > 0 else None


def estimate(spec: ModelSpec, prompts: Sequence[Sequence[int]], max_new_tokens: int,
             long_lengths: Sequence[int] = (), memory_budget: int | None = None,
             read_bandwidth: float | None = None, baseline_bytes: int = 0) -> dict[str, Any]:
    """The dry run's figures (bytes read, peak memory, time, per layer); see the module docstring."""
    layout = WeightLayout.from_spec(spec)
    costs = layer_costs(layout)
    top_k = spec.moe.top_k if spec.moe is not None else 0
    embed_stored, _ = _named(layout, "embed")
    norm_stored, norm_f32 = _named(layout, "norm")
    head_stored, head_f32 = _named(layout, "lm_head") if not spec.tie_word_embeddings else _named(layout, "embed")
    vocab = spec.vocab_size
    row_stored = embed_stored // vocab
    lengths = [len(p) for p in prompts]
    passes: list[tuple[str, list[int], int]] = [("prefill", lengths, len({t for p in prompts for t in p}))]
    passes += [(f"step {s + 1}", [1] * len(prompts), len(prompts)) for s in range(max(0, max_new_tokens - 1))]
    passes += [(f"long {n}", [n], min(vocab, n)) for n in long_lengths]
    per_layer = [{"layer": c.layer, "kind": c.kind, "bytes_read": 0, "peak_bytes": 0, "experts_chunked": False}
                 for c in costs]
    total = norm_stored
    peak = norm_f32
    for _name, seqs, rows in passes:
        total += rows * row_stored + head_stored
        peak = max(peak, norm_f32 + head_f32)
        for c, rec in zip(costs, per_layer):
            read, held = c.stored, norm_f32 + c.f32
            if c.num_experts:
                union = min(c.num_experts, sum(seqs) * top_k)
                call = min(c.num_experts, max(seqs) * top_k)
                if memory_budget is None or held + (union + call) * c.expert_f32 <= memory_budget:
                    read += union * c.expert_stored
                    held += (union + call) * c.expert_f32
                else:
                    rec["experts_chunked"] = True
                    read += sum(min(c.num_experts, n * top_k) for n in seqs) * c.expert_stored
                    held = max(held + c.expert_f32, min(memory_budget, held + call * c.expert_f32))
            rec["bytes_read"] += read
            rec["peak_bytes"] = max(rec["peak_bytes"], held)
            total += read
            peak = max(peak, held)
    kv = 0
    a = spec.attention
    if a is not None and max_new_tokens > 1:
        # transformers caches MLA's keys and values per head: [heads, T, qk_head_dim] and [heads, T, v_head_dim]
        width = (a.num_heads * (a.head_dim + a.v_head_dim) if a.kind == "mla"
                 else a.num_kv_heads * (a.head_dim + a.v_head_dim))
        kv = spec.num_layers * sum(n + max_new_tokens for n in lengths) * width * 4
    bandwidth = read_bandwidth or ASSUMED_BANDWIDTH
    return {
        "model": spec.name, "bytes_read": int(total), "peak_memory_bytes": int(baseline_bytes + peak + kv),
        "peak_weight_bytes": int(peak), "kv_cache_bytes": int(kv), "baseline_bytes": int(baseline_bytes),
        "est_time_s": round(total / bandwidth, 3), "read_bandwidth": bandwidth,
        "read_bandwidth_source": "measured" if read_bandwidth else "assumed",
        "memory_budget": memory_budget, "passes": len(passes), "prompt_lengths": lengths,
        "max_new_tokens": max_new_tokens, "long_lengths": list(long_lengths), "layers": per_layer,
    }


def check_budget(spec: ModelSpec, memory_budget: int | None) -> None:
    """StreamBudgetError (one line: which layer, how much) when the budget cannot hold one layer with one
    routed expert, or the lm_head: refused before anything is read."""
    if memory_budget is None:
        return
    layout = WeightLayout.from_spec(spec)
    _, norm_f32 = _named(layout, "norm")
    need = [(f"layer {c.layer}", norm_f32 + c.f32 + c.expert_f32,
             "its weights and one routed expert" if c.num_experts else "its weights") for c in layer_costs(layout)]
    _, head_f32 = _named(layout, "lm_head") if not spec.tie_word_embeddings else _named(layout, "embed")
    need.append(("lm_head", norm_f32 + head_f32, "its weights"))
    what, most, why = max(need, key=lambda x: x[1])
    if most > memory_budget:
        raise StreamBudgetError(f"--memory-budget {fmt_bytes(memory_budget)} cannot hold {what}: it needs "
                                f"{fmt_bytes(most)} in float32 ({why} and the final norm)")


def dry_run(model: str | Path, max_new_tokens: int = 16, prompt_lengths: Sequence[int] | None = None,
            long_lengths: Sequence[int] = (), memory_budget: int | None = None,
            read_bandwidth: float | None = None) -> dict[str, Any]:
    """``dump --stream --dry-run``: refuse a budget that cannot hold one layer, else the estimate.

    MODEL is a checkpoint directory, a config.json or a hub id (no weights needed); the read bandwidth is
    measured on the checkpoint's files when it has some, else ``read_bandwidth`` or an assumed 1 GB/s.
    """
    from adapt.source import resolve_model
    from adapt.validate.rss import rss_bytes
    from adapt.validate.reference import PROMPT_LENGTHS, fixed_prompts

    src = resolve_model(str(model))
    spec = src.spec()
    check_budget(spec, memory_budget)
    prompts = fixed_prompts(spec.vocab_size, prompt_lengths or PROMPT_LENGTHS)
    longs = [n for n in long_lengths if not spec.max_position_embeddings or n <= spec.max_position_embeddings]
    if read_bandwidth is None and src.directory is not None:
        read_bandwidth = measure_read_bandwidth(src.directory)
    return estimate(spec, prompts, max_new_tokens, longs, memory_budget, read_bandwidth, rss_bytes() or 0)
