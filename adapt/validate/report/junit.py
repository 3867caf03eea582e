"""junit.xml: one testcase per checklist item, one testsuite per section.

fail -> <failure>, error -> <error>, skip -> <skipped>, pass -> an empty testcase. An item with
``required=False`` keeps its real status here (CI shows it) and carries a ``required=false`` property;
whether the run fails is the exit code's business, not JUnit's.
"""

from __future__ import annotations

import re
import xml.etree.ElementTree as ET

from adapt.validate.records import Report
from adapt.validate.report.html import fmt

# Characters XML 1.0 does not allow, even escaped; a check's message may carry them.
_BAD_XML = re.compile("[^\u0009\u000a\u000d\u0020-\ud7ff\ue000-\ufffd\U00010000-\U0010ffff]")


def _x(s: object) -> str:
    return _BAD_XML.sub("\ufffd", str(s))


def _details(metrics: dict, thresholds: dict) -> str:
    lines = [f"{k} = {fmt(v)}" for k, v in metrics.items()]
    lines += [f"threshold {k} = {fmt(v)}" for k, v in thresholds.items()]
    return "\n".join(lines)


def render_junit(report: Report) -> str:
    """The JUnit XML document as a string."""
    summary = report.summary
    root = ET.Element("testsuites", {
        "name": _x(f"adapt validate {report.checklist}".strip()),
        "tests": str(summary["total"]),
        "failures": str(summary["by_status"]["fail"]),
        "errors": str(summary["by_status"]["error"]),
        "skipped": str(summary["by_status"]["skip"]),
        "time": f"{sum(it.duration_s for it in report.items):.3f}",
    })
    suites: dict[str, ET.Element] = {}
    for it in report.items:
        suite = suites.get(it.section)
        if suite is None:
            c = summary["by_section"][it.section]
            t = sum(x.duration_s for x in report.items if x.section == it.section)
            suite = suites[it.section] = ET.SubElement(root, "testsuite", {
                "name": _x(it.section), "tests": str(sum(c.values())), "failures": str(c["fail"]),
                "errors": str(c["error"]), "skipped": str(c["skip"]), "time": f"{t:.3f}",
                "timestamp": _x(report.created_utc)})
        case = ET.SubElement(suite, "testcase", {"classname": _x(f"adapt.validate.{it.section}"),
                                                 "name": _x(it.id), "time": f"{it.duration_s:.3f}"})
        props = ET.SubElement(case, "properties")
        ET.SubElement(props, "property", {"name": "required", "value": str(it.required).lower()})
        ET.SubElement(props, "property", {"name": "title", "value": _x(it.title)})
        tag = {"fail": "failure", "error": "error", "skip": "skipped"}.get(it.status)
        if tag is not None:
            el = ET.SubElement(case, tag, {"message": _x(it.message or it.status)})
            if tag != "skipped":
                el.set("type", "ThresholdFailure" if tag == "failure" else "CheckError")
                el.text = _x(_details(it.metrics, it.thresholds))
        elif it.metrics:
            ET.SubElement(case, "system-out").text = _x(_details(it.metrics, it.thresholds))
    for r in report.regressions:
        suite = suites.get("baseline")
        if suite is None:
            suite = suites["baseline"] = ET.SubElement(root, "testsuite", {"name": "baseline", "tests": "0",
                                                                            "failures": "0", "errors": "0",
                                                                            "skipped": "0", "time": "0"})
        case = ET.SubElement(suite, "testcase", {"classname": "adapt.validate.baseline",
                                                 "name": _x(f"{r.item_id}:{r.metric or r.kind}"), "time": "0"})
        ET.SubElement(case, "failure", {"message": _x(r.message), "type": "Regression"})
        for k in ("tests", "failures"):
            suite.set(k, str(int(suite.get(k)) + 1))
    if report.regressions:
        for k in ("tests", "failures"):
            root.set(k, str(int(root.get(k)) + len(report.regressions)))
    ET.indent(root)
    return ET.tostring(root, encoding="unicode", xml_declaration=True) + "\n"
