"""`adapt ops MODEL`: which kernel runs each op of the model on a device (the operator-mapping table)."""

from __future__ import annotations

from typing import Annotated

import typer

from adapt.cli.options import KERNELS_HELP, DtypeOpt, FormatOpt, ModelArg, OutOpt
from adapt.cli.output import check_choice, emit, to_json

FORMATS = ("table", "json", "md")


def ops_cmd(
    model: ModelArg,
    device: Annotated[str, typer.Option("--device", help="A torch device type: cpu, cuda, xpu, npu, ... "
                                        "(it need not exist here).")] = "cpu",
    dtype: DtypeOpt = "bfloat16",
    kernels: Annotated[str, typer.Option("--kernels", help=KERNELS_HELP)] = "auto",
    fmt: FormatOpt = "table",
    out: OutOpt = None,
) -> None:
    """For every op MODEL needs: the layers running it, the implementation picked on DEVICE in DTYPE, the
    backends offering it, and whether it falls back to torch. JSON: {"ops": [{"op", "layers", "impl", ...}]}."""
    import re

    from adapt.errors import RuntimeConfigError
    from adapt.runtime.backends.table import layer_ranges, op_table, to_markdown
    from adapt.runtime.engine import resolve_dtype
    from adapt.source import resolve_model

    check_choice(fmt, FORMATS, "--format")
    if not re.fullmatch(r"[a-z][a-z0-9_]*(:\d+)?", device):  # npu, musa, ...: no torch backend needed here
        raise RuntimeConfigError(f"--device {device!r} is not a device string (a type such as cuda or npu, "
                                 "optionally :INDEX)")
    table = op_table(resolve_model(model).spec(), device, resolve_dtype(dtype), kernels)
    if fmt == "json":
        return emit(to_json(table), out)
    if fmt == "md":
        return emit(to_markdown(table), out)
    from rich.console import Console
    from rich.table import Table

    t = Table(title=f"{table['model']} on {device} in {table['dtype']} (--kernels {kernels})")
    for h in ("op", "layers", "impl", "form", "candidates", "fallback"):
        t.add_column(h)
    for r in table["ops"]:
        t.add_row(r["op"], layer_ranges(r["layers"]), r["impl"], r["form"], ", ".join(r["candidates"]),
                  "torch" if r["fallback"] else "")
    console = Console(record=out is not None, width=160)
    console.print(t)
    for b in table["backends"]:
        if not b["available"]:
            console.print(f"{b['name']}: {b['why']}", highlight=False)
    for e in table["plugin_errors"]:
        console.print(e, highlight=False)
    if out is not None:
        emit(console.export_text(), out)


def register(app: typer.Typer) -> None:
    app.command("ops")(ops_cmd)
