"""adapt serve through HTTP against adapt's own offline engine, on a ~100M-parameter llama built in this script.

Prints one JSON document:
  throughput: 16 concurrent streamed requests through HTTP (tokens/s over the wall time, TTFT and ITL p50 /
    p99) against the same 16 prompts, max_tokens and greedy sampling as one offline ``Engine.generate`` batch on
    the same engine (the peer, its prefill included), rounds alternated; the ratio is the median of the per-round
    ratios (the headline: wall clock from the first connection to the last token, so the server's admission of
    the 16 arrivals counts), ``steady_ratio`` the same from the moment every stream has its first token, and
    ``engine_steps`` how many model steps each round took (64 tokens: 1 prefill + 63 decodes without a ramp).
    The load generator runs in its own process over bare asyncio connections (httpx's per-event parsing in the
    server's process took ~8% of the 2-core host's throughput: 0.83x -> 0.93x here);
  prefix_cache: TTFT of a request whose 512-token prefix was just served against the first request with
    that prefix (ratio; target <= 0.3), and whether the cached greedy tokens equal an uncached server's;
  chunked_prefill: while 4 streams decode, a 4096-token prompt arrives; the streams' inter-token latency
    (p50 / p99 / max) during its prefill with chunked prefill on against off (the peer).
Medians of a few repeats after a warm-up. The machine this runs on may be shared: say so beside a figure.

    python bench/serve_bench.py [--dtype float32] [--tokens 64] [--repeats 3] [--chunk 512] [--throughput-only]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from adapt.runtime.engine import Engine  # noqa: E402
from adapt.runtime.sampling import SamplingParams  # noqa: E402
from adapt.runtime.server import ServiceConfig, start_server  # noqa: E402

MODEL = dict(model_type="llama", hidden_size=768, intermediate_size=2048, num_hidden_layers=12,
             num_attention_heads=12, num_key_value_heads=4, vocab_size=32000, max_position_embeddings=8192,
             bos_token_id=1, eos_token_id=2)


def build(out: Path) -> Path:
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(0)
    m = AutoModelForCausalLM.from_config(LlamaConfig(**MODEL))
    m.save_pretrained(out)
    return out


def pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


async def stream(client, url: str, body: dict) -> dict:
    """One streamed completion: arrival times of its tokens and the tokens."""
    t0 = time.perf_counter()
    times, ids = [], []
    async with client.stream("POST", url, json={**body, "stream": True, "return_token_ids": True}) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                got = json.loads(line[6:])["choices"][0]["token_ids"]
                now = time.perf_counter()
                times += [now] * len(got)
                ids += got
    return {"start": t0, "times": times, "ids": ids}


async def raw_stream(url: str, body: dict) -> dict:
    """stream() over a bare asyncio connection (HTTP/1.1, chunked transfer): the load generator's own CPU per
    event is a fraction of httpx's, and on a 2-core host every cycle it spends is taken from the server."""
    from urllib.parse import urlsplit

    u = urlsplit(url)
    payload = json.dumps({**body, "stream": True, "return_token_ids": True}).encode()
    t0 = time.perf_counter()
    reader, writer = await asyncio.open_connection(u.hostname, u.port)
    writer.write(f"POST {u.path} HTTP/1.1\r\nHost: {u.netloc}\r\nContent-Type: application/json\r\n"
                 f"Content-Length: {len(payload)}\r\nConnection: close\r\n\r\n".encode() + payload)
    await writer.drain()
    head = await reader.readuntil(b"\r\n\r\n")
    if not head.startswith(b"HTTP/1.1 200"):
        raise RuntimeError(head.split(b"\r\n", 1)[0].decode())
    chunked = b"transfer-encoding: chunked" in head.lower()
    times, ids, buf = [], [], b""
    while True:
        if chunked:
            size = int((await reader.readuntil(b"\r\n")).strip(), 16)
            if size == 0:
                break
            data = await reader.readexactly(size + 2)
            buf += data[:-2]
        else:
            data = await reader.read(65536)
            if not data:
                break
            buf += data
        now = time.perf_counter()
        *events, buf = buf.split(b"\n\n")
        for ev in events:
            if ev.startswith(b"data: {"):
                got = json.loads(ev[6:])["choices"][0]["token_ids"]
                times += [now] * len(got)
                ids += got
    writer.close()
    return {"start": t0, "times": times, "ids": ids}


def run_async(coro):
    return asyncio.run(coro)


def _round(url: str, prompts: list[list[int]], n: int) -> dict:
    """One round of the load generator: every prompt streamed at once, all 16 connections opened together."""
    async def once():
        t0 = time.perf_counter()
        res = await asyncio.gather(*[raw_stream(url + "/v1/completions", {
            "prompt": p, "max_tokens": n, "temperature": 0, "ignore_eos": True}) for p in prompts])
        return time.perf_counter() - t0, res

    wall, res = run_async(once())
    short = [len(r["ids"]) for r in res if len(r["ids"]) != n]
    if short:
        raise RuntimeError(f"streams ended early: {short} tokens of {n}")
    # steady state: from the moment every stream has its first token (the ramp and all prefills are over)
    all_first = max(r["times"][0] for r in res)
    end = max(r["times"][-1] for r in res)
    after = sum(1 for r in res for t in r["times"] if t > all_first)
    return {"wall_s": wall, "ttft": [r["times"][0] - r["start"] for r in res],
            "itl": [b - a for r in res for a, b in zip(r["times"], r["times"][1:])],
            "steady_tokens_per_s": after / (end - all_first) if end > all_first else None}


class Client:
    """The load generator in its own process, as a client is (vLLM's and SGLang's serving benchmarks are separate
    processes too): in the server's process its JSON parsing of every SSE event would take the GIL from the
    server's engine and HTTP threads and be counted against the server. One ``round()`` per call, so HTTP rounds
    can alternate with the offline peer's."""

    def __init__(self, url: str, prompts: list[list[int]], n: int, in_process: bool = False):
        self.job = {"url": url, "prompts": prompts, "n": n}
        self.proc = None
        if not in_process:
            self.proc = subprocess.Popen([sys.executable, __file__, "--client"], stdin=subprocess.PIPE,
                                         stdout=subprocess.PIPE, text=True)
            self.proc.stdin.write(json.dumps(self.job) + "\n")
            self.proc.stdin.flush()

    def round(self) -> dict:
        if self.proc is None:
            return _round(self.job["url"], self.job["prompts"], self.job["n"])
        self.proc.stdin.write("go\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the load generator exited ({self.proc.wait()})")
        return json.loads(line)

    def close(self) -> None:
        if self.proc is not None:
            self.proc.stdin.close()
            self.proc.wait(30)


def _client_main() -> None:
    """--client: read the job line, then run one round per line that follows; one JSON line out per round."""
    job = json.loads(sys.stdin.readline())
    for _ in sys.stdin:
        print(json.dumps(_round(job["url"], job["prompts"], job["n"])), flush=True)


def _offline_round(engine, prompts: list[list[int]], sp: SamplingParams) -> dict:
    t0 = time.perf_counter()
    engine.generate(prompts, sp)
    wall = time.perf_counter() - t0
    st = engine.last_stats
    steady = None
    if st["time_to_first_token_s"] is not None and st["total_s"] > st["time_to_first_token_s"]:
        steady = len(prompts) * (sp.max_tokens - 1) / (st["total_s"] - st["time_to_first_token_s"])
    return {"wall_s": wall, "steady_tokens_per_s": steady, "steps": st["steps"]}


def throughput(srv, engine, prompts: list[list[int]], n: int, repeats: int, in_process: bool = False) -> dict:
    """HTTP at concurrency len(prompts) against the same prompts as one offline ``Engine.generate`` batch on the
    same engine, rounds alternated (offline, HTTP, offline, ...) so that a load change on a shared host falls on
    both sides; the ratio is the median of the per-round ratios. Between HTTP rounds the server's engine loop is
    idle (no request in flight), so the offline batch is the only user of the engine and its KV cache."""
    sp = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
    client = Client(srv.url, prompts, n, in_process)
    loop = srv.service.loop
    try:
        engine.generate(prompts, sp)  # warm-up, both sides
        client.round()
        off, http, steps = [], [], []
        for _ in range(repeats):
            off.append(_offline_round(engine, prompts, sp))
            before = loop.stats["steps"]
            http.append(client.round())
            steps.append(loop.stats["steps"] - before)
    finally:
        client.close()
    tokens = len(prompts) * n
    ratios = [(tokens / h["wall_s"]) / (tokens / o["wall_s"]) for o, h in zip(off, http)]
    steady = [h["steady_tokens_per_s"] / o["steady_tokens_per_s"] for o, h in zip(off, http)
              if h["steady_tokens_per_s"] and o["steady_tokens_per_s"]]
    ttft = [x for h in http for x in h["ttft"]]
    itl = [x for h in http for x in h["itl"]]
    med = statistics.median
    return {
        "adapt_http": {"tokens_per_s": round(tokens / med([h["wall_s"] for h in http]), 2),
                       "wall_s": round(med([h["wall_s"] for h in http]), 4),
                       "steady_tokens_per_s": round(med([h["steady_tokens_per_s"] for h in http]), 2),
                       "engine_steps": steps,
                       "ttft_p50_s": round(pct(ttft, 0.5), 4), "ttft_p99_s": round(pct(ttft, 0.99), 4),
                       "itl_p50_s": round(pct(itl, 0.5), 5), "itl_p99_s": round(pct(itl, 0.99), 5)},
        "peer_offline_batch16": {"tokens_per_s": round(tokens / med([o["wall_s"] for o in off]), 2),
                                 "wall_s": round(med([o["wall_s"] for o in off]), 4),
                                 "steady_tokens_per_s": round(med([o["steady_tokens_per_s"] for o in off]), 2),
                                 "engine_steps": [o["steps"] for o in off]},
        "ratio": round(med(ratios), 3), "ratios": [round(r, 3) for r in ratios],
        "steady_ratio": round(med(steady), 3) if steady else None,
    }


def prefix_ttft(srv, vocab: int, repeats: int, seed: int) -> dict:
    import httpx

    g = torch.Generator().manual_seed(seed)

    async def pair(prefix):
        async with httpx.AsyncClient(timeout=600) as c:
            url = srv.url + "/v1/completions"
            a = await stream(c, url, {"prompt": prefix + [5, 6, 7], "max_tokens": 4, "temperature": 0,
                                      "ignore_eos": True})
            b = await stream(c, url, {"prompt": prefix + [8, 9], "max_tokens": 4, "temperature": 0,
                                      "ignore_eos": True})
            return a, b

    run_async(pair(torch.randint(3, vocab, (512,), generator=g).tolist()))  # warm-up
    first, second, outs = [], [], []
    for _ in range(repeats):
        a, b = run_async(pair(torch.randint(3, vocab, (512,), generator=g).tolist()))
        first.append(a["times"][0] - a["start"])
        second.append(b["times"][0] - b["start"])
        outs.append(b["ids"])
    return {"ttft_first_s": round(statistics.median(first), 4), "ttft_shared_prefix_s": round(statistics.median(second), 4),
            "outputs": outs}


def itl_during_long_prefill(srv, vocab: int, long_len: int) -> dict:
    import httpx

    g = torch.Generator().manual_seed(1)
    long_prompt = torch.randint(3, vocab, (long_len,), generator=g).tolist()

    async def main():
        async with httpx.AsyncClient(timeout=600) as c:
            url = srv.url + "/v1/completions"
            streams = [asyncio.create_task(stream(c, url, {"prompt": [3 + i, 4, 5], "max_tokens": 400,
                                                           "temperature": 0, "ignore_eos": True})) for i in range(4)]
            await asyncio.sleep(1.0)  # the streams are decoding
            t0 = time.perf_counter()
            long = await stream(c, url, {"prompt": long_prompt, "max_tokens": 1, "temperature": 0})
            t1 = long["times"][0]
            res = await asyncio.gather(*streams)
            return t0, t1, res

    t0, t1, res = run_async(main())
    gaps = [b - a for r in res for a, b in zip(r["times"], r["times"][1:]) if b > t0 and a < t1]
    return {"long_prompt_tokens": long_len, "long_ttft_s": round(t1 - t0, 4), "tokens_during_prefill": len(gaps),
            "itl_p50_s": round(pct(gaps, 0.5) or 0, 4), "itl_p99_s": round(pct(gaps, 0.99) or 0, 4),
            "itl_max_s": round(max(gaps) if gaps else 0, 4)}


def main() -> None:
    if sys.argv[1:] == ["--client"]:
        _client_main()
        return
    ap = argparse.ArgumentParser()
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--chunk", type=int, default=512, help="--max-num-batched-tokens of the chunked server")
    ap.add_argument("--long", type=int, default=4096)
    ap.add_argument("--throughput-only", action="store_true", help="skip the prefix-cache and chunked-prefill parts")
    ap.add_argument("--in-process-client", action="store_true",
                    help="run the load generator in the server's process (counts its GIL time against the server)")
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        path = build(Path(d) / "llama")
        kw = dict(device=a.device, dtype=a.dtype, kv_cache_memory="1GiB", max_model_len=8192, max_num_seqs=32)
        on = Engine.from_pretrained(path, enable_prefix_caching=True, enable_chunked_prefill=True,
                                    max_num_batched_tokens=a.chunk, **kw)
        off = None if a.throughput_only else Engine.from_pretrained(path, max_num_batched_tokens=8192, **kw)
        vocab = on.spec.vocab_size
        g = torch.Generator().manual_seed(0)
        prompts = [torch.randint(3, vocab, (32,), generator=g).tolist() for _ in range(16)]
        with start_server(on, config=ServiceConfig("bench")) as srv:
            tp = throughput(srv, on, prompts, a.tokens, a.repeats, a.in_process_client)
            if not a.throughput_only:
                cached = prefix_ttft(srv, vocab, a.repeats, seed=7)
                chunked = itl_during_long_prefill(srv, vocab, a.long)
        if not a.throughput_only:
            with start_server(off, config=ServiceConfig("bench")) as srv:
                uncached = prefix_ttft(srv, vocab, a.repeats, seed=7)
                whole = itl_during_long_prefill(srv, vocab, a.long)
    out = {
        "bench": "serve", "model": {k: MODEL[k] for k in ("hidden_size", "num_hidden_layers", "vocab_size")},
        "dtype": a.dtype, "device": a.device, "torch": torch.__version__, "host": platform.processor() or platform.machine(),
        "threads": torch.get_num_threads(),
        "throughput": {"concurrency": 16, "max_tokens": a.tokens,
                       "client": "bare asyncio HTTP/1.1, " + ("in the server's process" if a.in_process_client else "own process"),
                       "rounds": "offline and HTTP alternated; ratio: median of per-round ratios of wall-clock tokens/s "
                                 "(prefill and any admission ramp included); steady_ratio: the same after every "
                                 "stream has its first token", **tp},
    }
    if a.throughput_only:
        print(json.dumps(out, indent=1))
        return
    out.update({
        "prefix_cache": {"prefix_tokens": 512, "ttft_first_s": cached["ttft_first_s"],
                         "ttft_shared_prefix_s": cached["ttft_shared_prefix_s"],
                         "ratio": round(cached["ttft_shared_prefix_s"] / cached["ttft_first_s"], 3),
                         "peer_no_cache_ttft_s": uncached["ttft_shared_prefix_s"],
                         "outputs_equal_uncached": cached["outputs"] == uncached["outputs"]},
        "chunked_prefill": {"max_num_batched_tokens": a.chunk, "adapt_chunked": chunked, "peer_unchunked": whole,
                            "itl_max_ratio": round(chunked["itl_max_s"] / whole["itl_max_s"], 3)
                            if whole["itl_max_s"] else None},
    })
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
