"""`adapt shard CKPT --out OUT ...` and `adapt shard verify OUT [--source CKPT]`."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer
from typer.core import TyperGroup

from adapt.cli.options import FormatOpt
from adapt.cli.output import check_choice, emit, err_console, to_json
from adapt.errors import ShardError


class _DefaultToRun(TyperGroup):
    """`adapt shard CKPT ...` runs the hidden `run` command; `adapt shard verify OUT` runs verify."""

    def parse_args(self, ctx, args):
        if args and args[0] not in self.commands and args[0] not in ("--help", "-h"):
            args = ["run", *args]
        return super().parse_args(ctx, args)


shard_app = typer.Typer(cls=_DefaultToRun, no_args_is_help=True, add_completion=False,
                        help="Shard a checkpoint per the plan (adapt shard CKPT --out OUT ...), or verify an "
                             "output (adapt shard verify OUT [--source CKPT]).")

_Deg = Optional[int]


@shard_app.command("run", help="Stream CKPT into OUT/rank-XXXXX/ safetensors files per the plan, with "
                               "OUT/manifest.json written last. Rerun the same command to resume.")
def run_cmd(
    ckpt: Annotated[Path, typer.Argument(help="HF checkpoint directory (safetensors, sharded or not).")],
    out: Annotated[Path, typer.Option("--out", "-o", help="Output directory.")],
    plan: Annotated[Optional[Path], typer.Option("--plan", help="plan.yaml from `adapt plan`.")] = None,
    tp: Annotated[_Deg, typer.Option("--tp", help="Tensor-parallel degree (without --plan).")] = None,
    pp: Annotated[_Deg, typer.Option("--pp", help="Pipeline-parallel degree.")] = None,
    ep: Annotated[_Deg, typer.Option("--ep", help="Expert-parallel degree.")] = None,
    dp: Annotated[_Deg, typer.Option("--dp", help="Data-parallel degree.")] = None,
    dtype: Annotated[str, typer.Option("--dtype", help="keep | bf16 | fp16 | fp32 (FP8 is dequantized).")] = "keep",
    quantize: Annotated[Optional[str], typer.Option("--quantize", help="int8 | int4 | fp8: quantize the linear "
                        "weights (round-to-nearest; int8 per output channel and int4 in --group-size groups, "
                        "compressed-tensors; fp8 128x128 blocks, DeepSeek's layout).")] = None,
    group_size: Annotated[int, typer.Option("--group-size", help="int4: columns per scale.")] = 128,
    quantize_lm_head: Annotated[bool, typer.Option("--quantize-lm-head", help="int8 / int4: quantize lm_head too "
                                "(a head tied to the embedding is written untied: lm_head quantized, the embedding "
                                "kept).")] = False,
    activations: Annotated[str, typer.Option("--activations", help="none | int8: with --quantize int8 / int4, "
                           "declare the linears' inputs quantized to int8 per token at run time (W8A8 / W4A8, "
                           "compressed-tensors' dynamic input_activations).")] = "none",
    max_file_size: Annotated[str, typer.Option("--max-file-size", help="Split rank files at this size.")] = "5GB",
    workers: Annotated[int, typer.Option("--workers", "-j", min=0, help="Source files (or rank groups of "
                                         "one) processed at once; 0 = one per core, 8 at most.")] = 0,
    memory_budget: Annotated[str, typer.Option("--memory-budget", help="Bytes of slices in flight "
                                               "across workers.")] = "4GiB",
    force: Annotated[bool, typer.Option("--force", help="Write into an existing non-adapt directory.")] = False,
    allow_pickle: Annotated[bool, typer.Option("--allow-pickle", help="Load .bin/.pt weights with "
                                               "torch.load(weights_only=True).")] = False,
    rehash_source: Annotated[bool, typer.Option("--rehash-source", help="Hash hub-downloaded source files "
                                                "too, instead of trusting the sha256 the hub client recorded "
                                                "(blobs/<sha256> names, --local-dir metadata).")] = False,
    fmt: FormatOpt = "text",
) -> None:
    from rich.progress import (BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn,
                               TransferSpeedColumn)

    from adapt.shard import shard
    from adapt.shard.planner import parse_size

    check_choice(fmt, ("text", "json"), "--format")
    degrees = dict(tp=tp, pp=pp, ep=ep, dp=dp)
    if plan is not None and any(v is not None for v in degrees.values()):
        raise ShardError("give either --plan or --tp/--pp/--ep/--dp, not both")
    bar = Progress(TextColumn("shard"), BarColumn(), DownloadColumn(), TransferSpeedColumn(), TimeRemainingColumn(),
                   console=err_console, transient=False)
    task = bar.add_task("shard", total=None)

    def progress(delta: int, total: int) -> None:
        if not bar.live.is_started:  # only once validation passed and writing begins
            bar.start()
        bar.update(task, advance=delta, total=total)

    try:
        result = shard(ckpt, out, plan_file=plan, **{k: v or 1 for k, v in degrees.items()}, dtype=dtype,
                       max_file_size=parse_size(max_file_size), workers=workers,
                       memory_budget=parse_size(memory_budget, "--memory-budget"), force=force, allow_pickle=allow_pickle,
                       trust_hub_cache=not rehash_source, progress=progress, quantize=quantize,
                       group_size=group_size, quantize_lm_head=quantize_lm_head, activations=activations)
    finally:
        if bar.live.is_started:
            bar.stop()
    s = result.to_dict()
    if fmt == "json":
        emit(to_json(s), None)
        return
    d = s["plan"]
    emit(f"sharded {ckpt} -> {out}: tp{d['tp']} pp{d['pp']} ep{d['ep']} dp{d['dp']}, {s['world_size']} ranks, "
         f"{s['files']} files ({s['files_written']} written, {s['files_kept']} kept), "
         f"{s['bytes_total'] / 1e9:.3f} GB, {s['seconds']:.2f} s, {s['gb_per_s']:.2f} GB/s, dtype {s['dtype']}, "
         f"{s['workers']} worker{'s' if s['workers'] != 1 else ''}" + (f", {s['io']}" if s["io"] else "")
         + (f", sha256: {s['hash']}" if s["hash"] else ""), None)


@shard_app.command("verify", help="Check OUT against its manifest (completeness, sizes, sha256); with --source, "
                                  "re-assemble every tensor and compare it with the checkpoint.")
def verify_cmd(
    out: Annotated[Path, typer.Argument(help="A directory written by `adapt shard`.")],
    source: Annotated[Optional[Path], typer.Option("--source", help="The checkpoint it was sharded from.")] = None,
    allow_pickle: Annotated[bool, typer.Option("--allow-pickle", help="The source holds .bin/.pt weights.")] = False,
    fmt: FormatOpt = "text",
) -> None:
    from adapt.shard import verify

    check_choice(fmt, ("text", "json"), "--format")
    with err_console.status("verifying"):
        rep = verify(out, source, allow_pickle=allow_pickle)
    if fmt == "json":
        emit(to_json(rep.to_dict()), None)
    else:
        lines = [p.line() for p in rep.problems]
        what = f"{rep.files_checked} files" + (f", {rep.tensors_compared} tensors compared with the source"
                                               if rep.source_checked else "")
        lines.append(f"OK: {what}" if rep.ok else f"FAILED: {len(rep.problems)} problems ({what})")
        emit("\n".join(lines), None)
    if not rep.ok:
        raise typer.Exit(1)


def register(app: typer.Typer) -> None:
    app.add_typer(shard_app, name="shard")
