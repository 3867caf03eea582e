"""GET /metrics: the service's Prometheus series, named as vLLM's so that existing dashboards map one to one.

Every series carries ``model_name`` and the prefix ``adapt:`` (``--metrics-prefix vllm`` exports them as
``vllm:`` for dashboards that hard-code it). Per-request histograms are observed on the engine loop
thread when a request finishes; the state of the engine (running / waiting requests, KV usage, prefix
cache, preemptions) is read at scrape time by a collector, so a scrape never waits for a step. Each
service has its own registry (several services in one process do not collide).
"""

from __future__ import annotations

import time
from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from adapt.runtime.scheduler import Sequence

CONTENT_TYPE = CONTENT_TYPE_LATEST
# vLLM's buckets (seconds), so histograms line up on the same dashboards
_TTFT = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
         80.0, 160.0, 640.0, 2560.0)
_ITL = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
_REQ = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0,
        960.0, 1920.0, 7680.0)


class _EngineState:
    """Scrape-time series read from the engine loop and its KV cache."""

    def __init__(self, prefix: str, model: str, read: Callable[[], dict]):
        self.prefix, self.model, self.read = prefix, model, read

    def collect(self):
        s = self.read()
        p, lab = self.prefix, [self.model]

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            g = GaugeMetricFamily(f"{p}:{name}", doc, labels=["model_name"])
            g.add_metric(lab, value)
            return g

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            c = CounterMetricFamily(f"{p}:{name}", doc, labels=["model_name"])
            c.add_metric(lab, value)
            return c

        yield gauge("num_requests_running", "Sequences in the running batch.", s["running"])
        yield gauge("num_requests_waiting", "Sequences waiting to be scheduled.", s["waiting"])
        yield gauge("kv_cache_usage_perc", "Fraction of KV-cache blocks in use (1 = full).", s["kv_usage"])
        yield gauge("kv_cache_bytes", "Bytes of the preallocated KV-cache pool.", s["kv_bytes"])
        yield gauge("model_weight_bytes", "Bytes of the model's weights on the device.", s["weight_bytes"])
        yield counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", s["pc_queries"])
        yield counter("prefix_cache_hits", "Prompt tokens found in the prefix cache.", s["pc_hits"])
        yield counter("num_preemptions", "Sequences preempted (recomputed later) for lack of KV blocks.",
                      s["preemptions"])

    def describe(self):
        return []  # no fixed description: collected fresh on every scrape


class ServiceMetrics:
    """The registry and the loop-thread callbacks (``finished``, ``token_gap``) that feed it."""

    def __init__(self, model: str, prefix: str = "adapt", read_state: Callable[[], dict] | None = None):
        self.registry = CollectorRegistry(auto_describe=True)
        self.prefix = prefix
        r, p, lab = self.registry, prefix, ["model_name"]

        def hist(name: str, doc: str, buckets) -> Histogram:
            return Histogram(f"{p}:{name}", doc, lab, registry=r, buckets=buckets).labels(model)

        self.ttft = hist("time_to_first_token_seconds", "Time to first token, from arrival.", _TTFT)
        self.itl = hist("inter_token_latency_seconds", "Time between two tokens of a sequence.", _ITL)
        self.tpot = hist("request_time_per_output_token_seconds", "Decode time per output token of a request.",
                         _ITL)
        self.e2e = hist("e2e_request_latency_seconds", "Arrival to last token.", _REQ)
        self.queue = hist("request_queue_time_seconds", "Arrival to first scheduled.", _REQ)
        self.prefill = hist("request_prefill_time_seconds", "First scheduled to first token.", _REQ)
        self.decode = hist("request_decode_time_seconds", "First token to last token.", _REQ)
        self.prompt_tokens = Counter(f"{p}:prompt_tokens", "Prompt tokens of finished requests.", lab,
                                     registry=r).labels(model)
        self.generation_tokens = Counter(f"{p}:generation_tokens", "Generated tokens of finished requests.", lab,
                                         registry=r).labels(model)
        self.success = Counter(f"{p}:request_success", "Finished sequences by finish reason.",
                               ["model_name", "finished_reason"], registry=r)
        self._model = model
        if read_state is not None:
            r.register(_EngineState(prefix, model, read_state))

    def finished(self, seq: Sequence, t) -> None:
        """A sequence finished (or was aborted); ``t`` its loop.Timing. Called on the loop thread."""
        now = time.monotonic()
        self.success.labels(self._model, seq.finish_reason or "abort").inc()
        self.prompt_tokens.inc(seq.num_prompt_tokens)
        self.generation_tokens.inc(seq.num_output_tokens)
        self.e2e.observe(now - t.arrival)
        if t.scheduled is not None:
            self.queue.observe(t.scheduled - t.arrival)
        if t.first_token is not None:
            self.ttft.observe(t.first_token - t.arrival)
            if t.scheduled is not None:
                self.prefill.observe(t.first_token - t.scheduled)
            if t.last_token is not None:
                self.decode.observe(t.last_token - t.first_token)
                if seq.num_output_tokens > 1:
                    self.tpot.observe((t.last_token - t.first_token) / (seq.num_output_tokens - 1))

    def token_gap(self, seconds: float) -> None:
        self.itl.observe(seconds)

    def exposition(self) -> bytes:
        """The text format of every series."""
        return generate_latest(self.registry)
