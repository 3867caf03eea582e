"""adapt's runtime (``adapt.runtime.engine.Engine``) behind ``target.ModelRunner``.

Prefill logits and layer outputs come from ``Engine.prefill`` (no cache). Greedy generation and the
KV-quantization check drive the engine's own scheduler and model runner step by step, so tokens and
their logprobs come from the real paged-KV decode path: ``decode_steps`` records the logits of every
step and can force the next token (teacher forcing) instead of taking the argmax.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from adapt.validate.target import Generation, layer_names

# engine capture name -> runtime-neutral name (target.layer_names)
_RENAME = {"embed": "embedding", "norm": "final_norm", "attn": "attention", "post_attn_norm": "post_attention_norm"}
CPU_KV_BYTES = 64 << 20  # validation prompts are short: a small pool keeps startup fast on CPU


def _neutral(name: str) -> str:
    if name in _RENAME:
        return _RENAME[name]
    parts = name.split(".")
    if len(parts) == 3 and parts[2] in _RENAME:
        return f"{parts[0]}.{parts[1]}.{_RENAME[parts[2]]}"
    return name


def decode_steps(engine: Any, ids: Sequence[int], max_new_tokens: int, forced: Sequence[int] | None = None
                 ) -> tuple[list[int], torch.Tensor]:
    """Prefill ``ids`` then decode ``max_new_tokens`` steps through the paged KV cache.

    Returns (tokens, logits [max_new_tokens, V] float32): the logits each step chose from. With
    ``forced``, step k appends ``forced[k]`` (when there is one) instead of the argmax.
    """
    from adapt.runtime.sampling import SamplingParams
    from adapt.runtime.scheduler import Scheduler

    sp = SamplingParams(temperature=0.0, max_tokens=max_new_tokens, ignore_eos=True)
    sched = Scheduler(engine.block_manager, max_num_seqs=1, max_num_batched_tokens=max(engine.max_num_batched_tokens,
                      len(ids) + max_new_tokens), max_model_len=engine.max_model_len, eos_token_ids=engine.eos_token_ids)
    sched.add([int(t) for t in ids], sp)
    tokens, rows = [], []
    while sched.has_unfinished:
        sb = sched.schedule()
        if sb is None:
            from adapt.errors import RuntimeConfigError

            raise RuntimeConfigError("the KV cache cannot hold the validation prompt")
        logits = engine.runner.step(sb)[0].float().cpu()  # [V]
        k = len(tokens)
        tok = int(forced[k]) if forced is not None and k < len(forced) else int(logits.argmax())
        rows.append(logits)
        tokens.append(tok)
        sched.postprocess(sb.seqs, [tok])
    return tokens, torch.stack(rows)


class EngineRunner:
    """``target.ModelRunner`` over an Engine."""

    def __init__(self, engine: Any, name: str):
        self.engine = engine
        self.name = name
        self.num_layers = int(engine.spec.num_layers)
        self.vocab_size = int(engine.spec.vocab_size)

    def prefill_logits(self, ids: Sequence[int]) -> torch.Tensor:
        return self.engine.prefill_logits(list(ids)).float().cpu()

    def tail_logits(self, ids: Sequence[int], tail: int = 32) -> torch.Tensor:
        return self.prefill_logits(ids)[-tail:]

    def generate_greedy(self, ids: Sequence[int], max_new_tokens: int, top_n: int = 5) -> Generation:
        tokens, logits = decode_steps(self.engine, ids, max_new_tokens)
        lp = torch.log_softmax(logits.double(), dim=-1)  # [N, V]
        top = lp.topk(min(top_n, lp.shape[-1]), dim=-1)
        return Generation(tokens, [{int(i): float(v) for v, i in zip(vs, ix)} for vs, ix in zip(top.values, top.indices)])

    def layer_outputs(self, ids: Sequence[int]) -> dict[str, torch.Tensor]:
        out = self.engine.prefill(list(ids), return_hidden_states=True)
        got = {_neutral(k): v.float().cpu() for k, v in out.hidden_states.items()}
        return {n: got[n] for n in layer_names(self.num_layers) if n in got}


def open_engine(path: Path, device: str, dtype: str, kv_cache_dtype: str = "auto") -> tuple[Any, dict[str, float]]:
    """Engine.from_pretrained and the stage timings validate reports: config, spec, layout, weights,
    kv_cache, warmup (the first token). The engine allocates its KV pool inside from_pretrained; the
    kv_cache stage times allocating a pool of the same size again, and weights is the rest."""
    from adapt.layout import WeightLayout
    from adapt.runtime.cache.kv_pool import KVPool
    from adapt.runtime.engine import Engine
    from adapt.source import resolve_model

    stages: dict[str, float] = {}
    t0 = time.perf_counter()
    src = resolve_model(str(path)) if (path / "config.json").is_file() else None
    stages["config"] = time.perf_counter() - t0
    if src is not None:
        t0 = time.perf_counter()
        spec = src.spec()
        stages["spec"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        WeightLayout.from_spec(spec)
        stages["layout"] = time.perf_counter() - t0
    mem = CPU_KV_BYTES if str(device).startswith("cpu") else None
    t0 = time.perf_counter()
    eng = Engine.from_pretrained(path, device=device, dtype=dtype, kv_cache_memory=mem, kv_cache_dtype=kv_cache_dtype)
    load_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    again = KVPool(eng.pool.spec, eng.pool.num_blocks, eng.pool.block_size, eng.device)
    stages["kv_cache"] = time.perf_counter() - t0
    del again
    stages["weights"] = max(0.0, load_s - stages["kv_cache"])
    t0 = time.perf_counter()
    decode_steps(eng, [3, 4, 5, 6], 1)
    stages["warmup"] = time.perf_counter() - t0
    return eng, stages


def open_engine_runner(path: Path, device: str = "cpu", dtype: str = "float32") -> tuple[EngineRunner, Any, dict]:
    """(runner, engine, stage timings) for TARGET on adapt's runtime."""
    eng, stages = open_engine(Path(path), device, dtype)
    return EngineRunner(eng, Path(path).name), eng, stages


def decode_logits_with_kv(target: Any, ids: list[int], kv_dtype: str | None = None) -> torch.Tensor | None:
    """Teacher-forced logits [T, V] of ``ids`` through the paged KV cache: the prefill of ``ids[:1]``, then
    one decode step per remaining token, with the cache in ``kv_dtype`` (None: the target engine's)."""
    if target.engine is None:
        return None
    cache = target.__dict__.setdefault("_kv_engines", {})
    if kv_dtype is None:
        eng = target.engine
    else:
        if kv_dtype not in cache:
            dev, dt = str(target.engine.device), str(target.engine.dtype).removeprefix("torch.")
            cache[kv_dtype], _ = open_engine(target.path, dev, dt, kv_cache_dtype=kv_dtype)
        eng = cache[kv_dtype]
    _, logits = decode_steps(eng, ids[:1], len(ids), forced=ids[1:])
    return logits
