"""Tactic selection: which of several equivalent kernel paths runs, measured on this host.

The kernels (adapt/runtime/kernels/) stay pure functions: where one has several ways to compute the same
result it takes a ``choose(key, {name: thunk})`` callable and offers the paths eligible for the call.
The runtime passes ``TACTICS.run``, which times them once per call class and keeps the fastest, as
TensorRT's builder times tactics or vLLM's MoE tuner writes per-device configs, but at first use: nothing
to ship per device. ``packing_wins`` is the load-time trial that decides whether a model's MoE experts
are repacked for oneDNN. Like TensorRT's timing cache, the results persist in
``$ADAPT_CACHE/tactics/HOST.json`` (HOST: a hash of the CPU model and features, the thread count and the
torch version), so a later run on the same host times nothing and makes the same choices.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import platform
import time
from pathlib import Path

import torch

from adapt.runtime.kernels.moe_experts import moe_experts_fused, moe_experts_packed, pack_expert_weights
from adapt.runtime.kernels.moe_tiled import moe_experts_tiled, pack_tiled, tiled_panel

STRATEGIES = ("padded", "grouped", "loop")
STRATEGY_ENV = "ADAPT_MOE_STRATEGY"  # auto (default): measured; or one of STRATEGIES where it applies


class Tactics:
    """Which of the eligible paths runs a call, chosen by timing each once on this host. Every candidate
    set holds "loop", the path that always applies (the fallback).

    The winner between the per-expert loop, torch._grouped_mm and the padded batched GEMMs flips
    between CPUs: on a 2-core AMD EPYC (AVX-512, no AMX; torch 2.13, 32 experts top-4, H 512, I 256)
    float32 at 512 tokens ran padded 30.4 / grouped 26.0 / loop 22.0 ms, while on a 2-core Xeon with
    AMX the float32 loop and grouped_mm ran 8.6 / 8.3 ms against the packed loop's 10.5, and bfloat16
    padded at 2.4x waste beat the loop (4.4 vs 5.6 ms). So no fixed threshold is right everywhere:
    the first call of each class (dtype, expert shapes, served rows rounded up to a power of two,
    padding waste, candidates) times every candidate three times (in rounds) after one warm-up run and
    keeps the fastest (persisted in the timing cache, see the module docstring). Every path computes
    the same sums, so the choice changes results only by rounding (fp32: within 1e-5).
    ``ADAPT_MOE_STRATEGY`` pins one path for reproducible runs."""

    def __init__(self, path: Path | str | None = None):
        self.choice: dict[tuple, str] = {}
        self.last = ""  # the path the latest call ran (the bench reports it)
        self.path = path  # the timing cache: a file, "host" for $ADAPT_CACHE/tactics/HOST.json, None for none
        self._saved: dict[str, dict] | None = None  # what the file held, by section, keys as repr strings

    def recall(self, section: str, key: tuple):
        """The persisted result of ``key`` in ``section`` ("paths" or "packing"), or None."""
        if self.path is None:
            return None
        if self._saved is None:
            self._saved = {}
            try:
                data = json.loads(self._file().read_text())
                if isinstance(data, dict) and data.get("version") == 1:
                    self._saved = {k: v for k, v in data.items() if isinstance(v, dict)}
            except (OSError, ValueError):  # none yet, or unreadable: time again
                pass
        return self._saved.get(section, {}).get(repr(key))

    def remember(self, section: str, key: tuple, value) -> None:
        """Persist ``value`` for ``key`` (atomically: a temporary file renamed over the cache); a cache that
        cannot be written is skipped silently, the result then lives for this process only."""
        if self.path is None:
            return
        self.recall(section, key)  # loads the file once
        self._saved.setdefault(section, {})[repr(key)] = value
        f = self._file()
        tmp = f.with_name(f"{f.name}.{os.getpid()}.tmp")
        try:
            f.parent.mkdir(parents=True, exist_ok=True)
            tmp.write_text(json.dumps({"version": 1, "host": host(), **self._saved}, indent=1, sort_keys=True))
            os.replace(tmp, f)
        except OSError:
            try:
                tmp.unlink(missing_ok=True)
            except OSError:  # e.g. its folder is not a directory
                pass

    def _file(self) -> Path:
        if self.path != "host":
            return Path(self.path)
        from adapt.runtime.init_model import cache_root

        return cache_root() / "tactics" / f"{hashlib.sha256(repr(host()).encode()).hexdigest()[:16]}.json"

    def run(self, key: tuple, candidates: dict):
        out, self.last = self._run(key, candidates)
        return out

    def _run(self, key: tuple, candidates: dict):
        forced = os.environ.get(STRATEGY_ENV, "auto")
        if forced != "auto":
            if forced not in STRATEGIES:
                raise ValueError(f"{STRATEGY_ENV}={forced!r}: expected auto or one of {', '.join(STRATEGIES)}")
            name = forced if forced in candidates else "loop"
            try:
                return candidates[name](), name
            except (RuntimeError, NotImplementedError):  # e.g. no grouped_mm kernel for this dtype
                if name == "loop":
                    raise
                return candidates["loop"](), "loop"
        if len(candidates) == 1:
            return candidates["loop"](), "loop"
        name = self.choice.get(key) or self.recall("paths", key)
        if name in candidates:
            self.choice[key] = name
            return candidates[name](), name
        live, outs = {}, {}
        for cand, fn in candidates.items():
            try:
                outs[cand] = fn()  # warm-up (oneDNN primitive caches, allocator)
            except (RuntimeError, NotImplementedError):  # no kernel for this dtype / layout: not a candidate
                if cand == "loop":  # the path that always applies failed: a real error, not a missing kernel
                    raise
                continue
            live[cand] = float("inf")
        for _ in range(3):  # rounds over the candidates, so that a noisy moment of a shared host hits them all
            for cand in live:
                t0 = time.perf_counter()
                outs[cand] = candidates[cand]()
                live[cand] = min(live[cand], time.perf_counter() - t0)
        name = min(live, key=live.get)
        self.choice[key] = name
        self.remember("paths", key, name)
        return outs[name], name


def host() -> dict:
    """What a timing depends on besides the call: the CPU model and features, threads, torch."""
    caps = torch._C._cpu._get_cpu_capability() if hasattr(torch._C, "_cpu") else {}
    return {"machine": platform.machine(), "cpu": str(caps.get("cpu_name", platform.processor())),
            "features": sorted(k for k, v in caps.items() if v is True), "threads": torch.get_num_threads(),
            "torch": torch.__version__}


TACTICS = Tactics("host")


_PACK_TRIALS: dict[tuple, bool] = {}
_TRIAL_TOKENS = (4, 128)
_TRIAL_EXPERTS = 32


def packing_wins(block, dtype: torch.dtype, form: str = "onednn") -> bool:
    """Whether the packed experts of ``form`` (moe_experts_packed for "onednn", moe_experts_tiled for
    "tiled") beat the stacked kernel (its paths measured by TACTICS) on ``block``'s
    experts (a models.moe.MoE) on this host: both timed
    (best of three after a warm-up) on random tokens with skewed routing (expert e drawn with weight
    1 / (e + 1)) at _TRIAL_TOKENS tokens; packed wins when its geometric-mean time ratio is below 1.
    Measured once per (dtype, experts, hidden, intermediate, top-k) and host (TACTICS' timing cache), on
    packed copies of at most _TRIAL_EXPERTS of the block's experts (a DeepSeek-V3 layer's 256 bfloat16
    experts are 11 GB; 32 of them hold the same GEMM shapes), so the block is untouched."""
    e, h, inter, k = len(block.experts), block.hidden_size, block.num_inter, block.moe.top_k
    key = (dtype, e, h, inter, k) if form == "onednn" else (dtype, e, h, inter, k, form)
    if key not in _PACK_TRIALS and isinstance(TACTICS.recall("packing", key), bool):
        _PACK_TRIALS[key] = TACTICS.recall("packing", key)
    if key not in _PACK_TRIALS:
        g = torch.Generator().manual_seed(0)
        sub = min(e, _TRIAL_EXPERTS)
        gu, dn = block.w_gate_up.detach()[:sub], block.w_down.detach()[:sub]
        if form == "tiled":
            p = tiled_panel(dtype)
            pg, pd = pack_tiled(gu, p), pack_tiled(dn, p)
            packed = moe_experts_tiled
        else:
            pg, pd = pack_expert_weights(gu), pack_expert_weights(dn)
            packed = moe_experts_packed
        probs = 1.0 / torch.arange(1, sub + 1, dtype=torch.float32)
        log_ratio = 0.0
        for t in _TRIAL_TOKENS:
            x = torch.randn(t, h, generator=g).to(dtype)
            ids = torch.multinomial(probs.expand(t, sub), min(k, sub), generator=g) + block.expert_offset
            w = torch.rand(t, ids.shape[1], generator=g).to(dtype)
            best = []
            for fn in (lambda: moe_experts_fused(x, w, ids, gu, dn, block.expert_offset, TACTICS.run),
                       lambda: packed(x, w, ids, pg, pd, block.expert_offset)):
                with torch.inference_mode():
                    fn()
                    ts = []
                    for _ in range(3):
                        t0 = time.perf_counter()
                        fn()
                        ts.append(time.perf_counter() - t0)
                best.append(min(ts))
            log_ratio += math.log(best[1] / best[0])
        _PACK_TRIALS[key] = log_ratio < 0
        TACTICS.remember("packing", key, _PACK_TRIALS[key])
    return _PACK_TRIALS[key]
