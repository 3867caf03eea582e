"""Write every rendering of a report into a directory, each file atomically (temp file + os.replace)."""

from __future__ import annotations

from pathlib import Path

from adapt.validate.records import Report
from adapt.validate.report.html import render_html
from adapt.validate.report.junit import render_junit
from adapt.validate.report.markdown import render_markdown
from adapt.fileio import atomic_write


def write_reports(report: Report, out_dir: str | Path) -> dict[str, Path]:
    """Write report.json (first: it is the truth), report.html, junit.xml and summary.md.

    Everything is rendered before the first file is written, so a renderer's failure leaves no mix of
    old and new files. Returns the paths by kind: json, html, junit, markdown.
    """
    out = Path(out_dir)
    texts = {
        "json": ("report.json", report.to_json() + "\n"),
        "html": ("report.html", render_html(report)),
        "junit": ("junit.xml", render_junit(report)),
        "markdown": ("summary.md", render_markdown(report)),
    }
    paths = {}
    for kind, (name, text) in texts.items():
        paths[kind] = out / name
        atomic_write(paths[kind], text)
    return paths
