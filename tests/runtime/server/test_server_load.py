"""Bounded load through real sockets: 256 connections at once (each completes or gets 429 with
Retry-After, none is reset), and a few hundred mixed requests (plain, streamed, cancelled mid-stream)
whose outputs equal the sequential ones, with the KV cache empty afterwards."""

from __future__ import annotations

import asyncio
import json
import random
import time

import pytest

from tests.runtime.server.conftest import TIMEOUT


@pytest.fixture(scope="module")
def eng(tiny_llama):
    from adapt.runtime.engine import Engine

    return Engine.from_pretrained(tiny_llama, kv_cache_memory="16MiB", max_model_len=256, max_num_seqs=16,
                                  enable_prefix_caching=True, enable_chunked_prefill=True, max_num_batched_tokens=64)


def _prompts(n: int) -> list[list[int]]:
    rng = random.Random(0)
    shared = [rng.randrange(3, 500) for _ in range(40)]  # a common system prompt: prefix-cache hits
    return [(shared if i % 2 else []) + [rng.randrange(3, 500) for _ in range(rng.randrange(2, 30))]
            for i in range(n)]


@pytest.fixture(scope="module")
def sequential(eng):
    """Each prompt alone, before the server owns the engine: the results the load must reproduce."""
    from adapt.runtime.sampling import SamplingParams

    sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    return [eng.generate([p], sp)[0].token_ids for p in _prompts(40)]


async def _post(client, url: str, body: dict, stream: bool = False, cancel_after: int | None = None):
    """(status, token ids or None, headers); cancel_after: hang up after that many events."""
    if not stream:
        r = await client.post(url, json=body)
        return r.status_code, (r.json()["choices"][0]["token_ids"] if r.status_code == 200 else None), r.headers
    ids, events = [], 0
    async with client.stream("POST", url, json={**body, "stream": True}) as r:
        if r.status_code != 200:
            await r.aread()
            return r.status_code, None, r.headers
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            ids += json.loads(line[6:])["choices"][0]["token_ids"]
            events += 1
            if cancel_after is not None and events >= cancel_after:
                return 499, None, r.headers  # leaving the block closes the connection mid-stream
    return 200, ids, r.headers


def _idle(srv, eng, timeout: float = 20.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not srv.service.pending and eng.block_manager.usage().used_blocks == 0 and not srv.service.loop.load()["running"]:
            return True
        time.sleep(0.05)
    return False


def test_256_connections_complete_or_429(eng, sequential):
    httpx = pytest.importorskip("httpx")
    from adapt.runtime.server import ServiceConfig, start_server

    prompts = _prompts(40)
    with start_server(eng, config=ServiceConfig("tiny", max_pending=96)) as srv:
        async def main():
            limits = httpx.Limits(max_connections=300, max_keepalive_connections=0)
            async with httpx.AsyncClient(limits=limits, timeout=TIMEOUT) as c:
                url = srv.url + "/v1/completions"
                return await asyncio.gather(*[
                    _post(c, url, {"prompt": prompts[i % 40], "max_tokens": 8, "temperature": 0, "ignore_eos": True,
                                   "return_token_ids": True}) for i in range(256)], return_exceptions=True)

        out = asyncio.run(main())
        errors = [o for o in out if isinstance(o, BaseException)]
        assert not errors, errors[:3]  # no reset, no connection error
        assert {s for s, _, _ in out} <= {200, 429}
        ok = [(i, ids) for i, (s, ids, _) in enumerate(out) if s == 200]
        assert len(ok) >= 96 and all(ids == sequential[i % 40] for i, ids in ok)
        assert all(h.get("retry-after") == "1" for s, _, h in out if s == 429)
        assert _idle(srv, eng)


def test_mixed_load_with_cancellations(eng, sequential):
    httpx = pytest.importorskip("httpx")
    from adapt.runtime.server import ServiceConfig, start_server

    prompts = _prompts(40)
    n = 240
    with start_server(eng, config=ServiceConfig("tiny")) as srv:
        async def main():
            sem = asyncio.Semaphore(32)
            async with httpx.AsyncClient(limits=httpx.Limits(max_connections=64), timeout=TIMEOUT) as c:
                url = srv.url + "/v1/completions"

                async def one(i: int):
                    async with sem:
                        body = {"prompt": prompts[i % 40], "max_tokens": 8, "temperature": 0, "ignore_eos": True,
                                "return_token_ids": True}
                        kind = i % 5
                        if kind == 0:  # hang up after two tokens
                            return await _post(c, url, {**body, "max_tokens": 150}, stream=True, cancel_after=2)
                        return await _post(c, url, body, stream=kind % 2 == 1)

                return await asyncio.gather(*[one(i) for i in range(n)], return_exceptions=True)

        out = asyncio.run(main())
        errors = [o for o in out if isinstance(o, BaseException)]
        assert not errors, errors[:3]
        for i, (status, ids, _) in enumerate(out):
            if i % 5 == 0:
                assert status == 499
            else:
                assert status == 200 and ids == sequential[i % 40], i
        assert _idle(srv, eng)  # every cancelled stream's blocks came back
        st = srv.service.loop.stats
        assert st["requests"] == n and st["max_batch_seqs"] > 1
        assert eng.block_manager.prefix_cache.hits > 0
