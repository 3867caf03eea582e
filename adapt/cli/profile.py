"""`adapt profile MODEL`: per-module FLOPs, bytes and roofline time, memory footprint, TTFT / TPOT."""

from __future__ import annotations

import io
from typing import Annotated

import typer
from rich import box
from rich.console import Console
from rich.table import Table

from adapt.cli.options import ContextOpt, FormatOpt, HardwareOpt, KvDtypeOpt, ModelArg, OutOpt, WeightsDtypeOpt
from adapt.cli.output import check_choice, emit, to_json
from adapt.hardware import load_hardware
from adapt.source import resolve_model

FORMATS = ("table", "json", "csv", "md", "html")


def render_table(profile, console: Console) -> None:
    """Print the summary and one aggregated table per phase; narrow consoles drop the shape/byte split."""
    from adapt.profile.render import HEADERS, NARROW_HEADERS, phases, summary_lines, table_rows

    wide = console.width >= 180
    drop = set() if console.width >= 120 else {"op", "share"}
    headers = HEADERS if wide else [h for h in NARROW_HEADERS if h not in drop]
    for label, value in summary_lines(profile):
        console.print(f"[bold]{label}[/bold]: {value}", highlight=False, soft_wrap=True)
    for ph in phases(profile):
        t = Table(title=ph, title_justify="left", header_style="bold", pad_edge=False,
                  box=box.HEAVY_HEAD if wide else box.SIMPLE_HEAD)
        for h in headers:
            t.add_column(h, justify="left" if h in ("layers", "module", "op") else "right",
                         no_wrap=wide or h not in ("layers", "module"), overflow="fold",
                         min_width={"layers": 12, "module": 20}.get(h) if not wide else None)
        for row in table_rows(profile, ph):
            style = {"compute": "yellow", "memory": "cyan"}.get(row["bound"])
            t.add_row(*[f"[{style}]{row[h]}[/{style}]" if (h == "bound" and style) else row[h] for h in headers])
        console.print(t)


def profile_cmd(
    model: ModelArg,
    hardware: HardwareOpt = "h100-sxm",
    phase: Annotated[str, typer.Option("--phase", help="prefill | decode | both")] = "both",
    batch: Annotated[int, typer.Option("--batch", "-b", min=1, help="Sequences in the batch.")] = 1,
    context: ContextOpt = 4096,
    weights_dtype: WeightsDtypeOpt = None,
    kv_dtype: KvDtypeOpt = "bfloat16",
    fmt: FormatOpt = "table",
    out: OutOpt = None,
) -> None:
    """Profile MODEL on an accelerator: per-module FLOPs, bytes, roofline time; memory; TTFT and TPOT."""
    from adapt.profile import PHASES, profile_model
    from adapt.profile.render import to_csv, to_html, to_markdown

    check_choice(fmt, FORMATS, "--format")
    check_choice(phase, PHASES, "--phase")
    hw = load_hardware(hardware)
    spec = resolve_model(model).spec()
    prof = profile_model(spec, hw, phase=phase, batch=batch, context=context, weights_dtype=weights_dtype,
                         kv_dtype=kv_dtype)
    if fmt == "table":
        if out is None:
            console = Console()
            render_table(prof, console if console.is_terminal else Console(width=200))  # piped: no 80-col wrap
            return
        console = Console(record=True, width=200, file=io.StringIO())
        render_table(prof, console)
        text = console.export_text()
    else:
        text = {"json": lambda: to_json(prof.to_dict()), "csv": lambda: to_csv(prof), "md": lambda: to_markdown(prof),
                "html": lambda: to_html(prof)}[fmt]()
    emit(text, out)


def register(app: typer.Typer) -> None:
    app.command("profile")(profile_cmd)
