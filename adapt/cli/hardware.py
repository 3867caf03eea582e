"""`adapt hardware list`: the built-in accelerator specs (adapt/profile/hardware/*.yaml)."""

from __future__ import annotations

import typer
from rich.console import Console
from rich.table import Table

from adapt.cli.options import FormatOpt, OutOpt
from adapt.cli.output import check_choice, emit, to_json
from adapt.hardware import HARDWARE_DIR, list_hardware

hardware_app = typer.Typer(help="Accelerator specs used by profile and plan.", no_args_is_help=True)


def _tb(x: float) -> str:
    return f"{x / 1e12:g}"


@hardware_app.command("list")
def list_cmd(fmt: FormatOpt = "table", out: OutOpt = None) -> None:
    """List the built-in hardware specs (pass a name, or your own YAML file, to --hardware)."""
    check_choice(fmt, ("table", "json"), "--format")
    specs = list_hardware()
    if fmt == "json":
        emit(to_json([{"id": _stem(h.name), "name": h.name, "vendor": h.vendor, "memory_bytes": h.memory_bytes,
                       "memory_bandwidth": h.memory_bandwidth, "flops": h.flops,
                       "ridge_point_bf16": h.ridge_point("bfloat16"),
                       "intra_node_bandwidth": h.intra_node_bandwidth,
                       "inter_node_bandwidth": h.inter_node_bandwidth, "devices_per_node": h.devices_per_node,
                       "source": h.source} for h in specs]), out)
        return
    t = Table(header_style="bold")
    for c in ("id", "name", "vendor", "memory GB", "HBM TB/s", "bf16 TFLOP/s", "fp8 TFLOP/s", "ridge bf16",
              "intra-node GB/s", "inter-node GB/s"):
        t.add_column(c, justify="left" if c in ("id", "name", "vendor") else "right")
    for h in specs:
        fp8 = h.flops.get("float8_e4m3fn")
        t.add_row(_stem(h.name), h.name, h.vendor, f"{h.memory_bytes / 1e9:.0f}", f"{h.memory_bandwidth / 1e12:.3g}",
                  f"{h.peak_flops('bfloat16') / 1e12:.4g}", f"{fp8 / 1e12:.4g}" if fp8 else "-",
                  f"{h.ridge_point('bfloat16'):.0f}", f"{h.intra_node_bandwidth / 1e9:.0f}",
                  f"{h.inter_node_bandwidth / 1e9:.0f}")
    console = Console()
    if not console.is_terminal:  # piped: no 80-column wrapping
        console = Console(width=160)
    console.print(t)
    console.print(f"Your own accelerator: copy {HARDWARE_DIR / 'template.yaml'} and pass --hardware FILE.",
                  highlight=False, soft_wrap=True)


def _stem(name: str) -> str:
    for f in HARDWARE_DIR.glob("*.yaml"):
        if f.name == "template.yaml":
            continue
        import yaml

        try:
            if str(yaml.safe_load(f.read_text()).get("name")) == name:
                return f.stem
        except Exception:  # a broken file is reported by list_hardware itself
            continue
    return name


def register(app: typer.Typer) -> None:
    app.add_typer(hardware_app, name="hardware")
