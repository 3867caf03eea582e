"""Render report.html in a real browser and check a hostile model name stays text."""

import re
import shutil
import subprocess
from pathlib import Path

import pytest

from adapt.validate.report import write_reports

from .conftest import XSS, make_report

CHROMIUM = Path("/usr/bin/chromium")


@pytest.mark.skipif(not CHROMIUM.exists(), reason="needs /usr/bin/chromium (Debian package 'chromium')")
def test_model_name_script_is_shown_as_text(tmp_path):
    paths = write_reports(make_report(model=XSS), tmp_path / "out")
    profile = tmp_path / "profile"
    cmd = [str(CHROMIUM), "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
           "--disable-background-networking", "--disable-component-update", "--disable-sync",
           f"--user-data-dir={profile}", "--dump-dom", paths["html"].resolve().as_uri()]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    finally:
        shutil.rmtree(profile, ignore_errors=True)
    assert proc.returncode == 0, proc.stderr[-2000:]
    dom = proc.stdout
    assert '<span id="model-name">&lt;script&gt;alert(1)&lt;/script&gt;</span>' in dom
    assert not re.search(r"(?i)<script\b", dom)  # no script element was created
    assert "alert(1)</script>" not in dom.replace("&lt;/script&gt;", "")
