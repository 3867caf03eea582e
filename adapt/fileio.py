"""File helpers every stage shares: atomic writes and YAML reads with one-line errors."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any

import yaml

from adapt.errors import AdaptError


def cache_root() -> Path:
    """$ADAPT_CACHE, or ~/.cache/adapt."""
    return Path(os.environ.get("ADAPT_CACHE") or Path.home() / ".cache" / "adapt").expanduser()


def atomic_write(path: str | Path, data: str | bytes) -> None:
    """Write to a temporary file beside path, fsync, then rename: a reader sees the old file or the whole
    new one, never a part."""
    path = Path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    except OSError as e:
        raise AdaptError(f"cannot write {path}: {e.strerror}") from e
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data.encode("utf-8") if isinstance(data, str) else data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def read_yaml(path: str | Path, error: type[AdaptError], what: str) -> Any:
    """safe_load a YAML file; unreadable or malformed raises ``error`` with one line naming the file."""
    p = Path(path)
    try:
        return yaml.safe_load(p.read_text())
    except OSError as e:
        raise error(f"cannot read {what} file {p}: {e.strerror}") from e
    except yaml.YAMLError as e:
        raise error(f"{p}: malformed YAML ({str(e).splitlines()[0]})") from e
