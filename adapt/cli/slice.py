"""`adapt slice MODEL --out DIR --layers 0-3 [--experts 0-15] [--keep-mtp]` and `adapt slice verify DIR`."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer
from typer.core import TyperGroup

from adapt.cli.options import FormatOpt
from adapt.cli.output import check_choice, err_console, to_json


class _DefaultToRun(TyperGroup):
    """`adapt slice MODEL ...` runs the hidden `run` command; `adapt slice verify DIR` runs verify."""

    def parse_args(self, ctx, args):
        if args and args[0] not in self.commands and args[0] not in ("--help", "-h"):
            args = ["run", *args]
        return super().parse_args(ctx, args)


slice_app = typer.Typer(cls=_DefaultToRun, no_args_is_help=True, add_completion=False,
                        help="Cut a smaller checkpoint with the real weights of chosen layers and experts "
                             "(adapt slice MODEL --out DIR --layers 0-3 --experts 0-15), or verify one "
                             "(adapt slice verify DIR [--source MODEL]).")


@slice_app.command("run", help="Write DIR: the chosen layers (and experts) of MODEL renumbered from 0, an adjusted "
                               "config.json and slice.json (adjustments, each tensor's source and sha256).")
def run_cmd(
    model: Annotated[Path, typer.Argument(help="HF checkpoint directory (safetensors).")],
    out: Annotated[Path, typer.Option("--out", "-o", help="Slice directory to write.")],
    layers: Annotated[str, typer.Option("--layers", help="Decoder layers to keep, e.g. 0-3 or 0,1,5.")],
    experts: Annotated[Optional[str], typer.Option("--experts", help="Routed experts to keep in every MoE "
                                                   "layer, e.g. 0-15 (default: all).")] = None,
    keep_mtp: Annotated[bool, typer.Option("--keep-mtp", help="Keep the MTP (next-n prediction) layers.")] = False,
    force: Annotated[bool, typer.Option("--force", help="Replace an existing slice at --out.")] = False,
    fmt: FormatOpt = "text",
) -> None:
    from adapt.shard.slice import slice_checkpoint
    from adapt.shard.slice_config import parse_ids
    from adapt.source import read_config
    from adapt.spec import ModelSpec

    check_choice(fmt, ("text", "json"), "--format")
    if not (model / "config.json").is_file():
        raise typer.BadParameter(f"{model} is not a checkpoint directory (no config.json)")
    spec = ModelSpec.from_hf_config(read_config(model / "config.json"))
    keep = parse_ids(layers, "layers", spec.num_layers)
    exp = parse_ids(experts, "experts", spec.moe.num_experts if spec.moe else 0) if experts is not None else None
    doc = slice_checkpoint(model, out, keep, exp, keep_mtp=keep_mtp, force=force)
    if fmt == "json":
        typer.echo(to_json({k: doc[k] for k in ("source", "layers", "experts", "keep_mtp", "adjustments")}
                           | {"tensors": len(doc["tensors"]), "files": len(doc["files"])}))
    for a in doc["adjustments"]:
        err_console.print(f"config {a['key']}: {a['from']} -> {a['to']} ({a['why']})", markup=False,
                          highlight=False)
    err_console.print(f"wrote {out}: {len(keep)} layers, {len(doc['tensors'])} tensors, slice.json",
                      markup=False, highlight=False)


@slice_app.command("verify", help="Re-hash a slice's files and tensors; with --source re-read every source "
                                  "tensor and check the slice holds its bytes.")
def verify_cmd(
    out: Annotated[Path, typer.Argument(help="Slice directory (with slice.json).")],
    source: Annotated[Optional[Path], typer.Option("--source", help="The checkpoint it was cut from.")] = None,
    fmt: FormatOpt = "text",
) -> None:
    from adapt.shard.slice import verify_slice

    check_choice(fmt, ("text", "json"), "--format")
    res = verify_slice(out, source)
    if fmt == "json":
        typer.echo(to_json(res))
    err_console.print(f"ok: {res['files']} files, {res['tensors']} tensors"
                      + (f", each the bytes of {source}" if source is not None else ""), markup=False,
                      highlight=False)


def register(app: typer.Typer) -> None:
    app.add_typer(slice_app, name="slice")
