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


def to_json(data: Any) -> str:
    return json.dumps(data, indent=2, sort_keys=False, default=str)


def check_choice(value: str, choices: tuple[str, ...], option: str) -> str:
    if value not in choices:
        raise AdaptError(f"{option} must be one of {', '.join(choices)}; got {value!r}")
    return value
