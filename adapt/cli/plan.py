"""`adapt plan`: search tp x pp x ep x dp layouts for a cluster, or check a hand-written plan.yaml."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Optional

import typer
from rich.console import Console
from rich.table import Table

from adapt.cli.options import ContextOpt, FormatOpt, KvDtypeOpt, ModelArg, WeightsDtypeOpt
from adapt.cli.output import atomic_write, check_choice, emit, err_console, to_json
from adapt.errors import PlanError
from adapt.plan import coverage, layout_of
from adapt.plan_file import load_plan, plan_to_yaml
from adapt.source import resolve_model

if TYPE_CHECKING:
    from adapt.profile.planner.search import Candidate

_F = Optional[float]
_I = Optional[int]


def plan_cmd(
    ctx: typer.Context,
    model: ModelArg,
    hardware: Annotated[Optional[str], typer.Option("--hardware", "-H", help="Built-in accelerator name or a "
                                                    "hardware YAML (default h100-sxm).")] = None,
    devices_per_node: Annotated[_I, typer.Option("--devices-per-node", help="Devices per node (default: the "
                                                 "hardware's).")] = None,
    nodes: Annotated[_I, typer.Option("--nodes", help="Use exactly N nodes (default 1).")] = None,
    max_nodes: Annotated[_I, typer.Option("--max-nodes", help="Search every size up to N nodes.")] = None,
    intra_bw: Annotated[_F, typer.Option("--intra-node-bandwidth", help="Bytes/s per device, one way.")] = None,
    inter_bw: Annotated[_F, typer.Option("--inter-node-bandwidth", help="Bytes/s per device, one way.")] = None,
    intra_lat: Annotated[_F, typer.Option("--intra-node-latency", help="Seconds per hop.")] = None,
    inter_lat: Annotated[_F, typer.Option("--inter-node-latency", help="Seconds per hop.")] = None,
    memory_utilization: Annotated[_F, typer.Option("--memory-utilization", help="Fraction of device memory "
                                                   "a plan may use (default 0.9).")] = None,
    cluster_file: Annotated[Optional[Path], typer.Option("--cluster", help="Cluster YAML holding all of the "
                                                         "above.")] = None,
    context: ContextOpt = 4096,
    concurrency: Annotated[int, typer.Option("--concurrency", "-C", min=1, help="Sequences resident at once.")] = 8,
    weights_dtype: WeightsDtypeOpt = None,
    kv_dtype: KvDtypeOpt = "bfloat16",
    max_ttft_s: Annotated[_F, typer.Option("--max-ttft-s", help="SLO: time to first token.")] = None,
    max_tpot_s: Annotated[_F, typer.Option("--max-tpot-s", help="SLO: time per output token.")] = None,
    objective: Annotated[str, typer.Option("--objective", help="min-devices | latency | throughput")] = "min-devices",
    mtp: Annotated[bool, typer.Option("--mtp", help="Also load the MTP layers (speculative decoding).")] = False,
    fmt: FormatOpt = "table",
    out: Annotated[Optional[Path], typer.Option("--out", "-o", help="Write the recommended plan.yaml here.")] = None,
    check: Annotated[Optional[Path], typer.Option("--check", help="Validate this plan.yaml instead of "
                                                  "searching.")] = None,
    emit_engine: Annotated[Optional[str], typer.Option("--emit", help="Print the vllm | sglang launch "
                                                       "flags of the recommended layout.")] = None,
    top: Annotated[int, typer.Option("--top", min=1, help="Candidates shown in the table.")] = 10,
) -> None:
    """Search parallel layouts for MODEL on a cluster; rank those that fit, say why the others do not."""
    check_choice(fmt, ("table", "json"), "--format")
    if emit_engine is not None:
        check_choice(emit_engine, ("vllm", "sglang"), "--emit")
    from adapt.profile.planner import Workload, load_cluster, make_cluster, search  # only this command needs it

    src = resolve_model(model)
    spec = src.spec()
    link = dict(devices_per_node=devices_per_node, nodes=nodes, max_nodes=max_nodes,
                intra_node_bandwidth=intra_bw, inter_node_bandwidth=inter_bw, intra_node_latency_s=intra_lat,
                inter_node_latency_s=inter_lat, memory_utilization=memory_utilization)
    if cluster_file is not None:
        cluster = load_cluster(cluster_file, hardware=hardware, **link)
    else:
        link["memory_utilization"] = 0.9 if memory_utilization is None else memory_utilization
        cluster = make_cluster(hardware or "h100-sxm", **link)
    work = Workload(context=context, concurrency=concurrency, weights_dtype=weights_dtype, kv_dtype=kv_dtype,
                    max_ttft_s=max_ttft_s, max_tpot_s=max_tpot_s, objective=objective, include_mtp=mtp)
    if check is not None:
        work = _recorded_workload(check, work, ctx)
        return _check(check, src.name, spec, cluster, work, fmt, emit_engine)
    result = search(spec, cluster, work, model=src.name)
    rec = result.recommended
    doc = result.to_dict()
    if rec is not None and emit_engine:
        doc["launch"] = _flags(emit_engine, src.name, rec, cluster, work)
    if rec is not None and out is not None:
        plan = result.plan()
        atomic_write(out, plan_to_yaml(plan, {"estimates": _est(rec), "cluster": cluster.to_dict(),
                                             "workload": work.to_dict()}))
        err_console.print(f"wrote {out}")
    if fmt == "json":
        emit(to_json(doc), None)
    else:
        _table(result, top)
        if rec is not None and emit_engine:
            for line in doc["launch"]:
                print(line)
    if rec is None:
        raise PlanError(result.summary())
    err_console.print(result.summary())


def _est(c: Candidate) -> dict:
    r = c.row()
    return {k: r[k] for k in ("memory_per_device_bytes", "est_ttft_s", "est_tpot_s", "est_tokens_per_s")}


def _flags(engine, name, c, cluster, work) -> list[str]:
    from adapt.profile.planner import launch_flags

    return launch_flags(engine, name, c.tp, c.pp, c.ep, c.dp, c.nodes, work.context, work.concurrency,
                        cluster.memory_utilization, work.kv_dtype)


# the workload options a plan.yaml from `adapt plan --out` records, by their Workload field
_RECORDED = ("context", "concurrency", "weights_dtype", "kv_dtype")


def _recorded_workload(path: Path, work, ctx: typer.Context):
    """The workload a plan was searched for (its `workload:` section), for every option not given on this command
    line: `plan --out plan.yaml --weights-dtype fp8` then `plan --check plan.yaml` checks it at fp8, not native."""
    import dataclasses

    from adapt.fileio import read_yaml

    doc = read_yaml(path, PlanError, "plan")
    recorded = doc.get("workload") if isinstance(doc, dict) else None
    if not isinstance(recorded, dict):
        return work
    # typer carries its own copy of click, so the source is compared by name
    given = {k for k in _RECORDED if getattr(ctx.get_parameter_source(k), "name", "DEFAULT") != "DEFAULT"}
    keep = {k: recorded[k] for k in _RECORDED if k not in given and k in recorded}
    try:
        return dataclasses.replace(work, **keep)
    except (TypeError, ValueError) as e:
        raise PlanError(f"{path}: workload: {e}") from e


def _check(path, name, spec, cluster, work, fmt, emit_engine) -> None:
    from adapt.profile.planner import check_plan
    from adapt.profile.planner.search import Candidate

    plan = load_plan(path, spec)
    cov = coverage(layout_of(spec), plan)
    r = check_plan(spec, plan, cluster, work)
    if not isinstance(r, Candidate):
        raise PlanError(f"{path}: {plan.label()} does not fit: {r.reason}")
    doc = {"check": "ok", "plan": str(path), "layout": plan.label(), "estimates": r.row(),
           "coverage": {"tensors": cov.tensors, "numel": cov.numel, "slices": cov.slices}}
    if emit_engine:
        doc["launch"] = _flags(emit_engine, name, r, cluster, work)
    if fmt == "json":
        emit(to_json(doc), None)
        return
    row = r.row()
    print(f"{path}: OK {plan.label()} on {plan.world_size} devices ({plan.nodes} node(s)); "
          f"{row['memory_per_device_bytes'] / 1e9:.1f} GB per device of {cluster.usable_bytes / 1e9:.1f} GB "
          f"usable; every tensor covered once per replica ({cov.tensors} tensors, {cov.numel:,} weights); "
          f"est TTFT {row['est_ttft_s']:.3g} s, TPOT {row['est_tpot_s'] * 1e3:.3g} ms, "
          f"{row['est_tokens_per_s']:.4g} tok/s")
    for line in doc.get("launch", []):
        print(line)


def _table(result, top: int) -> None:
    console = Console(width=None if sys.stdout.isatty() else 150)
    c = result.cluster
    sizes = c.world_sizes()
    where = f"{sizes[0]}" if len(sizes) == 1 else f"1..{sizes[-1]}"
    t = Table(title=f"adapt plan {result.model}: {where} x {c.hardware.name}, "
                    f"{c.usable_bytes / 1e9:.1f} GB usable per device, objective {result.workload.objective}")
    for col in ("#", "layout", "dev", "nodes", "GB/dev", "weights", "kv", "act", "TTFT s", "TPOT ms", "tok/s"):
        t.add_column(col, justify="left" if col == "layout" else "right", no_wrap=True)
    for i, x in enumerate(result.candidates[:top], 1):
        m = x.memory
        t.add_row(str(i), x.label, str(x.world_size), str(x.nodes), f"{m.total / 1e9:.1f}",
                  f"{m.weights / 1e9:.1f}", f"{m.kv / 1e9:.1f}", f"{m.activations / 1e9:.1f}",
                  f"{x.times.ttft_s:.3g}", f"{x.times.tpot_s * 1e3:.3g}", f"{x.times.tokens_per_s:.4g}")
    console.print(t)
    if result.rejected:
        counts: dict[str, int] = {}
        for r in result.rejected:
            counts[r.rule] = counts.get(r.rule, 0) + 1
        console.print(f"rejected {len(result.rejected)} layouts: " +
                      ", ".join(f"{n} {k}" for k, n in sorted(counts.items())) + " (--format json lists each)")
        best = sorted((r for r in result.rejected if r.rule == "memory"), key=lambda r: r.needs_bytes)[:3]
        for r in best:
            console.print(f"  {r.layout}: {r.reason}", highlight=False)


def register(app: typer.Typer) -> None:
    app.command("plan")(plan_cmd)
