"""Writing command output: machine-readable documents to stdout alone, or atomically to a file."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from rich.console import Console

from adapt.errors import AdaptError
from adapt.fileio import atomic_write  # noqa: F401  (re-exported for the commands)

# Logs, progress and warnings go to stderr so that `adapt ... --format json | jq` always works.
err_console = Console(stderr=True)


def emit(text: str, out: Path | None) -> None:
    """Send a rendered document to ``out`` (atomically) or to stdout."""
    if out is not None:
        atomic_write(out, text if text.endswith("\n") else text + "\n")
        err_console.print(f"wrote {out}")
    else:
        sys.stdout.write(text if text.endswith("\n") else text + "\n")
        sys.stdout.flush()


def note_cpu_kernel_build(device: str, kernels: str = "auto") -> None:
    """One line on stderr when this run will first compile the fused CPU kernels for the host."""
    if kernels not in ("auto", "adapt", "cpu") or not str(device).startswith("cpu"):
        return
    from adapt.runtime import cpu_kernels

    if cpu_kernels.needs_build():
        err_console.print("building the fused CPU kernels for this host (once, ~30 s on 2 cores; "
                          "ADAPT_CPU_KERNELS=0 skips them)", highlight=False)


def to_json(data: Any) -> str:
    return json.dumps(data, indent=2, sort_keys=False, default=str)


def check_choice(value: str, choices: tuple[str, ...], option: str) -> str:
    if value not in choices:
        raise AdaptError(f"{option} must be one of {', '.join(choices)}; got {value!r}")
    return value
