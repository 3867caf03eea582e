"""Checklists are data: a YAML file of sections and items, and a registry of check functions by kind.

File format (``adapt/checklists/day0.yaml`` is the reference)::

    name: day0
    description: ...
    sections:
      - id: text_inference
        title: Text inference
        items:
          - id: prefill_logits
            title: Prefill logits vs reference
            kind: end_to_end              # the registered check function that runs it
            required: true                # default true
            params: {compare: logits}     # passed to the check as-is
            thresholds:                   # per dtype; "default" is merged under the dtype's own
              default:  {cosine_min: 0.99}
              float32:  {max_abs_max: 1.0e-4}

Threshold names end in ``_min`` (metric must be >= value) or ``_max`` (metric must be <= value); the
metric is the name without the suffix. A check function has the signature
``fn(params, thresholds, context) -> Outcome | ItemResult | dict | Skip`` and may raise ``Skip``.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

import yaml

from adapt.errors import ValidationInputError
from adapt.validate.records import STATUSES, ItemResult

DTYPES = ("float32", "bfloat16", "float16", "float8_e4m3fn", "int8")
_DTYPE_ALIASES = {
    "fp32": "float32", "float": "float32", "f32": "float32",
    "bf16": "bfloat16",
    "fp16": "float16", "half": "float16", "f16": "float16",
    "fp8": "float8_e4m3fn", "float8": "float8_e4m3fn",
}
_TOP_KEYS = {"name", "description", "version", "sections"}
_SECTION_KEYS = {"id", "title", "description", "required", "items"}
_ITEM_KEYS = {"id", "title", "kind", "params", "thresholds", "required", "description"}


@dataclass(frozen=True)
class ChecklistItem:
    id: str
    section: str
    title: str
    kind: str
    required: bool = True
    params: Mapping[str, Any] = field(default_factory=dict)
    thresholds: Mapping[str, Mapping[str, float]] = field(default_factory=dict)
    description: str = ""


@dataclass(frozen=True)
class Section:
    id: str
    title: str
    items: tuple[ChecklistItem, ...]
    description: str = ""


@dataclass(frozen=True)
class Checklist:
    name: str
    sections: tuple[Section, ...]
    path: str = ""
    description: str = ""

    def items(self) -> Iterator[ChecklistItem]:
        for s in self.sections:
            yield from s.items

    def item(self, item_id: str) -> ChecklistItem:
        for it in self.items():
            if it.id == item_id:
                return it
        raise KeyError(item_id)


def normalize_dtype(dtype: Any) -> str:
    """``torch.bfloat16``, ``"torch.bfloat16"``, ``"bf16"`` -> ``"bfloat16"``."""
    s = str(dtype).removeprefix("torch.").lower()
    return _DTYPE_ALIASES.get(s, s)


def default_checklist_path() -> Path:
    """The day-0 checklist shipped with adapt."""
    return Path(str(resources.files("adapt") / "checklists" / "day0.yaml"))


def _fail(where: str, what: str) -> ValidationInputError:
    return ValidationInputError(f"{where}: {what}")


def _check_keys(d: Any, allowed: set[str], where: str) -> None:
    if not isinstance(d, Mapping):
        raise _fail(where, f"expected a mapping, got {type(d).__name__}")
    unknown = sorted(set(map(str, d)) - allowed)
    if unknown:
        raise _fail(where, f"unknown key {unknown[0]!r} (allowed: {', '.join(sorted(allowed))})")


def _str(d: Mapping, key: str, where: str, default: str | None = None) -> str:
    v = d.get(key, default)
    if v is None:
        raise _fail(where, f"missing {key!r}")
    if not isinstance(v, str) or (key in ("id", "kind") and not v.strip()):
        raise _fail(where, f"{key!r} must be a non-empty string")
    return v


def _thresholds(raw: Any, where: str) -> dict[str, dict[str, float]]:
    if raw is None:
        return {}
    if not isinstance(raw, Mapping):
        raise _fail(where, "'thresholds' must map dtype -> {name: number}")
    out: dict[str, dict[str, float]] = {}
    for dt, block in raw.items():
        key = str(dt)
        if key != "default" and normalize_dtype(key) not in DTYPES:
            raise _fail(where, f"thresholds: unknown dtype {key!r} (use default or one of {', '.join(DTYPES)})")
        if not isinstance(block, Mapping):
            raise _fail(where, f"thresholds.{key} must map name -> number")
        vals: dict[str, float] = {}
        for name, v in block.items():
            name = str(name)
            if not (name.endswith("_min") or name.endswith("_max")):
                raise _fail(where, f"thresholds.{key}.{name}: name must end in _min or _max")
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
                raise _fail(where, f"thresholds.{key}.{name}: {v!r} is not a finite number")
            vals[name] = float(v)
        out["default" if key == "default" else normalize_dtype(key)] = vals
    return out


def parse_checklist(data: Any, path: str = "<checklist>") -> Checklist:
    """Validate a parsed YAML document strictly; errors name the file, item and field in one line."""
    _check_keys(data, _TOP_KEYS, path)
    raw_sections = data.get("sections")
    if not isinstance(raw_sections, list) or not raw_sections:
        raise _fail(path, "'sections' must be a non-empty list")
    seen: set[str] = set()
    sections = []
    for si, rs in enumerate(raw_sections):
        swhere = f"{path}: section #{si + 1}"
        if isinstance(rs, Mapping) and isinstance(rs.get("id"), str):
            swhere = f"{path}: section {rs['id']!r}"
        _check_keys(rs, _SECTION_KEYS, swhere)
        sid = _str(rs, "id", swhere)
        swhere = f"{path}: section {sid!r}"
        sreq = rs.get("required", True)
        if not isinstance(sreq, bool):
            raise _fail(swhere, "'required' must be true or false")
        raw_items = rs.get("items")
        if not isinstance(raw_items, list) or not raw_items:
            raise _fail(swhere, "'items' must be a non-empty list")
        items = []
        for ii, ri in enumerate(raw_items):
            iwhere = f"{path}: section {sid!r} item #{ii + 1}"
            if isinstance(ri, Mapping) and isinstance(ri.get("id"), str):
                iwhere = f"{path}: item {ri['id']!r}"
            _check_keys(ri, _ITEM_KEYS, iwhere)
            iid = _str(ri, "id", iwhere)
            iwhere = f"{path}: item {iid!r}"
            if iid in seen:
                raise _fail(iwhere, "duplicate id")
            seen.add(iid)
            kind = _str(ri, "kind", iwhere)
            req = ri.get("required", sreq)
            if not isinstance(req, bool):
                raise _fail(iwhere, "'required' must be true or false")
            params = ri.get("params") or {}
            if not isinstance(params, Mapping):
                raise _fail(iwhere, "'params' must be a mapping")
            items.append(ChecklistItem(
                id=iid, section=sid, title=_str(ri, "title", iwhere, default=iid), kind=kind, required=req,
                params=dict(params), thresholds=_thresholds(ri.get("thresholds"), iwhere),
                description=_str(ri, "description", iwhere, default=""),
            ))
        sections.append(Section(sid, _str(rs, "title", swhere, default=sid), tuple(items),
                                _str(rs, "description", swhere, default="")))
    return Checklist(_str(data, "name", path, default=Path(path).stem), tuple(sections), path,
                     _str(data, "description", path, default=""))


def load_checklist(path: str | Path | None = None) -> Checklist:
    """Load and validate a checklist YAML file (default: the shipped day0.yaml)."""
    p = Path(path) if path is not None else default_checklist_path()
    try:
        text = p.read_text(encoding="utf-8")
    except OSError as e:
        raise ValidationInputError(f"{p}: cannot read checklist ({e.strerror or e})") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        at = f" at line {mark.line + 1}" if mark is not None else ""
        raise ValidationInputError(f"{p}: not valid YAML{at}") from None
    return parse_checklist(data, str(p))


def thresholds_for(item: ChecklistItem, dtype: Any) -> dict[str, float]:
    """The thresholds that apply in ``dtype``: ``default`` with the dtype's own entries on top."""
    dt = normalize_dtype(dtype)
    return {**item.thresholds.get("default", {}), **item.thresholds.get(dt, {})}


def apply_thresholds(metrics: Mapping[str, Any], thresholds: Mapping[str, float]) -> list[str]:
    """One message per threshold the metrics break; NaN never satisfies a bound.

    Raises KeyError naming a threshold whose metric is missing (a checklist/check mismatch).
    """
    broken = []
    for name, bound in thresholds.items():
        metric, op = name[:-4], name[-3:]
        if metric not in metrics:
            raise KeyError(f"threshold {name!r} needs metric {metric!r}, which the check did not report")
        v = metrics[metric]
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise KeyError(f"threshold {name!r}: metric {metric!r} is {v!r}, not a number")
        ok = v >= bound if op == "min" else v <= bound
        if not ok:
            broken.append(f"{metric} = {v:.6g} {'<' if op == 'min' else '>'} {bound:.6g}")
    return broken


class Skip(Exception):
    """Raise or return from a check when its stage is missing; the item becomes ``skip`` with the reason."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


@dataclass
class Outcome:
    """What a check returns. ``status=None`` lets the thresholds decide (pass unless one is broken)."""

    metrics: dict[str, Any] = field(default_factory=dict)
    status: str | None = None
    message: str = ""


CheckFn = Callable[[Mapping[str, Any], Mapping[str, float], Any], Any]
_REGISTRY: dict[str, CheckFn] = {}


def register_check(kind: str, registry: dict[str, CheckFn] | None = None) -> Callable[[CheckFn], CheckFn]:
    """Decorator: ``@register_check("end_to_end") def fn(params, thresholds, context): ...``."""
    reg = _REGISTRY if registry is None else registry

    def deco(fn: CheckFn) -> CheckFn:
        old = reg.get(kind)
        if old is not None and old is not fn and getattr(old, "__qualname__", None) != fn.__qualname__:
            raise ValueError(f"check kind {kind!r} already registered by {old.__module__}.{old.__qualname__}")
        reg[kind] = fn
        return fn

    return deco


def registered_kinds() -> list[str]:
    return sorted(_REGISTRY)


def _one_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0]}" if text else type(e).__name__


def _to_result(out: Any, item: ChecklistItem, thr: Mapping[str, float]) -> ItemResult:
    base = dict(id=item.id, section=item.section, title=item.title, required=item.required,
                thresholds=dict(thr))
    if isinstance(out, Skip):
        return ItemResult(status="skip", message=out.reason, **base)
    if isinstance(out, ItemResult):
        return ItemResult(status=out.status, metrics=dict(out.metrics), message=out.message, **base)
    if isinstance(out, Mapping):
        out = Outcome(metrics=dict(out))
    if not isinstance(out, Outcome):
        return ItemResult(status="error", message=f"check returned {type(out).__name__}, not an Outcome", **base)
    metrics = dict(out.metrics)
    if out.status is not None:
        if out.status not in STATUSES:
            return ItemResult(status="error", metrics=metrics, message=f"check returned status {out.status!r}", **base)
        return ItemResult(status=out.status, metrics=metrics, message=out.message, **base)
    try:
        broken = apply_thresholds(metrics, thr)
    except KeyError as e:
        return ItemResult(status="error", metrics=metrics, message=str(e.args[0]), **base)
    msg = "; ".join(broken) if broken else out.message
    return ItemResult(status="fail" if broken else "pass", metrics=metrics, message=msg, **base)


def run_checklist(
    checklist: Checklist,
    context: Any,
    dtype: Any,
    registry: Mapping[str, CheckFn] | None = None,
    only: set[str] | None = None,
) -> list[ItemResult]:
    """Run every item (or those whose id or section is in ``only``) through its registered check.

    Never raises for a check's failure: an exception becomes ``error`` with its one-line message, an
    unknown kind becomes ``error`` naming it, ``Skip`` (raised or returned) becomes ``skip``.
    """
    reg = _REGISTRY if registry is None else registry
    results = []
    for item in checklist.items():
        if only is not None and item.id not in only and item.section not in only:
            continue
        thr = thresholds_for(item, dtype)
        fn = reg.get(item.kind)
        t0 = time.perf_counter()
        if fn is None:
            known = ", ".join(sorted(reg)) or "none"
            res = ItemResult(item.id, item.section, item.title, "error", item.required, thresholds=dict(thr),
                             message=f"unknown check kind {item.kind!r} (registered: {known})")
        else:
            try:
                res = _to_result(fn(item.params, thr, context), item, thr)
            except Skip as s:
                res = _to_result(s, item, thr)
            except Exception as e:  # noqa: BLE001 - a check's bug is reported, never a crash
                res = ItemResult(item.id, item.section, item.title, "error", item.required,
                                 thresholds=dict(thr), message=_one_line(e))
        res.duration_s = round(time.perf_counter() - t0, 6)
        results.append(res)
    return results
