"""report.html's charts of an endpoint run: the ladder per rung and the load per concurrency, as inline SVG."""

from __future__ import annotations

import json
import re

from adapt.validate.report import render_html, write_reports
from adapt.validate.report.plots import chart, figures

from .conftest import make_endpoint_report, make_report


def _points(poly: str) -> list[tuple[float, float]]:
    return [tuple(map(float, p.split(","))) for p in poly.split()]


def test_chart_geometry_orders_percentiles_and_places_the_bound():
    c = chart("f", "t", [1, 2, 4, 8], [("p50", "#0", [1.0, 2.0, 4.0, 8.0]), ("p99", "#1", [2.0, 4.0, 8.0, None])],
              xlabel="x", ylabel="y", log_x=True, bound=5.0)
    p50, p99 = (_points(s["points"]) for s in c["series"])
    assert len(p50) == 4 and len(p99) == 3  # a missing point is left out, not drawn at 0
    xs = [x for x, _ in p50]
    assert xs[0] == c["left"] and xs[-1] == c["right"]
    assert abs((xs[1] - xs[0]) - (xs[3] - xs[2])) < 0.2  # log2 steps are even on a log axis
    assert all(b[1] < a[1] for a, b in zip(p50, p99))  # p99 above p50: SVG y grows downwards
    assert p50[2][1] > c["bound"]["y"] > p50[3][1]  # 4 < 5 < 8
    assert c["top"] <= min(y for _, y in p99) and max(y for _, y in p50) <= c["bottom"]


def test_log_axis_and_non_finite_points():
    c = chart("f", "t", [1024, 8192], [("v", "#0", [1e-6, float("inf")])], xlabel="x", ylabel="y", log_x=True,
              log_y=True, marks=[1])
    (s,) = c["series"]
    assert len(_points(s["points"])) == 1 and s["bad"] == [{"x": c["right"], "y": c["top"]}]
    assert [t["label"] for t in c["xticks"]] == ["1K", "8K"] and c["marks"][0]["x"] == c["right"]
    assert {t["label"] for t in c["yticks"]} >= {"1e-6"}


def test_endpoint_report_has_ladder_and_load_charts():
    rep = make_endpoint_report()
    groups = {g["item"].id: [c["id"] for c in g["charts"]] for g in figures(rep.items)}
    assert groups == {"long_context_ladder": ["fig-long_context_ladder-latency", "fig-long_context_ladder-error"],
                      "serving_load": ["fig-serving_load-ttft", "fig-serving_load-e2e", "fig-serving_load-tps"]}
    html = render_html(rep)
    for ids in groups.values():
        for i in ids:
            assert f'<svg id="{i}"' in html
    err = re.search(r'<svg id="fig-long_context_ladder-error".*?</svg>', html, re.S).group(0)
    assert len(_points(re.search(r'class="series"[^>]*points="([^"]*)"', err).group(1))) == 2  # 32K not compared
    assert err.count('class="mark"') == 1 and 'class="bound"' in err  # 8K's top-1 differs; the 2e-4 threshold
    assert '<a href="#figures-serving_load">' in html
    assert "<script" not in html.lower() and not re.search(r"(?i)(https?:)?//", "".join(re.findall(r"<[^>]+>", html)))
    assert json.dumps(rep.items[0].metrics["rungs"][0]) not in html  # the rows are a table, not a JSON cell


def test_reports_without_rows_draw_no_chart(tmp_path):
    rep = make_report()
    assert figures(rep.items) == []
    html = write_reports(rep, tmp_path)["html"].read_text()
    assert "<h2>Figures</h2>" not in html and '<svg id="layer-curve"' in html
