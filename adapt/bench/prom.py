"""A server's Prometheus ``/metrics``: parse the text exposition format, sample it over a soak, summarize drift.

Parsing is hand-written (about 30 lines) rather than prometheus_client's parser: the bench reads any server's
page (vLLM's, SGLang's, adapt's) and needs only samples by name and labels, without making prometheus_client a
dependency of a client-side command.

Drift over a soak: for every gauge-like series (not ``_total`` / ``_count`` / ``_sum`` / ``_bucket``) the first
and last samples and their ratio; for counters the rate over the first and last halves of the run. A client-side
drift of TTFT and e2e (p50 of the first vs the last third of the requests) is reported beside it by the CLI.
"""

from __future__ import annotations

import math
import re
import threading
import time
from typing import Any

from adapt.validate.openai_client import Client, EndpointError

_LINE = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{(.*)\})?\s+(\S+)')
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')
_COUNTER_SUFFIXES = ("_total", "_count", "_sum", "_bucket", "_created")


def parse(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """{(name, sorted labels): value} of every sample line; comments and unparsable lines are skipped."""
    out = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = _LINE.match(line)
        if not m:
            continue
        try:
            v = float(m.group(4))
        except ValueError:
            continue
        labels = tuple(sorted(_LABEL.findall(m.group(3) or "")))
        out[(m.group(1), labels)] = v
    return out


def histogram(samples: dict, name: str) -> dict[str, float] | None:
    """Sum, count and cumulative buckets {le: count} of histogram ``name`` summed over its other labels."""
    total = {k: v for k, v in samples.items() if k[0] == f"{name}_count"}
    if not total:
        return None
    buckets: dict[float, float] = {}
    for (n, labels), v in samples.items():
        if n == f"{name}_bucket":
            le = dict(labels).get("le")
            if le is not None:
                key = math.inf if le in ("+Inf", "Inf") else float(le)
                buckets[key] = buckets.get(key, 0.0) + v
    return {"sum": sum(v for k, v in samples.items() if k[0] == f"{name}_sum"), "count": sum(total.values()),
            "buckets": dict(sorted(buckets.items()))}


def scrape(client: Client) -> dict | None:
    """Samples of GET /metrics, or None when the server has no such page."""
    try:
        status, body = client.get("/metrics", timeout=min(client.timeout, 10.0))
    except EndpointError:
        return None
    return parse(body) if status == 200 and isinstance(body, str) else None


class Sampler:
    """Scrapes /metrics every ``every`` seconds on a thread until ``stop()``."""

    def __init__(self, client: Client, every: float):
        self.client, self.every = client, every
        self.samples: list[tuple[float, dict]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> Sampler:
        self._thread.start()
        return self

    def _run(self) -> None:
        while True:
            s = scrape(self.client)
            if s is not None:
                self.samples.append((time.perf_counter(), s))
            if self._stop.wait(self.every):
                return

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=self.every + 15)
        s = scrape(self.client)
        if s is not None:
            self.samples.append((time.perf_counter(), s))


def _label_text(key) -> str:
    name, labels = key
    return name + ("{" + ",".join(f'{k}="{v}"' for k, v in labels) + "}" if labels else "")


def drift(samples: list[tuple[float, dict]]) -> dict[str, Any]:
    """Gauges first -> last and counter rates first half -> last half (see the module docstring)."""
    if len(samples) < 3:
        return {"samples": len(samples), "note": "fewer than 3 /metrics samples: no drift"}
    (t0, first), (tm, mid), (t1, last) = samples[0], samples[len(samples) // 2], samples[-1]
    gauges, rates = {}, {}
    for key, v0 in first.items():
        if key not in last or key[0].endswith("_bucket") or key[0].endswith("_created"):
            continue
        v1 = last[key]
        if key[0].endswith(_COUNTER_SUFFIXES):
            if key in mid and tm > t0 and t1 > tm:
                r0, r1 = (mid[key] - v0) / (tm - t0), (v1 - mid[key]) / (t1 - tm)
                rates[_label_text(key)] = {"first_half_per_s": r0, "last_half_per_s": r1,
                                           "ratio": r1 / r0 if r0 else None}
        else:
            gauges[_label_text(key)] = {"first": v0, "last": v1, "ratio": v1 / v0 if v0 else None}
    return {"samples": len(samples), "seconds": t1 - t0, "gauges": gauges, "counter_rates": rates}


def _find(samples: dict, suffix: str) -> str | None:
    """The metric name ending in ``suffix`` (any prefix: ``vllm:``, ``adapt:``, ``sglang:``), or None."""
    names = sorted({k[0] for k in samples if k[0].endswith(suffix)})
    return names[0] if names else None


def server_view(before: dict | None, after: dict | None, duration_s: float) -> dict[str, Any] | None:
    """The server's own account of a run from two /metrics scrapes around it: mean TTFT and e2e (histogram
    sum / count deltas), generated tokens and their rate over the client's duration. None without /metrics."""
    if before is None or after is None:
        return None
    out: dict[str, Any] = {}
    for key, suffix in (("ttft_mean_s", "time_to_first_token_seconds"), ("e2e_mean_s", "e2e_request_latency_seconds"),
                        ("itl_mean_s", "inter_token_latency_seconds"),
                        ("tpot_mean_s", "time_per_output_token_seconds")):
        name = _find(after, suffix + "_count")
        if name is None:
            continue
        base = name[: -len("_count")]
        h0, h1 = histogram(before, base) or {"sum": 0.0, "count": 0.0}, histogram(after, base)
        n = h1["count"] - h0["count"]
        if n > 0:
            out[key] = (h1["sum"] - h0["sum"]) / n
            out[key.replace("_mean_s", "_count")] = n
    gen = _find(after, "generation_tokens_total")
    if gen is not None:
        d = sum(v for k, v in after.items() if k[0] == gen) - sum(v for k, v in before.items() if k[0] == gen)
        out["generation_tokens"] = d
        out["output_tokens_per_s"] = d / duration_s if duration_s > 0 else 0.0
    return out or None
