"""What an operator relies on: the API key, /metrics in Prometheus' format with vLLM's series, cancelled
streams freeing the KV cache, the golden health check, and the smaller routes clients call."""

from __future__ import annotations

import json
import socket
import time
import urllib.request

import pytest

from tests.runtime.server.conftest import TIMEOUT, Client, load_engine

KEY = "sk-test-0123456789"
SERIES = {  # name -> Prometheus type, as vLLM exports them
    "time_to_first_token_seconds": "histogram", "inter_token_latency_seconds": "histogram",
    "request_time_per_output_token_seconds": "histogram", "e2e_request_latency_seconds": "histogram",
    "request_queue_time_seconds": "histogram", "request_prefill_time_seconds": "histogram",
    "request_decode_time_seconds": "histogram", "num_requests_running": "gauge", "num_requests_waiting": "gauge",
    "kv_cache_usage_perc": "gauge", "prompt_tokens": "counter", "generation_tokens": "counter",
    "request_success": "counter", "prefix_cache_queries": "counter", "prefix_cache_hits": "counter",
    "num_preemptions": "counter", "model_weight_bytes": "gauge", "kv_cache_bytes": "gauge",
}


class KeyClient(Client):
    def __init__(self, url: str, key: str | None):
        super().__init__(url)
        self.key = key

    def request(self, method, path, body=None, raw=None, headers=None):
        h = {"Authorization": f"Bearer {self.key}"} if self.key else {}
        return super().request(method, path, body, raw, {**h, **(headers or {})})


@pytest.fixture(scope="module")
def eng(tiny_llama):
    from adapt.runtime.engine import Engine

    return Engine.from_pretrained(tiny_llama, kv_cache_memory="16MiB", max_model_len=256, max_num_seqs=32,
                                  enable_prefix_caching=True, enable_chunked_prefill=True, max_num_batched_tokens=32)


@pytest.fixture(scope="module")
def golden_file(eng, tmp_path_factory):
    """Cases recorded from the engine itself before it serves."""
    from adapt.runtime.sampling import SamplingParams

    prompts = [eng.tokenizer.encode("Hello world"), [1, 5, 9, 13, 2, 7]]
    res = eng.generate(prompts, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    f = tmp_path_factory.mktemp("golden") / "cases.json"
    f.write_text(json.dumps({"cases": [{"prompt_token_ids": p, "token_ids": r.token_ids}
                                       for p, r in zip(prompts, res)]}))
    return f


@pytest.fixture(scope="module")
def srv(eng, golden_file):
    from adapt.runtime.server import ServiceConfig, start_server

    cfg = ServiceConfig("tiny", api_key=KEY, health_golden=str(golden_file), health_golden_interval_s=1.0)
    s = start_server(eng, config=cfg)
    yield s
    s.stop()


def _metrics(url: str) -> dict:
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(url + "/metrics", timeout=TIMEOUT) as r:
        text = r.read().decode()
    return {f.name: f for f in text_string_to_metric_families(text)}


def _value(fams: dict, name: str, suffix: str = "", **labels) -> float:
    f = fams["adapt:" + name]
    return sum(s.value for s in f.samples if s.name == f"adapt:{name}{suffix}"
               and all(s.labels.get(k) == v for k, v in labels.items()))


def test_api_key_guards_every_v1_route(srv):
    anon, bad, good = Client(srv.url), KeyClient(srv.url, "wrong"), KeyClient(srv.url, KEY)
    body = {"prompt": "hi", "max_tokens": 2, "temperature": 0}
    for c in (anon, bad):
        for method, path, b in (("GET", "/v1/models", None), ("POST", "/v1/completions", body),
                                ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]}),
                                ("POST", "/tokenize", {"prompt": "x"}), ("GET", "/version", None)):
            status, out = c.request(method, path, b)
            assert status == 401 and out["error"]["code"] == "invalid_api_key", (path, out)
    assert good.request("GET", "/v1/models")[0] == 200
    assert good.post("/v1/completions", body)[0] == 200
    assert anon.request("GET", "/health")[0] == 200  # liveness stays open to load balancers
    assert urllib.request.urlopen(srv.url + "/metrics", timeout=TIMEOUT).status == 200  # no --metrics-auth


def test_metrics_auth_puts_metrics_behind_the_key(eng):
    from adapt.runtime.server import ServiceConfig, start_server

    with start_server(eng, config=ServiceConfig("m", api_key=KEY, metrics_auth=True, metrics_prefix="vllm")) as s:
        assert Client(s.url).request("GET", "/metrics")[0] == 401
        req = urllib.request.Request(s.url + "/metrics", headers={"Authorization": f"Bearer {KEY}"})
        text = urllib.request.urlopen(req, timeout=TIMEOUT).read().decode()
        assert "vllm:kv_cache_usage_perc" in text and "adapt:" not in text


def test_metrics_parse_and_carry_every_series(srv):
    c = KeyClient(srv.url, KEY)
    prompt = list(range(3, 3 + 80))  # five full blocks: the second request finds four of them cached
    before = _metrics(srv.url)
    for _ in range(2):
        assert c.post("/v1/completions", {"prompt": prompt, "max_tokens": 5, "temperature": 0,
                                           "ignore_eos": True})[0] == 200
    fams = _metrics(srv.url)
    for name, kind in SERIES.items():
        assert "adapt:" + name in fams and fams["adapt:" + name].type == kind, name
    assert _value(fams, "prompt_tokens", "_total") - _value(before, "prompt_tokens", "_total") == 160
    assert _value(fams, "generation_tokens", "_total") - _value(before, "generation_tokens", "_total") == 10
    assert _value(fams, "request_success", "_total", finished_reason="length") >= 2
    hits = _value(fams, "prefix_cache_hits", "_total") - _value(before, "prefix_cache_hits", "_total")
    assert hits >= 64  # the second prompt's first four blocks of 16
    assert _value(fams, "time_to_first_token_seconds", "_count") >= 2
    assert _value(fams, "model_weight_bytes") > 0 and _value(fams, "kv_cache_bytes") > 0


def _open_stream(port: int, body: dict) -> socket.socket:
    data = json.dumps({**body, "stream": True}).encode()
    s = socket.create_connection(("127.0.0.1", port), timeout=TIMEOUT)
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              + f"Authorization: Bearer {KEY}\r\nContent-Length: {len(data)}\r\n\r\n".encode() + data)
    got = b""
    while b"data: " not in got:  # the first event arrived: the request is running
        got += s.recv(4096)
    return s


def test_cancelled_streams_free_the_cache(srv, eng, monkeypatch):
    step = eng.runner.step

    def slow_step(*args, **kwargs):  # 200 tokens take >= 4 s: every stream is still running when it is cut
        time.sleep(0.02)
        return step(*args, **kwargs)

    monkeypatch.setattr(eng.runner, "step", slow_step)
    aborted = _value(_metrics(srv.url), "request_success", "_total", finished_reason="abort")
    socks = [_open_stream(srv.port, {"prompt": [7, 8, 9, i], "max_tokens": 200, "ignore_eos": True})
             for i in range(24)]
    fams = _metrics(srv.url)
    assert _value(fams, "num_requests_running") > 0 and _value(fams, "kv_cache_usage_perc") > 0
    for s in socks:
        s.close()
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        fams = _metrics(srv.url)
        if _value(fams, "num_requests_running") == 0 and _value(fams, "kv_cache_usage_perc") == 0:
            break
        time.sleep(0.1)
    assert _value(fams, "num_requests_running") == 0 and _value(fams, "kv_cache_usage_perc") == 0
    assert _value(fams, "request_success", "_total", finished_reason="abort") - aborted == 24
    assert srv.service.pending == 0


def test_golden_health_catches_wrong_tokens(srv, monkeypatch):
    c = Client(srv.url)  # no key: load balancers probe it
    status, body = c.request("GET", "/health/golden")
    assert status == 200 and body["status"] == "ok" and all(x["match"] for x in body["cases"]), body
    from adapt.runtime.server import loop

    real = loop.sample

    def off_by_one(logits, params, gens, *rest):  # healthy but wrong: every token shifted
        res = real(logits, params, gens, *rest)
        res.token_ids = (res.token_ids + 1) % logits.shape[-1]
        return res

    monkeypatch.setattr(loop, "sample", off_by_one)
    time.sleep(1.1)  # past the interval: the next probe replays
    status, body = c.request("GET", "/health/golden")
    assert status == 503 and body["status"] == "mismatch" and body["cases"][0]["first_mismatch"] == 0
    assert c.request("GET", "/health")[0] == 200  # liveness cannot see it
    monkeypatch.setattr(loop, "sample", real)
    time.sleep(1.1)
    assert c.request("GET", "/health/golden")[0] == 200


def test_bad_golden_file_is_one_line(eng, tmp_path):
    from adapt.errors import AdaptError
    from adapt.runtime.server import ServiceConfig, start_server

    f = tmp_path / "g.json"
    f.write_text(json.dumps({"cases": [{"prompt_token_ids": [1], "token_ids": [10 ** 9]}]}))
    with pytest.raises(AdaptError, match="outside this model's vocabulary"):
        start_server(eng, config=ServiceConfig("m", health_golden=str(f)))


def test_small_routes(srv, eng):
    c = KeyClient(srv.url, KEY)
    status, card = c.request("GET", "/v1/models/tiny")
    assert status == 200 and card["id"] == "tiny" and card["max_model_len"] == 256
    assert c.request("GET", "/v1/models/other")[1]["error"]["code"] == "model_not_found"
    status, tok = c.post("/tokenize", {"prompt": "Hello world"})
    assert status == 200 and tok["tokens"] == eng.tokenizer.encode("Hello world") and tok["count"] == len(tok["tokens"])
    status, chat = c.post("/tokenize", {"messages": [{"role": "user", "content": "hi"}]})
    assert chat["tokens"] == eng.tokenizer.encode_chat([{"role": "user", "content": "hi"}])
    status, det = c.post("/detokenize", {"tokens": tok["tokens"]})
    assert status == 200 and det["prompt"] == eng.tokenizer.decode(tok["tokens"])
    assert c.post("/detokenize", {"tokens": [10 ** 7]})[0] == 400
    status, ver = c.request("GET", "/version")
    assert status == 200 and ver["version"]


def test_sampling_controls(srv):
    c = KeyClient(srv.url, KEY)
    base = {"prompt": "Hello world", "max_tokens": 6, "temperature": 0, "return_token_ids": True}
    plain = c.post("/v1/completions", base)[1]["choices"][0]["token_ids"]
    forced = c.post("/v1/completions", {**base, "logit_bias": {"42": 100}})[1]["choices"][0]["token_ids"]
    assert forced == [42] * 6 and plain != forced
    # the frequency penalty takes 2 per occurrence off the bias of 3: 42 wins until it is used twice
    rep = c.post("/v1/completions", {**base, "max_tokens": 12, "logit_bias": {"42": 3},
                                      "frequency_penalty": 2.0})[1]["choices"][0]["token_ids"]
    assert rep[:2] == [42, 42] and rep.count(42) == 2, rep
    r = c.post("/v1/completions", {**base, "n": 3, "temperature": 1.0, "seed": 5})[1]
    assert [ch["index"] for ch in r["choices"]] == [0, 1, 2] and r["usage"]["completion_tokens"] == 18
    again = c.post("/v1/completions", {**base, "n": 3, "temperature": 1.0, "seed": 5})[1]
    assert [ch["token_ids"] for ch in r["choices"]] == [ch["token_ids"] for ch in again["choices"]]
    g = c.post("/v1/completions", {**base, "n": 2})[1]["choices"]
    assert g[0]["token_ids"] == g[1]["token_ids"] == plain  # greedy n: shared prefill, equal choices
    assert c.post("/v1/completions", {**base, "min_p": 0.5, "temperature": 1.0})[0] == 200
    assert c.post("/v1/completions", {**base, "repetition_penalty": 1.3})[0] == 200
