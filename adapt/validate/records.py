"""Typed validation records: the JSON written first, of which HTML, JUnit and Markdown are renderings.

Non-finite floats (a NaN cosine is a real result) are stored as the strings ``"NaN"``, ``"Infinity"``
and ``"-Infinity"`` so report.json stays strict JSON; ``from_json`` turns them back into floats.
"""

from __future__ import annotations

import json
import math
import platform
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, fields
from datetime import datetime, timezone
from typing import Any

from adapt.errors import ValidationInputError

STATUSES = ("pass", "fail", "skip", "error")
SCHEMA_VERSION = 1
_NONFINITE = {"NaN": math.nan, "Infinity": math.inf, "-Infinity": -math.inf}


def encode_value(v: Any) -> Any:
    """JSON-safe copy of ``v``: non-finite floats become strings, tuples become lists."""
    if isinstance(v, float) and not math.isfinite(v):
        return "NaN" if math.isnan(v) else ("Infinity" if v > 0 else "-Infinity")
    if isinstance(v, Mapping):
        return {str(k): encode_value(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [encode_value(x) for x in v]
    return v


def decode_value(v: Any) -> Any:
    """Inverse of :func:`encode_value`."""
    if isinstance(v, str) and v in _NONFINITE:
        return _NONFINITE[v]
    if isinstance(v, Mapping):
        return {k: decode_value(x) for k, x in v.items()}
    if isinstance(v, list):
        return [decode_value(x) for x in v]
    return v


def _only_known(cls: type, d: Mapping[str, Any], where: str) -> None:
    if not isinstance(d, Mapping):
        raise ValidationInputError(f"{where}: expected an object, got {type(d).__name__}")
    unknown = set(d) - {f.name for f in fields(cls)}
    if unknown:
        raise ValidationInputError(f"{where}: unknown field {sorted(unknown)[0]!r}")


@dataclass
class ItemResult:
    """The outcome of one checklist item."""

    id: str
    section: str
    title: str
    status: str
    required: bool = True
    metrics: dict[str, Any] = field(default_factory=dict)
    thresholds: dict[str, float] = field(default_factory=dict)
    message: str = ""
    duration_s: float = 0.0

    def __post_init__(self) -> None:
        if self.status not in STATUSES:
            raise ValidationInputError(f"item {self.id!r}: status {self.status!r} is not one of {STATUSES}")

    def to_dict(self) -> dict[str, Any]:
        return encode_value(asdict(self))

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> ItemResult:
        _only_known(cls, d, f"item {d.get('id', '?') if isinstance(d, Mapping) else '?'}")
        try:
            return cls(**decode_value(dict(d)))
        except TypeError as e:
            raise ValidationInputError(f"item {d.get('id', '?')!r}: {e}") from None


@dataclass
class Regression:
    """A difference from a signed baseline that fails the run.

    ``kind``: ``"metric"`` (a metric moved past its tolerance), ``"status"`` (pass->fail, skip->fail, ...)
    or ``"missing"`` (a required item of the baseline is absent from the report).
    """

    item_id: str
    kind: str
    message: str
    metric: str | None = None
    baseline: Any = None
    current: Any = None
    bound: float | None = None

    def to_dict(self) -> dict[str, Any]:
        return encode_value(asdict(self))

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Regression:
        _only_known(cls, d, "regression")
        return cls(**decode_value(dict(d)))


def summarize(items: list[ItemResult]) -> dict[str, Any]:
    """Counts per status, per section (in first-seen order) and of required items that fail the run."""
    by_status = {s: 0 for s in STATUSES}
    by_section: dict[str, dict[str, int]] = {}
    for it in items:
        by_status[it.status] += 1
        by_section.setdefault(it.section, {s: 0 for s in STATUSES})[it.status] += 1
    failing = sum(1 for it in items if it.required and it.status in ("fail", "error"))
    return {"total": len(items), "by_status": by_status, "by_section": by_section, "required_failing": failing}


def collect_environment(
    *,
    device: str = "cpu",
    dtype: str = "float32",
    model: str = "",
    plan: Mapping[str, Any] | str | None = None,
    manifest_hash: str | None = None,
    checkpoint_hash: str | None = None,
    reference: str = "",
    **extra: Any,
) -> dict[str, Any]:
    """The environment block of a report: versions, device, dtype, plan, hashes, model, reference."""
    import torch

    import adapt

    env: dict[str, Any] = {
        "adapt_version": adapt.__version__,
        "torch_version": torch.__version__,
        "python_version": platform.python_version(),
        "platform": platform.platform(),
        "device": device,
        "dtype": dtype,
        "model": model,
        "plan": plan,
        "manifest_hash": manifest_hash,
        "checkpoint_hash": checkpoint_hash,
        "reference": reference,
    }
    env.update(extra)
    return env


def _utc_now() -> str:
    return datetime.now(timezone.utc).replace(microsecond=0).isoformat().replace("+00:00", "Z")


@dataclass
class Report:
    """A whole validation run. ``summary`` is derived from ``items`` and never stored separately."""

    items: list[ItemResult]
    environment: dict[str, Any] = field(default_factory=dict)
    first_divergence: dict[str, Any] | None = None  # {"layer": int, "module": str}
    layer_curve: list[dict[str, Any]] = field(default_factory=list)  # compare.layer_error_growth output
    regressions: list[Regression] = field(default_factory=list)
    checklist: str = ""
    created_utc: str = field(default_factory=_utc_now)
    schema_version: int = SCHEMA_VERSION

    @property
    def summary(self) -> dict[str, Any]:
        return summarize(self.items)

    def to_dict(self) -> dict[str, Any]:
        return {
            "schema_version": self.schema_version,
            "created_utc": self.created_utc,
            "checklist": self.checklist,
            "summary": self.summary,
            "items": [it.to_dict() for it in self.items],
            "first_divergence": encode_value(self.first_divergence),
            "layer_curve": encode_value(self.layer_curve),
            "regressions": [r.to_dict() for r in self.regressions],
            "environment": encode_value(self.environment),
            "exit_code": exit_code(self),
        }

    def to_json(self, indent: int | None = 2) -> str:
        return json.dumps(self.to_dict(), indent=indent, allow_nan=False, ensure_ascii=False)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Report:
        if not isinstance(d, Mapping):
            raise ValidationInputError("report: expected a JSON object")
        version = d.get("schema_version", SCHEMA_VERSION)
        if version != SCHEMA_VERSION:
            raise ValidationInputError(f"report: schema_version {version!r} is not {SCHEMA_VERSION}")
        items = d.get("items")
        if not isinstance(items, list):
            raise ValidationInputError("report: 'items' must be a list")
        fd = d.get("first_divergence")
        if fd is not None and not (isinstance(fd, Mapping) and {"layer", "module"} <= set(fd)):
            raise ValidationInputError("report: first_divergence needs 'layer' and 'module'")
        return cls(
            items=[ItemResult.from_dict(x) for x in items],
            environment=decode_value(dict(d.get("environment") or {})),
            first_divergence=decode_value(fd),
            layer_curve=decode_value(list(d.get("layer_curve") or [])),
            regressions=[Regression.from_dict(x) for x in d.get("regressions") or []],
            checklist=str(d.get("checklist", "")),
            created_utc=str(d.get("created_utc", "")),
        )

    @classmethod
    def from_json(cls, text: str) -> Report:
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValidationInputError(f"report: not valid JSON ({e.msg} at line {e.lineno})") from None
        return cls.from_dict(data)


def exit_code(report: Report) -> int:
    """0 when every required item passes or skips and nothing regressed; 1 otherwise.

    A required item with status ``error`` is a failure too (the check could not establish a pass);
    ``skip`` never fails; items with ``required=False`` never fail the run. Exit 2 (could not run at all)
    is raised as ``ValidationInputError`` before a report exists.
    """
    if report.regressions:
        return 1
    return 1 if any(it.required and it.status in ("fail", "error") for it in report.items) else 0
