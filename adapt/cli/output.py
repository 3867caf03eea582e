"""Writing command output: machine-readable documents to stdout alone, or atomically to a file."""

from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

from rich.console import Console

from adapt.errors import AdaptError

# Logs, progress and warnings go to stderr so that `adapt ... --format json | jq` always works.
err_console = Console(stderr=True)


def atomic_write(path: Path, data: str | bytes) -> None:
    """Write to a temporary file beside path, fsync, then rename: never a half-written file."""
    path = Path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    except OSError as e:
        raise AdaptError(f"cannot write {path}: {e.strerror}") from e
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data.encode() if isinstance(data, str) else data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


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
