"""summary.md: a short Markdown summary for CI job summaries (GitHub's $GITHUB_STEP_SUMMARY and alikes)."""

from __future__ import annotations

import html

from adapt.validate.records import STATUSES, Report, exit_code
from adapt.validate.report.html import fmt

_ICON = {"pass": "✅", "fail": "❌", "skip": "⏭️", "error": "⚠️"}


def _cell(s: object) -> str:
    """Table-cell safe: HTML-escaped (job summaries render HTML), pipes and newlines neutralized."""
    return html.escape(str(s), quote=False).replace("|", "\\|").replace("\r", " ").replace("\n", " ")


def render_markdown(report: Report) -> str:
    """The Markdown text."""
    s = report.summary
    code = exit_code(report)
    model = report.environment.get("model") or "model"
    verdict = "PASS" if code == 0 else "FAIL"
    out = [f"## adapt validate: {_cell(model)} — {verdict} (exit {code})", ""]
    out.append(", ".join(f"{_ICON[k]} {s['by_status'][k]} {k}" for k in STATUSES) + f" of {s['total']} items")
    if report.first_divergence:
        fd = report.first_divergence
        out.append(f"\nFirst divergence: layer {_cell(fd.get('layer'))}, module `{_cell(fd.get('module'))}`")
    out += ["", "| section | " + " | ".join(STATUSES) + " |", "|---|" + "---:|" * len(STATUSES)]
    for sec, c in s["by_section"].items():
        out.append(f"| {_cell(sec)} | " + " | ".join(str(c[k]) for k in STATUSES) + " |")
    bad = [it for it in report.items if it.status in ("fail", "error")]
    if bad:
        out += ["", "### Failing items", "", "| item | status | required | message |", "|---|---|---|---|"]
        for it in bad:
            out.append(f"| {_cell(it.id)} | {_ICON[it.status]} {it.status} | {'yes' if it.required else 'no'} "
                       f"| {_cell(it.message)} |")
    if report.regressions:
        out += ["", "### Regressions against the baseline", "", "| item | metric | baseline | now |",
                "|---|---|---:|---:|"]
        for r in report.regressions:
            out.append(f"| {_cell(r.item_id)} | {_cell(r.metric or r.kind)} | {_cell(fmt(r.baseline))} "
                       f"| {_cell(fmt(r.current))} |")
    env = report.environment
    keys = ("device", "dtype", "adapt_version", "torch_version", "checkpoint_hash")
    out += ["", " · ".join(f"{k}: `{_cell(env[k])}`" for k in keys if env.get(k) is not None), ""]
    return "\n".join(out)
