"""A served tiny-llama on 127.0.0.1 (port 0) and a small urllib client; every call has a timeout."""

from __future__ import annotations

import json
import os
import urllib.error
import urllib.request

import pytest

TIMEOUT = 30  # seconds per HTTP call
PROMPTS = ["Hello world", "The quick brown fox", "a b c d e", "Once upon a time", "1 2 3", "zebra"]


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory):
    old = os.environ.get("ADAPT_CACHE")
    os.environ["ADAPT_CACHE"] = str(tmp_path_factory.mktemp("adapt-cache"))
    try:
        from adapt.runtime.init_model import builtin_checkpoint

        return builtin_checkpoint("tiny-llama")
    finally:
        os.environ.pop("ADAPT_CACHE") if old is None else os.environ.__setitem__("ADAPT_CACHE", old)


def load_engine(path):
    from adapt.runtime.engine import Engine

    return Engine.from_pretrained(path, kv_cache_memory="16MiB", max_model_len=256, max_num_seqs=16)


@pytest.fixture(scope="module")
def engine(tiny_llama):
    return load_engine(tiny_llama)


@pytest.fixture(scope="module")
def offline(engine):
    """Greedy results of the engine itself, computed before the server owns it: prompt -> result."""
    from adapt.runtime.sampling import SamplingParams

    ids = [engine.tokenizer.encode(p) for p in PROMPTS]
    res = engine.generate(ids, SamplingParams(temperature=0, max_tokens=12))
    return dict(zip(PROMPTS, res))


@pytest.fixture(scope="module")
def server(engine, offline):
    from adapt.runtime.server import ServiceConfig, start_server

    cfg = ServiceConfig(model_name="tiny", max_request_bytes=4096, request_timeout_s=60)
    srv = start_server(engine, "127.0.0.1", 0, config=cfg)
    yield srv
    srv.stop()


class Client:
    def __init__(self, url: str):
        self.url = url

    def request(self, method: str, path: str, body=None, raw: bytes | None = None, headers=None):
        """(status, parsed JSON body)."""
        data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
        req = urllib.request.Request(self.url + path, data=data, method=method,
                                     headers={"Content-Type": "application/json", **(headers or {})})
        try:
            with urllib.request.urlopen(req, timeout=TIMEOUT) as r:
                return r.status, json.loads(r.read())
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read())

    def post(self, path: str, body):
        return self.request("POST", path, body)

    def stream(self, path: str, body) -> list:
        """The parsed ``data:`` events of a streamed request, "[DONE]" included as the string."""
        req = urllib.request.Request(self.url + path, data=json.dumps({**body, "stream": True}).encode(),
                                     headers={"Content-Type": "application/json"})
        events = []
        with urllib.request.urlopen(req, timeout=TIMEOUT) as r:
            assert r.headers["Content-Type"].startswith("text/event-stream")
            for line in r:
                line = line.decode().strip()
                if line.startswith("data: "):
                    payload = line[len("data: "):]
                    events.append(payload if payload == "[DONE]" else json.loads(payload))
        return events


@pytest.fixture(scope="module")
def client(server) -> Client:
    return Client(server.url)
