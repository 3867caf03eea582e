"""Requests from several clients are batched into the same steps, each equal to its solo result; the
service shuts down cleanly, in-process and as `adapt serve` on SIGTERM."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request

import pytest

from tests.runtime.server.conftest import PROMPTS, TIMEOUT, Client, load_engine


def test_concurrent_requests_equal_solo_results(client, server, offline):
    solo = {}
    for p in PROMPTS:  # one at a time: nothing else in the batch
        status, body = client.post("/v1/completions", {"prompt": p, "max_tokens": 12, "temperature": 0,
                                                       "return_token_ids": True})
        assert status == 200
        solo[p] = body["choices"][0]
        assert solo[p]["token_ids"] == offline[p].token_ids
    before = dict(server.service.loop.stats)
    results, errors = {}, []
    barrier = threading.Barrier(len(PROMPTS))

    def worker(p: str) -> None:
        try:
            barrier.wait(TIMEOUT)
            results[p] = client.post("/v1/completions", {"prompt": p, "max_tokens": 12, "temperature": 0,
                                                         "return_token_ids": True})
        except Exception as e:  # reported below, never lost in the thread
            errors.append(repr(e))

    threads = [threading.Thread(target=worker, args=(p,)) for p in PROMPTS]
    for t in threads:
        t.start()
    for t in threads:
        t.join(TIMEOUT)
    assert not errors and len(results) == len(PROMPTS)
    for p, (status, body) in results.items():
        assert status == 200
        c = body["choices"][0]
        assert (c["token_ids"], c["text"]) == (solo[p]["token_ids"], solo[p]["text"])
    stats = server.service.loop.stats
    assert stats["max_batch_seqs"] > 1  # they shared steps
    # 6 sequences x 12 tokens solo would take 6 x 12 steps; batched it takes far fewer
    assert stats["steps"] - before["steps"] < len(PROMPTS) * 12


def test_in_process_shutdown(tiny_llama):
    from adapt.runtime.server import start_server

    eng = load_engine(tiny_llama)
    srv = start_server(eng, port=0, model_name="m")
    c = Client(srv.url)
    assert c.request("GET", "/health")[0] == 200
    t0 = time.monotonic()
    srv.stop()
    assert time.monotonic() - t0 < 5
    assert not srv.service.loop.alive
    try:
        urllib.request.urlopen(srv.url + "/health", timeout=2)
        raise AssertionError("the server still answers after stop()")
    except OSError:
        pass
    assert eng.block_manager.usage().used_blocks == 0


def test_cli_serve_prints_url_and_stops_on_sigterm(tiny_llama):
    env = dict(os.environ, ADAPT_CACHE=str(tiny_llama.parent.parent))
    p = subprocess.Popen([sys.executable, "-m", "adapt", "serve", str(tiny_llama), "--port", "0",
                          "--kv-cache-memory", "16MiB", "--max-model-len", "128", "--served-model-name", "cli"],
                         stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, env=env)
    try:
        line = ""
        deadline = time.monotonic() + 60
        while "serving" not in line and time.monotonic() < deadline and p.poll() is None:
            line = p.stderr.readline()
        assert line.startswith("serving cli on http://127.0.0.1:"), line
        url = line.split(" on ", 1)[1].strip()
        status, body = Client(url).post("/v1/completions", {"prompt": "hi", "max_tokens": 2, "temperature": 0})
        assert status == 200 and body["model"] == "cli"
        p.send_signal(signal.SIGTERM)
        assert p.wait(timeout=20) == 0
    finally:
        if p.poll() is None:
            p.kill()
            p.wait(5)


def test_timeout_and_disconnect_abort_and_free_the_cache(tiny_llama):
    from adapt.runtime.server import ServiceConfig, start_server
    from adapt.runtime.server.loop import _hold_back

    assert _hold_back("hello wo", ("world",)) == "hello " and _hold_back("abc", ("x",)) == "abc"
    eng = load_engine(tiny_llama)
    step = eng.runner.step

    def slow_step(*args, **kwargs):  # 250 tokens take >= 250 x 20 ms = 5 s on any machine: the 0.2 s timeout fires
        time.sleep(0.02)
        return step(*args, **kwargs)

    eng.runner.step = slow_step
    with start_server(eng, port=0, config=ServiceConfig("m", request_timeout_s=0.2)) as srv:
        c = Client(srv.url)
        status, body = c.post("/v1/completions", {"prompt": "hi", "max_tokens": 250, "ignore_eos": True})
        assert status == 504 and body["error"]["code"] == "timeout"
        req = urllib.request.Request(srv.url + "/v1/completions", data=b'{"prompt": "hi", "max_tokens": 250, '
                                     b'"ignore_eos": true, "stream": true}')
        with urllib.request.urlopen(req, timeout=TIMEOUT) as r:
            r.readline()  # one event, then hang up
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and (srv.service.pending or eng.block_manager.usage().used_blocks):
            time.sleep(0.05)
        assert srv.service.pending == 0 and eng.block_manager.usage().used_blocks == 0
        assert c.request("GET", "/health")[0] == 200


@pytest.mark.parametrize("window, gap, announced", [(0.05, 0.01, False), (0.01, 0.03, True)],
                         ids=["within-window", "announced-by-http"])
def test_a_burst_reaching_an_idle_loop_is_prefilled_together(tiny_llama, window, gap, announced):
    """Four requests ``gap`` apart reach an idle loop: one prefill step takes all four (without the window the
    first would be prefilled alone while the others arrive). Arrivals further apart than the window are waited
    for while ``arriving()`` says the HTTP side is still reading them (up to 10x the window)."""
    from adapt.runtime.sampling import SamplingParams
    from adapt.runtime.server.loop import Delta, EngineLoop

    eng = load_engine(tiny_llama)
    batches = []
    step = eng.runner.step_with_prompt_logits

    def record(sb):
        batches.append((sb.kind, len(sb.seqs)))
        return step(sb)

    eng.runner.step_with_prompt_logits = record

    class Out:
        def __init__(self):
            self.tokens, self.done = [], threading.Event()

        def put(self, ev):
            assert isinstance(ev, Delta), ev
            self.tokens += ev.token_ids
            if ev.finish_reason is not None:
                self.done.set()

    sent = []
    loop = EngineLoop(eng, batch_window_s=window, arriving=(lambda: 4 - len(sent)) if announced else None)
    loop.start()
    try:
        outs = [Out() for _ in range(4)]
        sp = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
        for i, o in enumerate(outs):
            sent.append(loop.submit([5 + i, 6, 7], sp, o))
            time.sleep(gap)
        assert all(o.done.wait(TIMEOUT) for o in outs)
    finally:
        loop.stop()
    assert batches[0] == ("prefill", 4), batches
    assert [len(o.tokens) for o in outs] == [4] * 4
