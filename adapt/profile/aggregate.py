"""Aggregation of per-module rows into one row per (phase, layer kind, module) for readable tables.

A 61-layer model has ~2,000 rows; identical layers collapse into one row with a ``count`` and summed
FLOPs, bytes and time, so the table shows e.g. ``layers[3-60] moe  mlp.experts  x58``.
"""

from __future__ import annotations

from adapt.profile.model import Profile


def _layer_span(layers: list[int]) -> str:
    if not layers:
        return ""
    lo, hi = min(layers), max(layers)
    if hi - lo + 1 == len(layers):
        return f"layers[{lo}]" if lo == hi else f"layers[{lo}-{hi}]"
    return f"layers[{len(layers)} of {lo}-{hi}]"


def aggregate(profile: Profile, phase: str) -> list[dict]:
    """Grouped rows of one phase, in execution order of each group's first row."""
    groups: dict[tuple, dict] = {}
    total_time = sum(r.time_s for r in profile.rows(phase)) or 1.0
    for r in profile.rows(phase):
        key = (r.layer_kind, r.module) if r.layer is not None else (r.layer_kind, r.name)
        g = groups.get(key)
        if g is None:
            g = groups[key] = {"where": "", "layer_kind": r.layer_kind, "module": r.module if r.layer is not None
                               else r.name, "op": r.op, "count": 0, "layers": [], "flops": 0.0, "bytes": 0.0,
                               "weight_bytes": 0.0, "act_bytes": 0.0, "kv_bytes": 0.0, "time_s": 0.0,
                               "input_shape": list(r.input_shape), "output_shape": list(r.output_shape),
                               "bound": r.bound, "note": r.note, "compute_dtype": r.compute_dtype}
        g["count"] += 1
        if r.layer is not None:
            g["layers"].append(r.layer)
        g["flops"] += r.flops
        g["bytes"] += r.bytes
        g["weight_bytes"] += r.weight_bytes
        g["act_bytes"] += r.act_read_bytes + r.act_write_bytes
        g["kv_bytes"] += r.kv_read_bytes + r.kv_write_bytes
        g["time_s"] += r.time_s
        if r.bound != g["bound"]:
            g["bound"] = "mixed"
    out = []
    for g in groups.values():
        g["where"] = _layer_span(g.pop("layers")) if g["layer_kind"] not in ("", "vision") else ""
        g["intensity"] = g["flops"] / g["bytes"] if g["bytes"] else None
        g["time_share"] = g["time_s"] / total_time
        out.append(g)
    return out
