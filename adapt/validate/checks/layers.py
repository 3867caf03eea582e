"""layer_alignment, and the search for the first divergence.

Every hooked output (``target.layer_names``: embedding, then per decoder layer its input norm,
attention, post-attention norm, MLP and output, then the final norm) of the target is compared with
the reference's on the same prompts. A golden reference keeps a sample of hidden dims
(``layer_index``); the target's outputs are cut to the same dims.

The first divergence is the first output, in execution order, that breaks the layer thresholds
(the ``layer_alignment`` item's, e.g. max_abs <= 1e-4 and cosine >= 0.99 in float32): its layer and
sub-module (``attention``, ``mlp``, ``input_norm``, ``post_attention_norm``, or ``output`` when the
sub-modules are in tolerance and only their sum is not; ``embedding`` / ``final_norm`` with layer None).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from adapt.validate import compare
from adapt.validate.checklist import Outcome, apply_thresholds, register_check
from adapt.validate.target import layer_names, parse_layer_name

# Used when the checklist has no layer_alignment item: the day0.yaml float32 bounds ([runtime], [msprobe]).
DEFAULT_LAYER_THRESHOLDS = {"max_abs_max": 1.0e-4, "cosine_min": 0.99}


def _stack(ctx, which: str) -> dict[str, torch.Tensor]:
    """name -> [sum T, h] over all prompts for the reference, the target or plain torch."""
    idx = ctx.reference.layer_index()
    per_prompt = []
    for i in range(len(ctx.prompts)):
        if which == "reference":
            per_prompt.append(ctx.reference.layers(i))
            continue
        d = ctx.target_layers(i) if which == "target" else ctx.plain_layers(i)
        per_prompt.append({n: (t.index_select(-1, idx) if idx is not None else t) for n, t in d.items()})
    names = set.intersection(*(set(d) for d in per_prompt))
    return {n: torch.cat([d[n] for d in per_prompt]) for n in names}


def layer_table(ctx) -> list[dict[str, Any]]:
    """Per hooked output, in execution order: name, layer, module, max_abs, max_rel, cosine (+ ratio)."""
    def build():
        ref, tgt = _stack(ctx, "reference"), _stack(ctx, "target")
        plain = _stack(ctx, "plain") if ctx.low_precision else {}
        rows = []
        for name in layer_names(ctx.reference.num_layers):
            if name not in ref or name not in tgt:
                continue
            r, t = ref[name], tgt[name]
            layer, module = parse_layer_name(name)
            row = {"name": name, "layer": layer, "module": module, "max_abs": compare.max_abs(t, r),
                   "max_rel": compare.max_rel(t, r), "cosine": compare.cosine(t, r)}
            if name in plain:
                floor = torch.finfo(torch.bfloat16).eps * float(r.abs().max())
                row["max_abs_vs_torch_ratio"] = row["max_abs"] / max(compare.max_abs(plain[name], r), floor)
            rows.append(row)
        return rows

    return ctx.memo(("layer_table",), build)


def layer_curve(ctx) -> list[dict[str, Any]]:
    """compare.layer_error_growth over the decoder-layer outputs (the report's error curve)."""
    ref, tgt = _stack(ctx, "reference"), _stack(ctx, "target")
    names = [f"layers.{i}" for i in range(ctx.reference.num_layers) if f"layers.{i}" in ref and f"layers.{i}" in tgt]
    return compare.layer_error_growth([ref[n] for n in names], [tgt[n] for n in names], names)


def _bounds(thresholds: Mapping[str, float]) -> dict[str, float]:
    return {k: v for k, v in thresholds.items() if k[:-4] in ("max_abs", "cosine", "max_abs_vs_torch_ratio")}


def locate_first_divergence(ctx, thresholds: Mapping[str, float] | None = None) -> dict[str, Any] | None:
    """The first hooked output that breaks the layer bounds, as ``{layer, module, name, metrics}``."""
    bounds = _bounds(thresholds if thresholds is not None else ctx.notes.get("layer_thresholds")
                     or DEFAULT_LAYER_THRESHOLDS)
    for row in layer_table(ctx):
        metrics = {k: v for k, v in row.items() if isinstance(v, float)}
        usable = {k: v for k, v in bounds.items() if k[:-4] in metrics}
        broken = apply_thresholds(metrics, usable)
        if broken:
            return {"layer": row["layer"], "module": row["module"], "name": row["name"], "why": "; ".join(broken)}
    return None


@register_check("layer_alignment")
def layer_alignment(params: Mapping[str, Any], thresholds: Mapping[str, float], ctx) -> Outcome:
    ctx.need_runner()
    rows = layer_table(ctx)
    if not rows:
        return Outcome(status="error", message="target and reference share no hooked layer outputs")
    worst = max(rows, key=lambda r: r["max_abs"])
    m: dict[str, Any] = {"max_abs": worst["max_abs"], "max_rel": max(r["max_rel"] for r in rows),
                         "cosine": min(r["cosine"] for r in rows), "outputs_compared": len(rows),
                         "worst_output": worst["name"]}
    if ctx.low_precision:
        m["max_abs_vs_torch_ratio"] = max(r.get("max_abs_vs_torch_ratio", 0.0) for r in rows)
    if params.get("record_curve", True):
        ctx.layer_curve = layer_curve(ctx)
    broken = apply_thresholds(m, thresholds)
    if not broken:
        return Outcome(m, message=f"{len(rows)} outputs in tolerance; worst {worst['name']}")
    fd = locate_first_divergence(ctx, thresholds)
    if fd is not None and ctx.first_divergence is None:
        ctx.first_divergence = fd
    where = f"first divergence: {fd['name']} ({fd['why']})" if fd else "no single output breaks the bounds"
    return Outcome(m, status="fail", message="; ".join(broken) + f"; {where}")
