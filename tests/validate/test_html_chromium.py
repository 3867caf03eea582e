"""Render report.html in a real browser and check a hostile model name stays text."""

import re
import shutil
import subprocess
from pathlib import Path

import pytest

from adapt.validate.report import write_reports

from .conftest import XSS, make_endpoint_report, make_report

CHROMIUM = Path("/usr/bin/chromium")


needs_chromium = pytest.mark.skipif(not CHROMIUM.exists(), reason="needs /usr/bin/chromium (Debian package 'chromium')")


def _chromium(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    profile = tmp_path / "profile"
    cmd = [str(CHROMIUM), "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
           "--disable-background-networking", "--disable-component-update", "--disable-sync",
           f"--user-data-dir={profile}", *args]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    finally:
        shutil.rmtree(profile, ignore_errors=True)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc


@needs_chromium
def test_model_name_script_is_shown_as_text(tmp_path):
    paths = write_reports(make_report(model=XSS), tmp_path / "out")
    dom = _chromium(tmp_path, "--dump-dom", paths["html"].resolve().as_uri()).stdout
    assert '<span id="model-name">&lt;script&gt;alert(1)&lt;/script&gt;</span>' in dom
    assert not re.search(r"(?i)<script\b", dom)  # no script element was created
    assert "alert(1)</script>" not in dom.replace("&lt;/script&gt;", "")


@needs_chromium
def test_endpoint_charts_are_drawn(tmp_path):
    """The ladder and load charts parse as SVG in the browser (each polyline keeps its points) and paint: the
    screenshot of the page shows the p50 / p99 and value line colours."""
    Image = pytest.importorskip("PIL.Image")

    from adapt.validate.report.plots import COLORS

    uri = write_reports(make_endpoint_report(), tmp_path / "out")["html"].resolve().as_uri()
    dom = _chromium(tmp_path, "--dump-dom", uri).stdout
    for fig in ("long_context_ladder-latency", "long_context_ladder-error", "serving_load-ttft", "serving_load-e2e",
                "serving_load-tps"):
        svg = re.search(rf'<svg id="fig-{fig}".*?</svg>', dom, re.S)
        assert svg and re.search(r'<polyline class="series"[^>]*points="[\d.]+,[\d.]+ [\d.]+,[\d.]+', svg.group(0)), fig
    shot = tmp_path / "shot.png"
    _chromium(tmp_path, "--window-size=1200,1400", "--hide-scrollbars", f"--screenshot={shot}", uri)
    img = Image.open(shot).convert("RGB")
    seen = {img.getpixel((x, y)) for x in range(0, img.width, 2) for y in range(0, img.height, 2)}

    def near(hexcolor: str) -> bool:
        rgb = tuple(int(hexcolor[i:i + 2], 16) for i in (1, 3, 5))
        return any(sum(abs(a - b) for a, b in zip(rgb, px)) < 40 for px in seen)

    assert near(COLORS["p50"]) and near(COLORS["p99"]) and near(COLORS["value"])
