import csv
import io
import json
import re

import pytest

from adapt.cli.main import main
from tests.fixtures.configs import SHARED_CONFIGS

KIMI = str(SHARED_CONFIGS / "moonshotai__Kimi-K2-Instruct.json")


def run(argv, capsys):
    try:
        main(argv)
        code = 0
    except SystemExit as e:
        code = e.code
    out, err = capsys.readouterr()
    return code, out, err


def test_json_stdout_is_only_json(capsys):
    code, out, err = run(["profile", "tiny-k2", "--format", "json", "--batch", "2", "--context", "64"], capsys)
    assert code == 0
    d = json.loads(out)
    assert d["settings"]["batch"] == 2 and d["settings"]["context"] == 64
    assert {"model", "hardware", "params", "memory", "modules", "totals"} <= set(d)
    assert d["hardware"]["name"] == "H100 SXM"


@pytest.mark.parametrize("phase", ["prefill", "decode"])
def test_phase_option(phase, capsys):
    code, out, _ = run(["profile", "tiny-qwen3-moe", "-f", "json", "--phase", phase, "-H", "mi300x"], capsys)
    d = json.loads(out)
    assert set(d["totals"]) == {phase} and {r["phase"] for r in d["modules"]} == {phase}
    assert d["hardware"]["name"] == "MI300X"


def test_csv_md_html(tmp_path, capsys):
    code, out, _ = run(["profile", "tiny-k2", "-f", "csv"], capsys)
    rows = list(csv.DictReader(io.StringIO(out)))
    assert code == 0 and rows and {"name", "phase", "op", "flops", "bytes", "bound", "time_s"} <= set(rows[0])
    code, out, _ = run(["profile", "tiny-k2", "-f", "md", "--weights-dtype", "fp8"], capsys)
    assert out.startswith("# adapt profile") and "| layers | module |" in out and "mlp.experts" in out
    html = tmp_path / "p.html"
    code, out, err = run(["profile", "tiny-k2", "-f", "html", "-o", str(html)], capsys)
    assert code == 0 and out == "" and "wrote" in err
    text = html.read_text()
    assert "<svg" in text and text.count("<circle") > 30 and "<polyline" in text
    assert not re.search(r"(src|href)\s*=\s*[\"']?(https?:)?//", text) and "<script" not in text


def test_html_escapes_model_name(tmp_path, capsys):
    from adapt.builtin import builtin_config

    cfg = builtin_config("tiny-llama")
    d = tmp_path / "<script>alert(1)<"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(cfg))
    code, out, _ = run(["profile", str(d), "-f", "html"], capsys)
    assert code == 0 and "<script>alert" not in out and "&lt;script&gt;" in out


def test_table_default_aggregates_layers(capsys):
    code, out, _ = run(["profile", KIMI, "--context", "1024"], capsys)
    assert code == 0
    assert "layers[1-60] moe" in out and "mlp.experts" in out and "TPOT" in out and "TTFT" in out
    assert len(out.splitlines()) < 120  # 61 layers, readable


def test_table_to_file(tmp_path, capsys):
    f = tmp_path / "t.txt"
    code, out, _ = run(["profile", "tiny-llama", "-o", str(f)], capsys)
    assert code == 0 and out == "" and "self_attn.q_proj" in f.read_text()


def test_hardware_list(capsys):
    code, out, _ = run(["hardware", "list", "--format", "json"], capsys)
    specs = json.loads(out)
    ids = {s["id"] for s in specs}
    assert {"h100-sxm", "h200", "a100-80gb", "b200", "mi300x", "ascend-910b"} <= ids and "template" not in ids
    assert all(s["source"] for s in specs)
    code, out, _ = run(["hardware", "list"], capsys)
    assert code == 0 and "MI300X" in out and "template.yaml" in out


def test_template_loads():
    from adapt.hardware import HARDWARE_DIR, load_hardware

    hw = load_hardware(str(HARDWARE_DIR / "template.yaml"))
    assert hw.peak_flops("bfloat16") == 8.0e14 and hw.memory_bandwidth == 3.0e12


@pytest.fixture(scope="module")
def kimi_profile():
    from adapt.hardware import load_hardware
    from adapt.profile import profile_model
    from adapt.source import resolve_model

    return profile_model(resolve_model(KIMI).spec(), load_hardware("h100-sxm"))


@pytest.mark.parametrize("width", [30, 40, 60, 80, 100, 120, 150, 179, 180, 200, 240])
def test_table_never_cuts_a_number_or_its_unit(kimi_profile, width):
    """At any console width every FLOPs, FLOP/B, bound and time cell is printed whole (the 200-column table used
    to show "17.3" for 17.3 T and "comput" for compute), and no table line is wider than the console."""
    from collections import Counter

    from rich.console import Console

    from adapt.cli.profile import render_table
    from adapt.profile.render import phases, summary_lines, table_rows

    console = Console(width=width, file=io.StringIO(), record=True, color_system=None)
    render_table(kimi_profile, console)
    text = console.export_text()
    tokens = Counter(re.findall(r"[^\s│┃]+(?: (?:[kKMGTPE]B?|B|[mun]?s)(?![^\s│┃]))?", text))
    want = Counter()
    for ph in phases(kimi_profile):
        for row in table_rows(kimi_profile, ph):
            want.update(row[h] for h in ("FLOPs", "FLOP/B", "bound", "time"))
    missing = {v: n for v, n in want.items() if tokens[v] < n}
    assert not missing, f"cut or missing at width {width}: {missing}"
    body = text.splitlines()[len(summary_lines(kimi_profile)):]
    assert max(len(line) for line in body) <= width


def test_piped_table_has_every_column(capsys):
    code, out, _ = run(["profile", KIMI, "--phase", "prefill"], capsys)
    assert code == 0
    header = next(line for line in out.splitlines() if "FLOPs" in line)
    for h in ("input", "output", "weights", "activations", "KV", "share", "bound"):
        assert h in header
    assert "comput " not in out and re.search(r"\b\d+(\.\d+)? T\b", out)
