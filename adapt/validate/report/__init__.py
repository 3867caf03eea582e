"""Leaf renderers of a validation Report: HTML, JUnit XML, Markdown, and the writer of all of them."""

from adapt.validate.report.html import render_html
from adapt.validate.report.junit import render_junit
from adapt.validate.report.markdown import render_markdown
from adapt.validate.report.writer import write_reports

__all__ = ["render_html", "render_junit", "render_markdown", "write_reports"]
