"""Renderers of a Profile: CSV (one line per module), Markdown and self-contained HTML.

They return strings; only ``adapt.cli`` writes them. The HTML page uses ``report.html.j2`` (jinja2,
autoescape on, no scripts, no network) with an inline SVG log-log roofline.
"""

from __future__ import annotations

import csv
import io
import math
from pathlib import Path

from adapt.profile.aggregate import aggregate
from adapt.profile.fmt import nbytes, seconds, shape, si
from adapt.profile.model import Profile

CSV_FIELDS = ("name", "phase", "op", "module", "layer", "layer_kind", "flops", "bytes", "weight_bytes",
              "act_read_bytes", "act_write_bytes", "kv_read_bytes", "kv_write_bytes", "intensity", "bound", "time_s",
              "compute_dtype", "input_shape", "output_shape", "note")
TEMPLATE = Path(__file__).with_name("report.html.j2")


def to_csv(profile: Profile) -> str:
    """Every module row of every phase, one CSV line each."""
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=CSV_FIELDS, lineterminator="\n")
    w.writeheader()
    for r in profile.modules:
        d = r.as_dict()
        d["input_shape"] = "x".join(str(v) for v in d["input_shape"])
        d["output_shape"] = "x".join(str(v) for v in d["output_shape"])
        w.writerow({k: d[k] for k in CSV_FIELDS})
    return buf.getvalue()


def summary_lines(profile: Profile) -> list[tuple[str, str]]:
    """(label, value) pairs of the headline figures, shared by every renderer."""
    p, m, t = profile.params, profile.memory, profile.totals
    out = [("model", f"{profile.model['name'] or '-'} ({profile.model['model_type']}, family {profile.model['family']})"),
           ("hardware", profile.hardware["name"]),
           ("settings", ", ".join(f"{k}={v}" for k, v in profile.settings.items())),
           ("params total / active", f"{p['total']:,} / {p['active']:,} (active non-embedding "
                                     f"{p['active_non_embedding']:,}; embedding {p['embedding']:,}; "
                                     f"lm_head {p['lm_head']:,}; mtp {p['mtp']:,}; vision {p['vision']:,})"),
           ("weights", f"{nbytes(m['weights_bytes'])} at {m['weights_dtype']}"),
           ("KV per token", f"{m['kv_bytes_per_token']:,} B at {m['kv_dtype']}"),
           ("KV by context", ", ".join(f"{k}: {nbytes(v)}" for k, v in m["kv_bytes_by_context"].items())),
           ("activation peak (prefill)", nbytes(m["activation_peak_bytes"])),
           ("memory at context", f"{nbytes(m['total_bytes_at_context'])} -> at least "
                                 f"{m['min_devices_for_memory']} device(s) for memory")]
    if "prefill" in t:
        out.append(("TTFT (prefill)", f"{seconds(t['prefill']['ttft_s'])}, {si(t['prefill']['flops'], 'FLOP')}, "
                                      f"{nbytes(t['prefill']['bytes'])}"))
    if "decode" in t:
        out.append(("TPOT (decode)", f"{seconds(t['decode']['tpot_s'])}, {si(t['decode']['flops'], 'FLOP')}, "
                                     f"{nbytes(t['decode']['bytes'])}, {t['decode']['tokens_per_s']:.1f} tokens/s"))
    if "vision" in t:
        out.append(("vision tower", f"{seconds(t['vision']['time_per_image_s'])} per image"))
    return out


def table_rows(profile: Profile, phase: str) -> list[dict[str, str]]:
    """Display cells (keyed by ``HEADERS``) of the aggregated rows of one phase."""
    rows = []
    for g in aggregate(profile, phase):
        cells = [g["where"] + (f" {g['layer_kind']}" if g["where"] else ""), g["module"], g["op"], str(g["count"]),
                 shape(g["input_shape"]), shape(g["output_shape"]), si(g["flops"]), nbytes(g["bytes"]),
                 nbytes(g["weight_bytes"]), nbytes(g["act_bytes"]), nbytes(g["kv_bytes"]),
                 "-" if g["intensity"] is None else f"{g['intensity']:.3g}", g["bound"], seconds(g["time_s"]),
                 f"{100 * g['time_share']:.1f}%"]
        rows.append(dict(zip(HEADERS, cells)))
    return rows


HEADERS = ["layers", "module", "op", "count", "input", "output", "FLOPs", "bytes", "weights", "activations", "KV",
           "FLOP/B", "bound", "time", "share"]


def phases(profile: Profile) -> list[str]:
    return [p for p in ("prefill", "decode", "vision") if p in profile.totals]


def to_markdown(profile: Profile) -> str:
    lines = [f"# adapt profile: {profile.model['name'] or profile.model['model_type']} on {profile.hardware['name']}", ""]
    lines += [f"- **{k}**: {v}" for k, v in summary_lines(profile)]
    for ph in phases(profile):
        lines += ["", f"## {ph}", "", "| " + " | ".join(HEADERS) + " |", "|" + "---|" * len(HEADERS)]
        lines += ["| " + " | ".join(row[h].replace("|", "\\|") for h in HEADERS) + " |" for row in table_rows(profile, ph)]
    lines += ["", "Counts and FLOPs/bytes/time are summed over the rows of a group; times are roofline times "
                  "max(FLOPs / peak, bytes / bandwidth)."]
    return "\n".join(lines) + "\n"


def roofline_plot(profile: Profile, width: int = 760, height: int = 440) -> dict:
    """Coordinates of an SVG log-log roofline: the roofs of the dtypes used and every module as a point."""
    hw = profile.hardware
    bw = hw["memory_bandwidth"]
    pts = [r for r in profile.modules if r.flops > 0 and r.bytes > 0 and r.time_s > 0]
    dtypes = sorted({r.compute_dtype for r in pts} or {"bfloat16"})
    peaks = {d: _peak(hw["flops"], d) for d in dtypes}
    xs = [r.intensity for r in pts] + [p / bw for p in peaks.values()]
    ys = [r.flops / r.time_s for r in pts] + list(peaks.values())
    x0, x1 = 10 ** math.floor(math.log10(min(xs) / 2)), 10 ** math.ceil(math.log10(max(xs) * 2))
    y0, y1 = 10 ** math.floor(math.log10(min(ys) / 2)), 10 ** math.ceil(math.log10(max(peaks.values()) * 1.5))
    ml, mr, mt, mb = 70, 20, 20, 50
    pw, ph = width - ml - mr, height - mt - mb

    def px(x):
        return ml + pw * (math.log10(x) - math.log10(x0)) / (math.log10(x1) - math.log10(x0))

    def py(y):
        return mt + ph * (1 - (math.log10(y) - math.log10(y0)) / (math.log10(y1) - math.log10(y0)))

    roofs = []
    for d, peak in peaks.items():
        ridge = peak / bw
        xa = max(x0, y0 / bw)
        roofs.append({"dtype": d, "points": f"{px(xa):.1f},{py(xa * bw):.1f} {px(ridge):.1f},{py(peak):.1f} "
                                            f"{px(x1):.1f},{py(peak):.1f}",
                      "label_x": px(x1) - 4, "label_y": py(peak) - 4, "label": f"{d} {si(peak, 'FLOP/s')}",
                      "ridge_x": px(ridge), "ridge": f"ridge {ridge:.3g} FLOP/B"})
    colors = {"prefill": "#1f77b4", "decode": "#d62728", "vision": "#2ca02c"}
    points = [{"x": f"{px(r.intensity):.1f}", "y": f"{py(r.flops / r.time_s):.1f}", "color": colors.get(r.phase, "#555"),
               "title": f"{r.phase} {r.name} ({r.op}): {r.intensity:.3g} FLOP/B, {si(r.flops / r.time_s, 'FLOP/s')}, "
                        f"{r.bound}-bound"} for r in pts]
    xticks = [{"x": f"{px(10 ** e):.1f}", "label": f"1e{e}"}
              for e in range(int(math.log10(x0)), int(math.log10(x1)) + 1)]
    yticks = [{"y": f"{py(10 ** e):.1f}", "label": f"1e{e}"}
              for e in range(int(math.log10(y0)), int(math.log10(y1)) + 1)]
    return {"width": width, "height": height, "left": ml, "top": mt, "right": width - mr, "bottom": height - mb,
            "roofs": roofs, "points": points, "xticks": xticks, "yticks": yticks, "colors": colors}


def _peak(flops: dict, dtype: str) -> float:
    for k in (dtype, {"float8_e4m3fn": "bfloat16", "int8": "bfloat16"}.get(dtype, "bfloat16"), "bfloat16"):
        if k in flops:
            return flops[k]
    return max(flops.values())


def to_html(profile: Profile) -> str:
    """A self-contained HTML page: summary, the aggregated tables and the inline SVG roofline."""
    import jinja2

    env = jinja2.Environment(autoescape=True, undefined=jinja2.StrictUndefined, trim_blocks=True, lstrip_blocks=True)
    tpl = env.from_string(TEMPLATE.read_text())
    tables = [{"phase": ph, "rows": [[row[h] for h in HEADERS] for row in table_rows(profile, ph)],
               "total": profile.totals[ph]} for ph in phases(profile)]
    return tpl.render(profile=profile, summary=summary_lines(profile), headers=HEADERS, tables=tables,
                      plot=roofline_plot(profile), seconds=seconds)
