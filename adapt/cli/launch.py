"""Multi-rank options of `adapt run` and the path that starts torchrun (--nproc) or runs one rank.

`adapt run OUT --nproc N ...` re-runs the same command line (rebuilt from the parsed options, minus the
launcher's) under torchrun; inside torchrun (RANK / WORLD_SIZE set) each process runs one rank of the
shard output's plan and rank 0 prints.
"""

from __future__ import annotations

from typing import Annotated, Optional

import typer

try:  # typer >= 0.17 carries its own copy of click
    from typer._click.globals import get_current_context
except ImportError:  # pragma: no cover
    from click import get_current_context

NprocOpt = Annotated[int, typer.Option("--nproc", min=0, help="Ranks to start on this node with torchrun "
                                       "(multi-rank run of an `adapt shard` output).")]
NnodesOpt = Annotated[Optional[str], typer.Option("--nnodes", help="torchrun --nnodes (multi-node).")]
NodeRankOpt = Annotated[Optional[int], typer.Option("--node-rank", help="torchrun --node-rank.")]
RdzvOpt = Annotated[Optional[str], typer.Option("--rdzv-endpoint", help="torchrun --rdzv-endpoint HOST:PORT.")]
TorchrunArgOpt = Annotated[Optional[list[str]], typer.Option("--torchrun-arg", help="Any other torchrun flag, "
                           "e.g. --torchrun-arg=--rdzv-id=job7 (repeatable).")]
DistBackendOpt = Annotated[Optional[str], typer.Option("--dist-backend", help="torch.distributed backend "
                           "(default by device: cpu gloo, cuda nccl, npu hccl, musa mccl, xpu xccl).")]
DistTimeoutOpt = Annotated[float, typer.Option("--dist-timeout", min=1, help="Seconds a collective may wait "
                           "before every rank fails.")]
MicroBatchesOpt = Annotated[Optional[int], typer.Option("--micro-batches", min=1, help="Pipeline micro-batches "
                            "per step (default: pp).")]
CollectiveStatsOpt = Annotated[bool, typer.Option("--collective-stats", help="Per rank bytes through each "
                               "collective per step, against the planner's estimate (stderr; in JSON stats).")]

LAUNCH_PARAMS = ("nproc", "nnodes", "node_rank", "rdzv_endpoint", "torchrun_arg")


def relaunch_argv(ctx) -> list[str]:
    """The command line of this command rebuilt from its parsed params, without the launcher's."""
    argv = [ctx.info_name or "run"]
    for p in ctx.command.params:
        if p.name in LAUNCH_PARAMS or p.name not in ctx.params:
            continue
        v = ctx.params[p.name]
        if getattr(p, "param_type_name", "") == "argument":
            argv += [str(x) for x in (v if isinstance(v, (list, tuple)) else [v])]
            continue
        if v is None or v == p.default or (p.multiple and not v):
            continue
        opt = max(p.opts, key=len)
        if getattr(p, "is_flag", False):
            if v:
                argv.append(opt)
            elif p.secondary_opts:
                argv.append(p.secondary_opts[0])
        elif p.multiple:
            for x in v:
                argv.append(f"{opt}={x}")
        else:
            argv.append(f"{opt}={v}")
    return argv


def launch_or_rank(nproc: int, nnodes: str | None, node_rank: int | None, rdzv_endpoint: str | None,
                   torchrun_arg: list[str] | None) -> str:
    """'launched' after running torchrun for --nproc, 'rank' inside a launcher, 'single' otherwise."""
    from adapt.runtime.distributed.launch import in_launcher, launch

    if in_launcher():
        return "rank"
    if not nproc:
        return "single"
    extra = []
    if nnodes:
        extra += ["--nnodes", str(nnodes)]
    if node_rank is not None:
        extra += ["--node-rank", str(node_rank)]
    if rdzv_endpoint:
        extra += ["--rdzv-endpoint", rdzv_endpoint, "--rdzv-backend", "c10d"]
    extra += list(torchrun_arg or [])
    launch(relaunch_argv(get_current_context()), nproc, extra)
    return "launched"


def print_collective_stats(report: dict | None, err_console) -> None:
    """One line per rank and collective kind: measured bytes per decode step vs the planner's estimate."""
    if not report:
        return
    err_console.print(f"collective bytes per decode step ({report['plan']}, {report['act_dtype']}):", highlight=False)
    for r in report["ranks"]:
        cmp = r.get("planner")
        if not cmp:
            dec = r["steps"].get("decode", {}).get("bytes_per_step", {})
            err_console.print(f"  rank {r['rank']}: {dec}", highlight=False)
            continue
        parts = [f"{k} {cmp['measured_per_step'][k]:.0f}/{cmp['estimated_per_step'][k]:.0f}"
                 for k in cmp["measured_per_step"] if cmp["measured_per_step"][k] or cmp["estimated_per_step"][k]]
        ratio = cmp["ratio"]["total"]
        err_console.print(f"  rank {r['rank']}: measured/estimated {', '.join(parts) or 'none'}"
                          f" (ratio {ratio:.3f})" if ratio is not None else "", highlight=False)
