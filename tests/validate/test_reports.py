import json
import re
import xml.etree.ElementTree as ET

from adapt.validate.records import ItemResult, Regression, Report
from adapt.validate.report import render_html, render_junit, render_markdown, write_reports

from .conftest import XSS, make_report


def test_junit_parses_and_maps_statuses(report):
    report.items.append(ItemResult("boom", "text_inference", "Boom", "error", True,
                                   message="RuntimeError: bad \x00 byte"))
    root = ET.fromstring(render_junit(report))
    assert root.tag == "testsuites"
    assert (root.get("tests"), root.get("failures"), root.get("errors"), root.get("skipped")) == ("6", "1", "1", "2")
    cases = {c.get("name"): c for c in root.iter("testcase")}
    assert len(cases) == 6
    assert list(cases["prefill_logits"]) and cases["prefill_logits"].find("failure") is None
    assert cases["kv_int8_impact"].find("failure").get("message").startswith("top1_agreement")
    assert cases["image_path"].find("skipped").get("message") == "no vision tower"
    assert cases["boom"].find("error") is not None
    assert {p.get("name"): p.get("value") for p in cases["image_path"].iter("property")}["required"] == "false"
    suites = {s.get("name"): s for s in root.iter("testsuite")}
    assert suites["text_inference"].get("tests") == "2" and suites["text_inference"].get("errors") == "1"


def test_junit_lists_regressions(report):
    report.regressions.append(Regression("prefill_logits", "metric", "cosine regressed", "cosine", 1.0, 0.9, 0.99))
    root = ET.fromstring(render_junit(report))
    assert root.get("failures") == "2"
    reg = [c for c in root.iter("testcase") if c.get("classname") == "adapt.validate.baseline"]
    assert reg[0].get("name") == "prefill_logits:cosine"


def test_html_is_self_contained(report):
    html = render_html(make_report(model="https://example.com/model"))
    text = re.sub(r"<[^>]+>", "", html)
    tags = "".join(re.findall(r"<[^>]+>", html))
    assert not re.search(r"(?i)(https?:)?//", tags)  # no URL in any tag or attribute
    assert not re.search(r"(?i)\b(src|srcset|action|formaction)\s*=", tags)
    assert "<script" not in html.lower() and "<link" not in html.lower()
    assert all(h.startswith("#") for h in re.findall(r'href="([^"]*)"', html))
    assert "@import" not in html and "url(" not in html
    assert "https://example.com/model" in text  # the model name is text, not a reference
    assert "default-src 'none'" in html
    html = render_html(report)
    assert "<svg" in html and "<polyline" in html and "first divergence" in html
    assert not re.search(r"https?://", html)


def test_html_escapes_model_text():
    html = render_html(make_report(model=XSS))
    assert XSS not in html and "&lt;script&gt;alert(1)&lt;/script&gt;" in html


def test_html_without_curve_and_with_nan():
    r = Report([ItemResult("a", "s", "A", "pass", metrics={"cosine": float("nan")}, thresholds={"cosine_min": 0.9})])
    html = render_html(r)
    assert "<svg" not in html and ">nan<" in html


def test_markdown_summary(report):
    report.items.append(ItemResult("x|y", "s", "t", "fail", True, message="a | b\n" + XSS))
    md = render_markdown(report)
    assert md.startswith("## adapt validate: tiny-kimi — FAIL (exit 1)")
    assert "| text_inference | 1 | 0 | 0 | 0 |" in md
    assert "x\\|y" in md and "<script>" not in md


def test_write_reports_atomically(tmp_path, report):
    out = tmp_path / "out"
    paths = write_reports(report, out)
    assert sorted(p.name for p in out.iterdir()) == ["junit.xml", "report.html", "report.json", "summary.md"]
    assert Report.from_json(paths["json"].read_text()).to_json() == report.to_json()
    assert json.loads(paths["json"].read_text())["exit_code"] == 0
    write_reports(report, out)  # overwrite leaves no temp files behind
    assert len(list(out.iterdir())) == 4
