"""report.html: a self-contained page rendered from a Report (no script, no external resource).

Jinja2 autoescapes every value; the per-layer error curve and the charts of an endpoint run (the long-context
ladder, latency per concurrency: report/plots.py) are inline SVG whose geometry is computed as numbers and drawn
by the template, so no model-provided text ever reaches the page unescaped. A
Content-Security-Policy meta tag forbids scripts and any network fetch as a second line of defence.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from importlib import resources
from typing import Any

import jinja2

from adapt.validate.records import STATUSES, Report, exit_code
from adapt.validate.report.plots import figures

TEMPLATE = "report.html.j2"
_W, _H, _PAD_L, _PAD_R, _PAD_T, _PAD_B = 720, 260, 56, 16, 16, 36
_FLOOR = 1e-12  # plotted errors are clamped here so that exact zeros stay on a log axis


def fmt(v: Any) -> str:
    """Numbers to 6 significant digits, everything else as compact JSON or text."""
    if isinstance(v, bool) or v is None:
        return json.dumps(v)
    if isinstance(v, (int, float)):
        if isinstance(v, float) and not math.isfinite(v):
            return "nan" if math.isnan(v) else ("inf" if v > 0 else "-inf")
        return f"{v:.6g}"
    if isinstance(v, str):
        return v
    return json.dumps(v, sort_keys=True, default=str)


def metric_rows(metrics: Mapping[str, Any], thresholds: Mapping[str, float]) -> list[dict[str, Any]]:
    """Each metric with the bounds that apply to it; thresholds without a metric are shown too."""
    bounds: dict[str, list[tuple[str, float]]] = {}
    for name, b in thresholds.items():
        bounds.setdefault(name[:-4], []).append((name[-3:], b))
    rows = []
    for m in list(metrics) + [m for m in bounds if m not in metrics]:
        v = metrics.get(m)
        texts, ok = [], None
        for op, b in bounds.get(m, []):
            texts.append(f"{'≥' if op == 'min' else '≤'} {b:.6g}")
            if isinstance(v, (int, float)) and not isinstance(v, bool):
                good = v >= b if op == "min" else v <= b
                ok = good if ok is None else (ok and good)
            else:
                ok = False
        rows.append({"name": m, "value": fmt(v) if m in metrics else "—", "bound": ", ".join(texts),
                     "ok": ok})
    return rows


def _log_y(v: float, lo: float, hi: float) -> float:
    frac = (math.log10(v) - lo) / (hi - lo) if hi > lo else 0.5
    return _PAD_T + (1.0 - frac) * (_H - _PAD_T - _PAD_B)


def curve_geometry(curve: Sequence[Mapping[str, Any]], divergence: Mapping[str, Any] | None) -> dict | None:
    """Polyline points for max_abs and 1 - cosine per layer on a log10 axis; None without a curve."""
    if not curve:
        return None
    series_def = [("max abs", "#c0392b", lambda e: e.get("max_abs")),
                  ("1 - cosine", "#2471a3", lambda e: 1.0 - e["cosine"] if _is_num(e.get("cosine")) else None)]
    raw = {name: [get(e) for e in curve] for name, _, get in series_def}
    finite = [max(float(v), _FLOOR) for vals in raw.values() for v in vals if _is_num(v) and math.isfinite(v)]
    lo = math.floor(math.log10(min(finite))) if finite else -12
    hi = math.ceil(math.log10(max(finite))) if finite else 0
    hi = max(hi, lo + 1)
    n = len(curve)
    span = _W - _PAD_L - _PAD_R

    def x(i: int) -> float:
        return _PAD_L + (span * i / (n - 1) if n > 1 else span / 2)

    series = []
    for name, color, _ in series_def:
        pts, bad = [], []
        for i, v in enumerate(raw[name]):
            if not _is_num(v):
                continue
            if not math.isfinite(v):  # NaN or inf: pinned to the top, marked
                bad.append({"x": round(x(i), 1), "y": _PAD_T})
                continue
            pts.append(f"{x(i):.1f},{_log_y(max(float(v), _FLOOR), lo, hi):.1f}")
        series.append({"name": name, "color": color, "points": " ".join(pts), "bad": bad})
    step = max(1, (hi - lo) // 6)
    yticks = [{"y": round(_log_y(10.0 ** k, lo, hi), 1), "label": f"1e{k}"} for k in range(lo, hi + 1, step)]
    xstep = max(1, n // 12)
    xticks = [{"x": round(x(i), 1), "label": str(curve[i].get("layer", i))} for i in range(0, n, xstep)]
    div_x = None
    if divergence is not None:
        for i, e in enumerate(curve):
            if e.get("layer") == divergence.get("layer"):
                div_x = round(x(i), 1)
    return {"width": _W, "height": _H, "left": _PAD_L, "right": _W - _PAD_R, "top": _PAD_T,
            "bottom": _H - _PAD_B, "series": series, "yticks": yticks, "xticks": xticks, "div_x": div_x}


def _is_num(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _env() -> jinja2.Environment:
    env = jinja2.Environment(autoescape=True, undefined=jinja2.StrictUndefined, trim_blocks=True,
                             lstrip_blocks=True)
    env.filters["fmt"] = fmt
    return env


_FIGURES = ("thumbnails", "per_image", "rungs", "levels")  # drawn as images / charts, not as a JSON cell


def _thumbnails(metrics: Mapping[str, Any]) -> list[dict[str, Any]]:
    """image_path's images as thumbnails, each captioned with its size and per-image result."""
    per = {r.get("image"): r for r in metrics.get("per_image") or [] if isinstance(r, Mapping)}
    out = []
    for t in metrics.get("thumbnails") or []:
        src = str(t.get("thumbnail", ""))
        if not src.startswith("data:image/png;base64,"):
            continue
        r = per.get(t.get("name"), {})
        w, h = (t.get("size") or [0, 0])[:2]
        bits = [f"{t.get('name')} {w}x{h}", f"{r['tokens']} tokens" if "tokens" in r else ""]
        if "max_abs" in r:
            bits.append(f"logits max_abs {fmt(r['max_abs'])}")
        out.append({"src": src, "caption": ", ".join(b for b in bits if b)})
    return out


def render_html(report: Report) -> str:
    """The whole page as a string."""
    template = _env().from_string(resources.files(__package__).joinpath(TEMPLATE).read_text("utf-8"))
    sections: dict[str, list[dict[str, Any]]] = {}
    figs = figures(report.items)
    for it in report.items:
        # thumbnails and charts instead of JSON cells
        shown = {k: v for k, v in it.metrics.items() if k not in _FIGURES or not isinstance(v, list)}
        sections.setdefault(it.section, []).append({"item": it, "rows": metric_rows(shown, it.thresholds),
                                                    "thumbs": _thumbnails(it.metrics),
                                                    "plotted": any(g["item"] is it for g in figs)})
    summary = report.summary
    return template.render(
        report=report, summary=summary, statuses=STATUSES, sections=sections,
        env_rows=[(k, fmt(v)) for k, v in report.environment.items()],
        curve=curve_geometry(report.layer_curve, report.first_divergence),
        figures=figs,
        exit_code=exit_code(report),
        model=str(report.environment.get("model", "") or ""),
    )
