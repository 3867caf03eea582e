"""Write every rendering of a report into a directory, each file atomically (temp file + os.replace)."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from adapt.validate.records import Report
from adapt.validate.report.html import render_html
from adapt.validate.report.junit import render_junit
from adapt.validate.report.markdown import render_markdown


def atomic_write_text(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` so a reader sees the old file or the whole new one, never a part."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8", newline="\n") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


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
        atomic_write_text(paths[kind], text)
    return paths
