"""adapt's runtime (``adapt.runtime.engine.Engine``) behind ``target.ModelRunner``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from adapt.errors import ValidationInputError


def open_engine_runner(path: Path, device: str = "cpu", dtype: str = "float32") -> tuple[Any, Any, dict[str, float]]:
    """(runner, engine, stage timings) for TARGET on adapt's runtime."""
    raise ValidationInputError("adapt's runtime engine has not landed; use --runtime transformers")


def decode_logits_with_kv(target: Any, ids: list[int], kv_dtype: str | None = None):
    """Teacher-forced decode logits [T, V] of ``ids`` with the KV cache in ``kv_dtype``; None if unsupported."""
    return None
