"""One rank of a multi-rank ``adapt run``: join the group, load this rank's shard files, generate.

Library API (what ``adapt run`` calls inside each torchrun process)::

    eng, ctx = open_distributed("OUT", device="cpu", dtype="float32", timeout_s=300)
    results = generate(eng, ctx, [[1, 2, 3], [1, 5]], SamplingParams(max_tokens=8))  # rank 0: results
    report = collective_report(eng, ctx)                                           # rank 0: per rank bytes

The plan comes from the shard output's manifest (``adapt shard ... --tp/--pp/--ep``); every rank reads
``OUT/rank-XXXXX/`` only. dp replicas each generate for a share of the prompts (prompt i goes to
replica i mod dp) and rank 0 gathers the results in prompt order. With MoE layers the replicas run
attention on their own batches but every MoE layer spans the stage (all-to-all over its tp x dp ranks),
so they step in lockstep (PipelineRunner: a replica with no work runs idle steps until every rank of
the stage is done); a replica given no prompt still takes part.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch.distributed as dist

from adapt.errors import CheckpointError
from adapt.plan import ParallelPlan
from adapt.source import read_config
from adapt.spec import ModelSpec

from . import moe as ep_moe
from .context import DEFAULT_TIMEOUT_S, DistributedContext, init_distributed, shutdown
from .pipeline import PipelineRunner
from .stats import compare_with_planner, summarize_steps


def read_plan(model: str | Path) -> tuple[ModelSpec, ParallelPlan]:
    """The spec and plan of an ``adapt shard`` output (OUT/manifest.json, OUT/config.json)."""
    out = Path(model).expanduser()
    man_path = out / "manifest.json"
    if not man_path.is_file():
        raise CheckpointError(f"{out}: a multi-rank run needs an `adapt shard` output (no manifest.json); shard "
                              "it first: adapt shard CKPT --out OUT --tp .. --pp .. --ep ..")
    try:
        man = json.loads(man_path.read_text())
    except ValueError as e:
        raise CheckpointError(f"{man_path}: malformed JSON ({e})") from None
    cfg_path = out / "config.json"
    cfg = read_config(cfg_path) if cfg_path.is_file() else (man.get("source") or {}).get("config")
    if not isinstance(cfg, dict):
        raise CheckpointError(f"{out}: no config.json and the manifest holds no source config")
    spec = ModelSpec.from_hf_config(cfg, name=out.name)
    plan = ParallelPlan.from_dict(man.get("plan"), spec, source=str(man_path))
    return spec, plan


def open_distributed(model: str | Path, device: str = "cpu", dtype: str = "float32", backend: str | None = None,
                     timeout_s: float = DEFAULT_TIMEOUT_S, micro_batches: int | None = None, **engine_kw):
    """(Engine, DistributedContext) for this rank of the shard output's plan."""
    from adapt.runtime.engine import Engine

    spec, plan = read_plan(model)
    ctx = init_distributed(plan, device, backend, timeout_s)
    rank_dir = Path(model).expanduser() / f"rank-{ctx.rank:05d}"
    if not rank_dir.is_dir():
        raise CheckpointError(f"rank {ctx.rank}: missing shard directory {rank_dir}")
    eng = Engine.from_pretrained(model, device=ctx.device, dtype=dtype, ctx=ctx, **engine_kw)
    ep_moe.install(eng.model, ctx)
    eng.runner = PipelineRunner(eng.runner, ctx, micro_batches)
    return eng, ctx


def _replica_generate(eng, generate_one, prompts: list, params, images: list | None = None) -> list:
    """This replica's share (possibly none), then idle steps until the whole stage is done (lockstep)."""
    sub = (generate_one(prompts, params) if images is None else generate_one(prompts, params, images=images)
           ) if prompts else []
    drain = getattr(eng.runner, "drain", None)
    if drain is not None:
        drain()
    return sub


def generate(eng, ctx: DistributedContext, prompts: list[list[int]], params=None):
    """Generate on every rank (this rank's dp share); rank 0 returns all results in prompt order."""
    mine = [i for i in range(len(prompts)) if i % ctx.dp_size == ctx.dp_rank]
    plist = params if isinstance(params, (list, tuple)) else None
    sub = _replica_generate(eng, eng.generate, [prompts[i] for i in mine],
                            [plist[i] for i in mine] if plist else params)
    if ctx.dp_size == 1:
        return sub if ctx.is_driver else None
    leader = ctx.tp_rank == 0 and ctx.is_first_stage
    box = [None] * ctx.world_size if ctx.is_driver else None
    dist.gather_object((ctx.dp_rank, mine, sub) if leader else None, box, dst=0)
    if not ctx.is_driver:
        return None
    results = [None] * len(prompts)
    for item in box:
        if item is not None:
            for i, r in zip(item[1], item[2]):
                results[i] = r
    return results


def collective_report(eng, ctx: DistributedContext, act_dtype: str | None = None) -> dict | None:
    """Per rank, bytes sent through each collective per prefill / decode step, and the planner's estimate
    for the same plan and decode batch; gathered on rank 0 (None elsewhere)."""
    act = act_dtype or str(eng.dtype).replace("torch.", "")
    mine = {"rank": ctx.rank, "steps": summarize_steps(ctx.steps),
            "planner": compare_with_planner(eng.spec, ctx.plan, ctx.rank, ctx.steps, act)}
    box = [None] * ctx.world_size if ctx.is_driver else None
    dist.gather_object(mine, box, dst=0)
    if not ctx.is_driver:
        return None
    return {"plan": ctx.plan.label(), "act_dtype": act, "ranks": box}


def _dp_generate(eng, ctx: DistributedContext, generate_one):
    """eng.generate for dp replicas: this replica runs its share; every rank gets all results in order."""

    def gen(prompts, params=None, images=None):
        mine = [i for i in range(len(prompts)) if i % ctx.dp_size == ctx.dp_rank]
        plist = params if isinstance(params, (list, tuple)) else None
        sub = _replica_generate(eng, generate_one, [prompts[i] for i in mine],
                                [plist[i] for i in mine] if plist else params,
                                [images[i] for i in mine] if images is not None else None)
        box = [None] * ctx.world_size
        dist.all_gather_object(box, (mine, sub))
        results = [None] * len(prompts)
        for idx, res in box:
            for i, r in zip(idx, res):
                results[i] = r
        return results

    return gen


def run_distributed(model: str | Path, prompts=None, prompt_ids=None, *, device: str = "cpu",
                    dtype: str = "float32", kernels: str = "auto", kv_cache_memory=None, kv_cache_dtype: str = "auto",
                    prepack: str = "auto", dist_backend: str | None = None, dist_timeout: float = DEFAULT_TIMEOUT_S,
                    micro_batches: int | None = None, collective_stats: bool = False, weights_dtype: str = "auto",
                    **gen_kw) -> dict | None:
    """This rank's part of ``adapt run`` on a shard output: the run_generation document on rank 0 (with
    ``stats.parallel`` and, with collective_stats, ``stats.collectives``), None on the other ranks."""
    from adapt.runtime.run import run_generation

    eng, ctx = open_distributed(model, device, dtype, dist_backend, dist_timeout, micro_batches, kernels=kernels,
                                kv_cache_memory=kv_cache_memory, kv_cache_dtype=kv_cache_dtype, prepack=prepack,
                                weights_dtype=weights_dtype)
    if ctx.dp_size > 1:
        eng.generate = _dp_generate(eng, ctx, eng.generate)
    doc = run_generation(model, prompts, prompt_ids, engine=eng, device=device, dtype=dtype, kernels=kernels,
                         **gen_kw)
    doc["stats"]["parallel"] = {"plan": ctx.plan.label(), "world_size": ctx.world_size, "backend": ctx.backend,
                                "bytes_by_collective": dict(sorted(ctx.bytes_by_collective.items()))}
    if collective_stats:
        doc["stats"]["collectives"] = collective_report(eng, ctx)
    ctx.barrier()
    shutdown()
    return doc if ctx.is_driver else None
