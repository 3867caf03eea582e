"""``adapt bench serve``: load an OpenAI-compatible server and measure it (TTFT, ITL, TPOT, e2e, throughput,
goodput under an SLO, errors by kind).

Every request is a streamed ``/v1/completions`` (token-id prompts of ``input_len`` tokens, or a dataset's
prompts), greedy, ``ignore_eos`` where the server takes it so the output length is what was asked. Times are
taken on the client as each SSE event arrives: TTFT is request start to the first event carrying text or
token ids, ITL the gaps between such events (an event carrying k tokens counts its gap once, as vLLM's
benchmark does), TPOT ``(e2e - TTFT) / (output tokens - 1)``, e2e start to ``[DONE]``. Output tokens are the
server's ``usage.completion_tokens`` (``stream_options.include_usage``) where it reports them, else the token
ids it streamed, else the count of content events.

Arrivals: ``concurrency`` C keeps C requests in flight (closed loop); ``rate`` R sends at Poisson times of
mean rate R requests/s (open loop; ``concurrency`` then caps how many are in flight). ``soak`` runs for that
many seconds instead of ``requests`` and samples ``/metrics`` (see bench/prom.py).
"""

from __future__ import annotations

import json
import random
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from adapt.bench.stats import BenchInputError, meets_slo, summary
from adapt.validate.openai_client import Client, EndpointError

EXTENSIONS = {"ignore_eos": True, "return_token_ids": True, "stream_options": {"include_usage": True}}


@dataclass
class LoadConfig:
    requests: int = 64
    concurrency: int | None = None
    rate: float | None = None
    input_len: int = 128
    output_len: int = 64
    dataset: Path | None = None
    slo: dict[str, float] = field(default_factory=dict)
    seed: int = 0
    vocab_size: int = 256  # prompt ids are drawn from [3, vocab_size): ids every real vocabulary has
    model: str | None = None
    soak_s: float | None = None
    sample_every_s: float | None = None


def load_dataset(path: Path, n: int) -> list[dict[str, Any]]:
    """JSONL, one request a line: {"prompt": text or token ids, "max_tokens"?: n}; cycled to ``n`` requests."""
    try:
        lines = [ln for ln in Path(path).read_text(encoding="utf-8").splitlines() if ln.strip()]
    except OSError as e:
        raise BenchInputError(f"--dataset {path}: {e.strerror or e}") from None
    rows = []
    for k, ln in enumerate(lines, 1):
        try:
            d = json.loads(ln)
        except json.JSONDecodeError:
            raise BenchInputError(f"--dataset {path}:{k}: not JSON") from None
        p = d.get("prompt") if isinstance(d, dict) else None
        ok = isinstance(p, str) and p or isinstance(p, list) and p and all(isinstance(t, int) for t in p)
        if not ok:
            raise BenchInputError(f"--dataset {path}:{k}: needs \"prompt\": a string or a list of token ids")
        mt = d.get("max_tokens", d.get("output_len"))
        if mt is not None and not (isinstance(mt, int) and mt >= 1):
            raise BenchInputError(f"--dataset {path}:{k}: max_tokens must be an integer >= 1")
        rows.append({"prompt": p, "max_tokens": mt})
    if not rows:
        raise BenchInputError(f"--dataset {path}: no requests in it")
    return [rows[i % len(rows)] for i in range(n)]


def make_requests(cfg: LoadConfig, n: int) -> list[dict[str, Any]]:
    if cfg.dataset is not None:
        rows = load_dataset(cfg.dataset, n)
        return [{"prompt": r["prompt"], "max_tokens": r["max_tokens"] or cfg.output_len} for r in rows]
    rng = random.Random(cfg.seed)
    return [{"prompt": [rng.randrange(3, cfg.vocab_size) for _ in range(cfg.input_len)], "max_tokens": cfg.output_len}
            for _ in range(n)]


def poisson_arrivals(rate: float, seed: int) -> Iterator[float]:
    """Arrival offsets (seconds from the start) of a Poisson process of mean ``rate`` per second: cumulative
    exponential gaps, seeded, so a run's schedule is reproducible."""
    rng, t = random.Random(seed), 0.0
    while True:
        t += rng.expovariate(rate)
        yield t


def one_request(client: Client, req: dict[str, Any], model: str | None) -> dict[str, Any]:
    """Send one streamed completion; returns its record (ok, times, tokens, or the error kind)."""
    body = ({"model": model} if model else {}) | {"prompt": req["prompt"], "max_tokens": req["max_tokens"],
                                                   "temperature": 0.0}
    t0 = time.perf_counter()
    rec: dict[str, Any] = {"ok": False, "start": t0}
    times, n_ids, usage = [], 0, None
    try:
        for _ in range(3):  # extension negotiation: a 400 naming one drops it (client-wide) and retries
            ext = {k: v for k, v in EXTENSIONS.items() if k not in client.dropped}
            try:
                for t, ev in client.stream("/v1/completions", {**body, **ext}):
                    if isinstance(ev.get("usage"), dict) and ev["usage"].get("completion_tokens") is not None:
                        usage = int(ev["usage"]["completion_tokens"])
                    for c in ev.get("choices") or []:
                        ids = c.get("token_ids") or []
                        if c.get("text") or ids:
                            times.append(t)
                            n_ids += len(ids)
                break
            except EndpointError as e:
                hit = client._refused(e, ext) if not times else None
                if hit is None:
                    raise
                client.dropped.add(hit)
    except EndpointError as e:
        rec.update(error=e.kind, message=str(e), end=time.perf_counter())
        return rec
    end = time.perf_counter()
    if not times:
        rec.update(error="empty", message="the stream carried no tokens", end=end)
        return rec
    out = usage if usage is not None else (n_ids or len(times))
    ttft, e2e = times[0] - t0, end - t0
    rec.update(ok=True, end=end, ttft=ttft, e2e=e2e, output_tokens=out,
               input_tokens=len(req["prompt"]) if isinstance(req["prompt"], list) else None,
               itl=[b - a for a, b in zip(times, times[1:])],
               tpot=(e2e - ttft) / (out - 1) if out > 1 else None)
    return rec


def run_load(client: Client, cfg: LoadConfig, on_done: Callable[[dict], None] | None = None,
             stop: threading.Event | None = None) -> list[dict[str, Any]]:
    """Run the requests (or until ``cfg.soak_s``) and return one record per request sent."""
    soak = cfg.soak_s is not None
    n = cfg.requests if not soak else max(cfg.requests, 1)
    reqs = make_requests(cfg, n)
    width = cfg.concurrency or (64 if cfg.rate else 1)
    records: list[dict[str, Any]] = []
    lock = threading.Lock()
    stop = stop or threading.Event()
    t_begin = time.perf_counter()
    deadline = t_begin + cfg.soak_s if soak else None

    def work(k: int) -> None:
        if stop.is_set() or (deadline is not None and time.perf_counter() >= deadline):
            return
        rec = one_request(client, reqs[k % len(reqs)], cfg.model)
        with lock:
            records.append(rec)
        if on_done is not None:
            on_done(rec)

    with ThreadPoolExecutor(width) as pool:
        if cfg.rate:  # open loop: Poisson arrivals, at most `width` in flight
            gate = threading.Semaphore(width)
            arrivals, k, futs = poisson_arrivals(cfg.rate, cfg.seed + 1), 0, []
            while (k < n if not soak else time.perf_counter() < deadline) and not stop.is_set():
                time.sleep(max(0.0, t_begin + next(arrivals) - time.perf_counter()))
                gate.acquire()
                fut = pool.submit(work, k)
                fut.add_done_callback(lambda _f: gate.release())
                futs.append(fut)
                k += 1
            for f in futs:
                f.result()
        else:  # closed loop: each worker sends its next request when the last one ends
            counter = iter(range(10**12 if soak else n))
            take = threading.Lock()

            def worker() -> None:
                while not stop.is_set():
                    with take:
                        k = next(counter, None)
                    if k is None or (deadline is not None and time.perf_counter() >= deadline):
                        return
                    work(k)

            for f in [pool.submit(worker) for _ in range(width)]:
                f.result()
    return records


def aggregate(records: list[dict[str, Any]], cfg: LoadConfig, duration_s: float) -> dict[str, Any]:
    """The JSON result: latency summaries, counts, throughput, goodput, errors by kind."""
    ok = [r for r in records if r["ok"]]
    errors: dict[str, int] = {}
    for r in records:
        if not r["ok"]:
            errors[r["error"]] = errors.get(r["error"], 0) + 1
    out_tokens = sum(r["output_tokens"] for r in ok)
    in_tokens = sum(r["input_tokens"] or 0 for r in ok)
    good = [r for r in ok if meets_slo(r, cfg.slo)]
    first_errors = {}
    for r in records:
        if not r["ok"] and r["error"] not in first_errors:
            first_errors[r["error"]] = r["message"][:300]
    return {
        "completed": len(ok), "failed": len(records) - len(ok), "errors": errors, "error_examples": first_errors,
        "duration_s": duration_s,
        "ttft_s": summary([r["ttft"] for r in ok]), "itl_s": summary([x for r in ok for x in r["itl"]]),
        "tpot_s": summary([r["tpot"] for r in ok if r["tpot"] is not None]), "e2e_s": summary([r["e2e"] for r in ok]),
        "request_throughput": len(ok) / duration_s if duration_s > 0 else 0.0,
        "output_tokens_per_s": out_tokens / duration_s if duration_s > 0 else 0.0,
        "input_tokens_per_s": in_tokens / duration_s if duration_s > 0 else 0.0,
        "output_tokens": out_tokens, "input_tokens": in_tokens,
        "goodput": len(good) / duration_s if duration_s > 0 else 0.0,
        "goodput_fraction": len(good) / len(records) if records else 0.0,
        "slo": cfg.slo,
        "config": {"requests": cfg.requests, "concurrency": cfg.concurrency, "rate": cfg.rate,
                   "input_len": cfg.input_len if cfg.dataset is None else None, "output_len": cfg.output_len,
                   "dataset": str(cfg.dataset) if cfg.dataset else None, "seed": cfg.seed, "soak_s": cfg.soak_s},
    }
