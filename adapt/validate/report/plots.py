"""Line charts for report.html as numbers: the template draws them as inline SVG (no script, nothing fetched).

``chart()`` maps x values and named series onto a plot box (linear or log axes, ticks, legend); points that are
missing are left out of the line and non-finite ones are pinned to the top edge and marked. ``figures()`` builds
the charts of an endpoint run from its items' metrics: the long-context ladder (latency p50 / p90 / p99 per rung,
and the logprob difference against the reference per rung with the threshold) and the load levels (TTFT and
end-to-end percentiles and output tokens/s per concurrency).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

W, H, PAD_L, PAD_R, PAD_T, PAD_B = 360, 220, 56, 12, 14, 40
COLORS = {"p50": "#1e8449", "p90": "#b9770e", "p99": "#c0392b", "value": "#2471a3", "bound": "#7f8c8d"}


def _num(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _nice_step(span: float, n: int = 5) -> float:
    raw = span / max(n, 1)
    mag = 10 ** math.floor(math.log10(raw)) if raw > 0 else 1.0
    return next(m * mag for m in (1, 2, 5, 10) if m * mag >= raw)


def _label(v: float) -> str:
    if v >= 1024 and v % 1024 == 0:
        return f"{int(v) // 1024}K"
    return f"{v:g}"


class _Axis:
    def __init__(self, values: Sequence[float], log: bool, lo_px: float, hi_px: float, zero: bool = False,
                 decades: bool = True):
        self.log = log and all(v > 0 for v in values)
        vals = [math.log10(v) for v in values] if self.log else list(values)
        lo, hi = (min(vals), max(vals)) if vals else (0.0, 1.0)
        if self.log and decades:  # a y axis spans whole decades; an x axis ends at its first and last value
            lo, hi = math.floor(lo), math.ceil(hi)
        elif zero:
            lo = min(lo, 0.0)
        if hi - lo <= 0:
            lo, hi = lo - 0.5, hi + 0.5
        self.lo, self.hi, self.lo_px, self.hi_px = lo, hi, lo_px, hi_px

    def __call__(self, v: float) -> float:
        t = (math.log10(v) if self.log else v) - self.lo
        return round(self.lo_px + (self.hi_px - self.lo_px) * t / (self.hi - self.lo), 1)

    def ticks(self) -> list[dict[str, Any]]:
        if self.log:
            step = max(1, int((self.hi - self.lo) // 5))
            return [{"at": self(10.0 ** k), "label": f"1e{k}"} for k in range(int(self.lo), int(self.hi) + 1, step)]
        step = _nice_step(self.hi - self.lo)
        k0 = math.ceil(self.lo / step)
        out, k = [], k0
        while k * step <= self.hi + 1e-12:
            out.append({"at": self(k * step), "label": f"{k * step:.4g}"})
            k += 1
        return out


def chart(fig_id: str, title: str, xs: Sequence[float], series: Sequence[tuple[str, str, Sequence[Any]]], *,
          xlabel: str, ylabel: str, log_x: bool = False, log_y: bool = False, bound: float | None = None,
          marks: Sequence[int] = ()) -> dict[str, Any]:
    """Geometry of one chart: ``series`` are (name, color, ys aligned with xs; None for no point); ``bound`` a
    horizontal threshold line; ``marks`` indices of xs to ring (e.g. a top-1 mismatch)."""
    ys_all = [float(y) for _, _, ys in series for y in ys if _num(y) and math.isfinite(y)]
    if bound is not None:
        ys_all.append(float(bound))
    if log_y:
        ys_all = [max(y, 1e-12) for y in ys_all]
    x = _Axis([float(v) for v in xs], log_x, PAD_L, W - PAD_R, decades=False)
    y = _Axis(ys_all or [0.0, 1.0], log_y, H - PAD_B, PAD_T, zero=not log_y)
    out_series = []
    for name, color, ys in series:
        pts, bad = [], []
        for xv, yv in zip(xs, ys):
            if not _num(yv):
                continue
            if not math.isfinite(yv):
                bad.append({"x": x(xv), "y": PAD_T})
                continue
            pts.append({"x": x(xv), "y": y(max(float(yv), 1e-12) if y.log else float(yv))})
        out_series.append({"name": name, "color": color, "points": " ".join(f"{p['x']},{p['y']}" for p in pts),
                           "dots": pts, "bad": bad})
    return {"id": fig_id, "title": title, "width": W, "height": H, "left": PAD_L, "right": W - PAD_R, "top": PAD_T,
            "bottom": H - PAD_B, "xlabel": xlabel, "ylabel": ylabel, "series": out_series,
            "xticks": [{"at": x(v), "label": _label(float(v))} for v in xs],
            "yticks": y.ticks(), "bound": None if bound is None else {"y": y(max(bound, 1e-12) if y.log else bound),
                                                                     "label": f"{bound:g}"},
            "marks": [{"x": x(xs[i]), "y": PAD_T + 6} for i in marks if 0 <= i < len(xs)]}


def _rows(metrics: Mapping[str, Any], key: str) -> list[Mapping[str, Any]]:
    """``metrics[key]`` when it is a list of per-rung / per-level rows (the white-box ladder's ``rungs`` is a count)."""
    v = metrics.get(key)
    return [r for r in v if isinstance(r, Mapping)] if isinstance(v, list) else []


def _pct(stats: Sequence[Mapping[str, Any]]) -> list[tuple[str, str, list[Any]]]:
    return [(q, COLORS[q], [s.get(q) for s in stats]) for q in ("p50", "p90", "p99")]


def ladder_figures(item_id: str, metrics: Mapping[str, Any], thresholds: Mapping[str, float]) -> list[dict]:
    rungs = [r for r in _rows(metrics, "rungs") if _num(r.get("length"))]
    if not rungs:
        return []
    xs = [r["length"] for r in rungs]
    # one request per rung (a ladder without repeats): its time is every percentile
    lat = [r.get("latency_s") or {q: r.get("seconds") for q in ("p50", "p90", "p99")} for r in rungs]
    n = max(int(s.get("n") or 1) for s in lat)
    figs = [chart(f"fig-{item_id}-latency", f"Latency per rung ({n} request{'s' if n > 1 else ''} each)", xs,
                  _pct(lat), xlabel="prompt tokens", ylabel="seconds", log_x=True, log_y=True)]
    compared = [r.get("logprob_max_abs") if r.get("compared") else None for r in rungs]
    if any(_num(v) for v in compared):
        figs.append(chart(f"fig-{item_id}-error", "Next-token logprob |difference| vs the reference", xs,
                          [("max |Δ logprob|", COLORS["value"], compared)], xlabel="prompt tokens",
                          ylabel="nats", log_x=True, log_y=True, bound=thresholds.get("logprob_max_abs_max"),
                          marks=[i for i, r in enumerate(rungs) if r.get("compared") and r.get("top1_match") == 0]))
    return figs


def load_figures(item_id: str, metrics: Mapping[str, Any]) -> list[dict]:
    rows = [r for r in _rows(metrics, "levels") if _num(r.get("concurrency"))]
    if not rows:
        return []
    xs = [r["concurrency"] for r in rows]
    log_x = len(xs) > 2 and xs[0] > 0
    return [
        chart(f"fig-{item_id}-ttft", "Time to first token per concurrency", xs, _pct([r.get("ttft_s") or {} for r in rows]),
              xlabel="requests in flight", ylabel="seconds", log_x=log_x),
        chart(f"fig-{item_id}-e2e", "End-to-end latency per concurrency", xs, _pct([r.get("e2e_s") or {} for r in rows]),
              xlabel="requests in flight", ylabel="seconds", log_x=log_x),
        chart(f"fig-{item_id}-tps", "Output tokens/s per concurrency", xs,
              [("tok/s", COLORS["value"], [r.get("output_tokens_per_s") for r in rows])],
              xlabel="requests in flight", ylabel="tokens/s", log_x=log_x),
    ]


def figures(items: Sequence[Any]) -> list[dict[str, Any]]:
    """One figure group per item that carries a ladder (``rungs``) or load levels (``levels``)."""
    groups = []
    for it in items:
        charts = ladder_figures(it.id, it.metrics, it.thresholds) + load_figures(it.id, it.metrics)
        if charts:
            rows = _rows(it.metrics, "rungs") or _rows(it.metrics, "levels")
            groups.append({"item": it, "charts": charts, "table": _table(rows)})
    return groups


def _table(rows: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """The plotted rows flattened (``ttft_s.p50`` ...) for the table beside the charts."""
    flat = []
    for r in rows:
        d: dict[str, Any] = {}
        for k, v in r.items():
            if isinstance(v, Mapping):
                d.update({f"{k}.{q}": x for q, x in v.items()})
            else:
                d[k] = v
        flat.append(d)
    cols = list(dict.fromkeys(k for d in flat for k in d))
    return {"cols": cols, "rows": [[d.get(c) for c in cols] for d in flat]}
