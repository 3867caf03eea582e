"""`adapt bench serve --endpoint URL` against a live `adapt serve` of a tiny built-in model on 127.0.0.1.

The server's model step is slowed by a fixed sleep (a compute-bound step, as a real model's is), so TTFT is
tens of milliseconds and the client's HTTP overhead stays a small part of it: then the client's TTFT and
throughput must agree with the server's own /metrics over the same window within 10%."""

from __future__ import annotations

import json
import math
import socket
import statistics
import time
from pathlib import Path

import pytest

from adapt.bench.load import poisson_arrivals
from adapt.bench.prom import histogram, parse, server_view
from adapt.bench.stats import BenchInputError, meets_slo, parse_slo, percentile, summary
from tests.validate.test_validate_cli import run_cli

KEYS = ("ttft_s", "itl_s", "tpot_s", "e2e_s", "completed", "failed", "output_tokens_per_s", "goodput")
STEP_S = 0.06


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from adapt.runtime.engine import Engine
    from adapt.runtime.init_model import init_model
    from adapt.runtime.server import ServiceConfig, start_server

    path = Path(init_model("tiny-llama", tmp_path_factory.mktemp("bench") / "tiny"))
    eng = Engine.from_pretrained(path, kv_cache_memory=64 << 20, max_model_len=1024)
    step = eng.runner.step

    def slow_step(*args, **kwargs):
        time.sleep(STEP_S)
        return step(*args, **kwargs)

    eng.runner.step = slow_step
    srv = start_server(eng, config=ServiceConfig(model_name="tiny"))
    yield srv
    srv.stop()


def _bench(capsys, *args: str) -> tuple[int, dict | None, str]:
    capsys.readouterr()
    rc = run_cli("bench", "serve", *args)
    out, err = capsys.readouterr()
    return rc, (json.loads(out) if out.strip().startswith("{") else None), err


def test_closed_loop_agrees_with_the_servers_metrics(server, capsys):
    rc, r, err = _bench(capsys, "--endpoint", server.url, "--requests", "16", "--concurrency", "4",
                        "--input-len", "32", "--output-len", "8", "--slo", "ttft=30,e2e=60", "--format", "json")
    assert rc == 0, err
    for k in KEYS:
        assert k in r, k
    for k in ("ttft_s", "itl_s", "tpot_s", "e2e_s"):
        assert set(r[k]) >= {"mean", "p50", "p90", "p99"} and all(math.isfinite(r[k][q]) for q in ("mean", "p99"))
        assert r[k]["p50"] <= r[k]["p90"] <= r[k]["p99"]
    assert r["completed"] == 16 and r["failed"] == 0 and r["errors"] == {}
    assert r["output_tokens"] == 16 * 8 and r["itl_s"]["n"] == 16 * 7
    assert r["goodput_fraction"] == 1.0 and r["goodput"] == pytest.approx(r["request_throughput"])
    assert r["ttft_s"]["mean"] >= STEP_S and r["tpot_s"]["mean"] >= STEP_S
    sv = r["server_metrics"]
    assert sv["ttft_count"] == 16 and sv["generation_tokens"] == 16 * 8
    assert abs(r["ttft_s"]["mean"] / sv["ttft_mean_s"] - 1) < 0.10, (r["ttft_s"], sv)
    assert abs(r["e2e_s"]["mean"] / sv["e2e_mean_s"] - 1) < 0.10, (r["e2e_s"], sv)
    # throughput the server's own way: Little's law over its e2e histogram (4 in flight, 8 tokens each)
    server_tps = 4 * 8 / sv["e2e_mean_s"]
    assert abs(r["output_tokens_per_s"] / server_tps - 1) < 0.10, (r["output_tokens_per_s"], server_tps)
    assert r["endpoint"]["served_model_name"] == "tiny"
    print(f"ttft client/server {r['ttft_s']['mean'] / sv['ttft_mean_s']:.3f}, e2e {r['e2e_s']['mean'] / sv['e2e_mean_s']:.3f}"
          f", tok/s {r['output_tokens_per_s'] / server_tps:.3f}")


def test_poisson_rate_and_a_tight_slo(server, capsys):
    rc, r, err = _bench(capsys, "--endpoint", server.url, "--requests", "8", "--rate", "20", "--input-len", "8",
                        "--output-len", "4", "--slo", f"ttft={STEP_S / 10}", "--format", "json")
    assert rc == 0, err
    assert r["completed"] == 8 and r["failed"] == 0 and r["config"]["rate"] == 20
    # no request meets a TTFT bound below one model step: goodput 0, throughput still counted
    assert r["goodput"] == 0 and r["goodput_fraction"] == 0 and r["request_throughput"] > 0
    # the run lasts at least until the 8th Poisson arrival of the seeded schedule
    arrivals = poisson_arrivals(20, 1)
    last = [next(arrivals) for _ in range(8)][-1]
    assert r["duration_s"] >= last


def test_text_output_and_dataset(server, capsys, tmp_path):
    ds = tmp_path / "d.jsonl"
    ds.write_text('{"prompt": "hello there", "max_tokens": 3}\n{"prompt": [5, 6, 7, 8]}\n')
    rc, r, err = _bench(capsys, "--endpoint", server.url, "--requests", "4", "--concurrency", "2",
                        "--dataset", str(ds), "--output-len", "2", "--format", "json")
    assert rc == 0, err
    assert r["completed"] == 4 and r["output_tokens"] == 3 + 2 + 3 + 2
    capsys.readouterr()
    assert run_cli("bench", "serve", "--endpoint", server.url, "--requests", "2", "--output-len", "2") == 0
    out = capsys.readouterr().out
    assert "ttft_s" in out and "completed 2, failed 0" in out and "server /metrics" in out


def test_poisson_arrivals_are_exponential():
    it = poisson_arrivals(50.0, 7)
    t = [next(it) for _ in range(4000)]
    gaps = [b - a for a, b in zip([0.0] + t, t)]
    assert all(g > 0 for g in gaps)
    assert statistics.mean(gaps) == pytest.approx(1 / 50, rel=0.05)
    assert statistics.stdev(gaps) / statistics.mean(gaps) == pytest.approx(1.0, abs=0.06)  # exponential: CV 1
    it2 = poisson_arrivals(50.0, 7)
    assert [next(it2) for _ in range(5)] == t[:5]


def test_a_down_server_is_one_line_and_exit_2(capsys):
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    rc, r, err = _bench(capsys, "--endpoint", f"http://127.0.0.1:{port}", "--requests", "2", "--timeout", "2")
    assert rc == 2 and r is None
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "nothing could be reached" in lines[0], err


@pytest.mark.parametrize("args, needle", [
    (["--slo", "ttft"], "--slo"),
    (["--slo", "latency=1"], "--slo"),
    (["--slo", "ttft=fast"], "not a number"),
    (["--slo", "ttft=0"], "> 0"),
    (["--format", "xml"], "--format"),
    (["--dataset", "/nonexistent.jsonl"], "no such file"),
    (["--requests", "0"], "--requests"),
    (["--rate", "-1"], "--rate"),
], ids=["slo-no-value", "slo-key", "slo-nan", "slo-zero", "format", "dataset", "requests", "rate"])
def test_bad_flags_are_one_line(args, needle, capsys):
    rc, r, err = _bench(capsys, "--endpoint", "http://127.0.0.1:9", *args)
    assert rc == 2 and r is None
    lines = err.strip().splitlines()
    assert len(lines) == 1 and needle in lines[0] and "Traceback" not in err, err


def test_bad_endpoint_and_dataset_lines(capsys, tmp_path):
    rc, _, err = _bench(capsys, "--endpoint", "ftp://x")
    assert rc == 2 and len(err.strip().splitlines()) == 1, err
    ds = tmp_path / "bad.jsonl"
    ds.write_text('{"prompt": "ok"}\n{"text": "no prompt"}\n')
    from adapt.bench.load import load_dataset

    with pytest.raises(BenchInputError, match=r"bad.jsonl:2"):
        load_dataset(ds, 4)
    ds.write_text("not json\n")
    with pytest.raises(BenchInputError, match="not JSON"):
        load_dataset(ds, 4)


def test_stats_and_prometheus_parsing():
    import numpy as np

    xs = [0.3, 0.1, 0.7, 0.2, 0.9, 0.5, 0.4]
    for q in (50, 90, 99):
        assert percentile(xs, q) == pytest.approx(float(np.percentile(xs, q)))
    assert math.isnan(summary([])["p50"]) and summary(xs)["n"] == 7
    assert parse_slo("ttft=0.5, itl=0.05") == {"ttft": 0.5, "itl": 0.05}
    rec = {"ttft": 0.4, "itl": [0.01, 0.06], "e2e": 1.0, "tpot": 0.02}
    assert meets_slo(rec, {"ttft": 0.5}) and not meets_slo(rec, {"itl": 0.05}) and not meets_slo(rec, {"e2e": 0.9})
    page = ('# TYPE x:ttft_seconds histogram\nx:time_to_first_token_seconds_bucket{le="0.1",m="a"} 2\n'
            'x:time_to_first_token_seconds_bucket{le="+Inf",m="a"} 3\nx:time_to_first_token_seconds_sum{m="a"} 0.6\n'
            'x:time_to_first_token_seconds_count{m="a"} 3\nx:generation_tokens_total{m="a"} 30\n')
    after = parse(page)
    h = histogram(after, "x:time_to_first_token_seconds")
    assert h["count"] == 3 and h["sum"] == pytest.approx(0.6) and h["buckets"][math.inf] == 3
    before = parse(page.replace(" 3\n", " 1\n").replace("0.6", "0.1").replace(" 30", " 10"))
    v = server_view(before, after, 2.0)
    assert v["ttft_mean_s"] == pytest.approx(0.25) and v["ttft_count"] == 2
    assert v["generation_tokens"] == 20 and v["output_tokens_per_s"] == 10
    assert server_view(None, after, 1.0) is None
