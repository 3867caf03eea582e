"""`adapt day0 [MODEL] --out DIR`: the whole bring-up chain, every artifact in DIR."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from adapt.cli.output import err_console, note_cpu_kernel_build


def day0_cmd(
    model: Annotated[Optional[str], typer.Argument(help="HF checkpoint directory (default: write the built-in "
                                                   "tiny-k2 with `adapt init-model` first).")] = None,
    out: Annotated[Path, typer.Option("--out", "-o", help="Directory for every artifact.")] = Path("day0"),
    device: Annotated[Optional[str], typer.Option("--device", help="Torch device for run and validate "
                                                  "(default: the accelerator present, else cpu).")] = None,
    dtype: Annotated[str, typer.Option("--dtype", help="float32 | bfloat16 | float16")] = "float32",
    checklist: Annotated[Optional[Path], typer.Option("--checklist", help="Checklist for the validate stage "
                                                      "(default: day0).")] = None,
) -> None:
    """profile -> plan -> shard -> run -> validate -> report; each stage logged with its time and artifact."""
    from adapt.day0 import day0

    import torch

    note_cpu_kernel_build(device or ("cpu" if not torch.cuda.is_available() else "cuda"))  # day0's default device
    res = day0(model, out, log=lambda s: err_console.print(s, markup=False, highlight=False), device=device,
               dtype=dtype, checklist=checklist)
    err_console.print(f"day0 finished in {res.seconds:.1f}s, exit {res.exit_code}: {res.out}/day0.md, "
                      f"{res.out}/validate/report.html", markup=False, highlight=False)
    raise typer.Exit(res.exit_code)


def register(app: typer.Typer) -> None:
    app.command("day0")(day0_cmd)
