"""`adapt profile MODEL`: per-module FLOPs, bytes and roofline time, memory footprint, TTFT / TPOT."""

from __future__ import annotations

import io
from typing import Annotated

import typer
from rich import box
from rich.console import Console
from rich.measure import Measurement
from rich.table import Table

from adapt.cli.options import ContextOpt, FormatOpt, HardwareOpt, KvDtypeOpt, ModelArg, OutOpt, WeightsDtypeOpt
from adapt.cli.output import check_choice, emit, to_json
from adapt.hardware import load_hardware
from adapt.source import resolve_model

FORMATS = ("table", "json", "csv", "md", "html")


# Columns a narrower console gives up first, in this order; the last set standing is the narrowest table.
DROP_ORDER = ("activations", "KV", "weights", "input", "output", "share", "count", "op", "bytes")
TEXT_COLUMNS = ("layers", "module", "op")


def _table(ph: str, rows: list[dict[str, str]], headers: list[str], boxed: bool) -> Table:
    """One phase's table; every cell stays whole (no_wrap): a number and its unit are never cut or folded."""
    t = Table(title=ph, title_justify="left", header_style="bold", pad_edge=False,
              box=box.HEAVY_HEAD if boxed else box.SIMPLE_HEAD)
    for h in headers:
        t.add_column(h, justify="left" if h in TEXT_COLUMNS else "right", no_wrap=True)
    for row in rows:
        style = {"compute": "yellow", "memory": "cyan"}.get(row["bound"])
        t.add_row(*[f"[{style}]{row[h]}[/{style}]" if (h == "bound" and style) else row[h] for h in headers])
    return t


def _width(console: Console, table: Table) -> int:
    """Columns the table needs with every cell whole."""
    return Measurement.get(console, console.options.update(width=10_000), table).maximum


def table_layout(console: Console, rows: list[dict[str, str]], headers: list[str]) -> tuple[list[str], bool] | None:
    """The widest column set whose table fits the console, dropping columns in DROP_ORDER; None when even the
    narrowest does not fit (the caller then prints one record per row)."""
    cols = list(headers)
    for drop in (None,) + DROP_ORDER:
        if drop is not None:
            cols = [h for h in cols if h != drop]
        for boxed in (True, False):
            if _width(console, _table("", rows, cols, boxed)) <= console.width:
                return cols, boxed
    return None


def _records(console: Console, ph: str, rows: list[dict[str, str]], headers: list[str]) -> None:
    """One row per block, its fields packed into lines of the console's width, each field whole."""
    console.print(f"[bold]{ph}[/bold]", highlight=False)
    for row in rows:
        console.print(" ".join(row[h] for h in ("layers", "module") if row[h]) + f" ({row['op']})", highlight=False,
                      overflow="fold")  # names may wrap; the figures below never do
        line, fields = "  ", [f"{h} {row[h]}" for h in headers if h not in TEXT_COLUMNS]
        for f in fields:
            if len(line) > 2 and len(line) + 2 + len(f) > console.width:
                console.print(line, highlight=False, soft_wrap=True)
                line = "  "
            line += ("  " if len(line) > 2 else "") + f
        console.print(line, highlight=False, soft_wrap=True)


def render_table(profile, console: Console) -> None:
    """Print the summary and one aggregated table per phase, as wide as the console allows: columns are dropped
    (the byte split and shapes first) before any cell would be cut, and a console too narrow for the narrowest
    table gets one record per row."""
    from adapt.profile.render import HEADERS, phases, summary_lines, table_rows

    for label, value in summary_lines(profile):
        console.print(f"[bold]{label}[/bold]: {value}", highlight=False, soft_wrap=True)
    for ph in phases(profile):
        rows = table_rows(profile, ph)
        layout = table_layout(console, rows, HEADERS)
        if layout is None:
            _records(console, ph, rows, HEADERS)
        else:
            console.print(_table(ph, rows, *layout))


def full_width(profile) -> int:
    """Columns the full table needs: a pipe or a file gets every column, uncut."""
    from adapt.profile.render import HEADERS, phases, table_rows

    probe = Console(width=10_000, file=io.StringIO())
    return max([80] + [_width(probe, _table("", table_rows(profile, ph), HEADERS, True)) for ph in phases(profile)])


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
            render_table(prof, console if console.is_terminal else Console(width=full_width(prof)))
            return
        console = Console(record=True, width=full_width(prof), file=io.StringIO())
        render_table(prof, console)
        text = console.export_text()
    else:
        text = {"json": lambda: to_json(prof.to_dict()), "csv": lambda: to_csv(prof), "md": lambda: to_markdown(prof),
                "html": lambda: to_html(prof)}[fmt]()
    emit(text, out)


def register(app: typer.Typer) -> None:
    app.command("profile")(profile_cmd)
