"""serving_load: an endpoint's latency and throughput at rising concurrency (``adapt validate --endpoint``).

For each level C of ``params.concurrency`` the load generator of ``adapt bench serve`` (adapt/bench/load.py)
keeps C streamed ``/v1/completions`` in flight over ``requests`` seeded token-id prompts of ``input_len`` tokens
(a fresh seed per level, so no level is served from the prefix cache of another) with ``output_len`` greedy
tokens each, and records TTFT, ITL and end-to-end latency (mean, p50, p90, p99) and request and output token
throughput, measured on the client as the events arrive. report.html plots the percentiles per level.

Metrics: ``levels`` (one row per concurrency), ``failed`` (requests without a complete answer, over all levels),
``max_concurrency``, ``output_tokens_per_s_peak``, ``scaling`` (output tokens/s at the highest level over the
lowest: how much the server's batching buys). Times are this host's view of a server elsewhere: they are
reported, and only ``failed`` is thresholded by the shipped checklist.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

from adapt.validate.checklist import Outcome, Skip


def endpoint_load(params: Mapping[str, Any], thresholds: Mapping[str, float], ctx, run, judged) -> Outcome:
    from adapt.bench.load import LoadConfig, aggregate, run_load

    levels = sorted({int(c) for c in params.get("concurrency", [1, 2, 4, 8]) if int(c) >= 1})
    if not levels:
        raise Skip("params.concurrency names no level >= 1")
    n, in_len, out_len = int(params.get("requests", 8)), int(params.get("input_len", 128)), int(params.get("output_len", 16))
    limit = ctx.notes.get("max_model_len")
    if limit and in_len + out_len > limit:
        raise Skip(f"input_len {in_len} + output_len {out_len} exceed the server's max_model_len {limit}")
    rows, failed, examples = [], 0, {}
    for k, c in enumerate(levels):
        cfg = LoadConfig(requests=max(n, c), concurrency=c, input_len=in_len, output_len=out_len, seed=1000 + k,
                         vocab_size=ctx.reference.vocab_size, model=run.model)
        t0 = time.perf_counter()
        recs = run_load(run.client, cfg)
        agg = aggregate(recs, cfg, time.perf_counter() - t0)
        failed += agg["failed"]
        examples.update({k2: v for k2, v in agg["error_examples"].items() if k2 not in examples})
        rows.append({"concurrency": c, "completed": agg["completed"], "failed": agg["failed"],
                     **{key: {q: agg[key][q] for q in ("mean", "p50", "p90", "p99")} for key in ("ttft_s", "itl_s", "e2e_s")},
                     "request_throughput": agg["request_throughput"], "output_tokens_per_s": agg["output_tokens_per_s"]})
    tps = [r["output_tokens_per_s"] for r in rows]
    m = {"levels": rows, "failed": failed, "max_concurrency": levels[-1], "output_tokens_per_s_peak": max(tps),
         "scaling": tps[-1] / tps[0] if tps[0] > 0 else 0.0, "input_len": in_len, "output_len": out_len}
    top = rows[-1]
    msg = (f"concurrency {levels}: {sum(r['completed'] for r in rows)} requests of {in_len}+{out_len} tokens; at "
           f"{top['concurrency']}: TTFT p50 {top['ttft_s']['p50'] * 1e3:.0f} ms / p99 {top['ttft_s']['p99'] * 1e3:.0f} "
           f"ms, {top['output_tokens_per_s']:.0f} tok/s ({m['scaling']:.2f}x level {levels[0]})")
    if examples:
        msg += "; errors: " + "; ".join(f"{k}: {v}" for k, v in examples.items())
    return judged(m, thresholds, msg)
