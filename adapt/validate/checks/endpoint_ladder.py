"""The long-context ladder through an endpoint's API.

Each rung is a seeded prompt of L tokens (the reference's ``long_prompt``) sent as token ids with
``max_tokens: 1, logprobs: N``: the top-N logprobs of the first generated token are the server's
next-token distribution after the whole prompt, compared with the reference's at the last position (its
logits' log-softmax, or a golden's stored top-N). Rungs run from the checklist's lengths and on by x4 up to
the server's ``max_model_len``; a rung the reference cannot reach (context, memory, time budget) still runs
on the server, is timed and checked for a well-formed answer, and is marked not compared.

Metrics: ``top1_agreement`` (rungs whose top token equals the reference's, over compared rungs),
``logprob_max_abs`` (largest |difference| of a logprob over the ids both top-N hold), ``max_length``,
``rungs`` (each rung: length, seconds, compared, top-1 match, logprob difference, and ``latency_s`` p50 / p90 /
p99 over ``params.repeats`` requests of that length, the extra ones on prompts of their own seeds so that no
prefix cache answers them) for the report's plot.
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping
from typing import Any

import torch

from adapt.bench.stats import percentile
from adapt.validate.checklist import Outcome, Skip
from adapt.validate.checks.endpoint import _judged, _runner


def _ladder(lengths: list[int], server_limit: int | None) -> list[int]:
    rungs = sorted(set(lengths))
    if server_limit and rungs:
        x = rungs[-1] * 4
        while x < server_limit:
            rungs.append(x)
            x *= 4
    return rungs


def _reference_last(ctx, length: int, top_n: int) -> tuple[dict[int, float] | None, str | None]:
    """The reference's next-token logprobs after the rung's prompt (all ids or its top-N), or why not."""
    ref = ctx.reference
    limit = ref.max_position_embeddings
    if limit and length > limit:
        return None, f"beyond the reference's max_position_embeddings {limit}"
    stored = getattr(ref, "long_logprobs", None)
    if stored is not None and stored(length) is not None:
        return stored(length), None
    too_big = getattr(ref, "long_rung_too_big", None)
    if too_big is not None and too_big(length):
        return None, too_big(length)
    logits = ref.long_logits(length) if ref.long_prompt(length) is not None else None
    if logits is None:
        return None, "not in the golden directory"
    lp = torch.log_softmax(logits[-1].double(), dim=-1)
    return {i: float(v) for i, v in enumerate(lp.tolist())}, None


def _prompt(ctx, length: int) -> list[int]:
    ids = ctx.reference.long_prompt(length)
    if ids is None:
        from adapt.validate.reference import long_prompt

        ids = long_prompt(ctx.reference.vocab_size, length)
    return list(ids)


def _timed(run, ctx, length: int, r: int) -> float:
    """Seconds of one more request at the rung's length, on a prompt of its own (another seed: a repeat of the
    rung's prompt would be served from the server's prefix cache)."""
    from adapt.validate.reference import PROMPT_SEED, long_prompt

    ids = long_prompt(ctx.reference.vocab_size, length, seed=PROMPT_SEED + 7919 * r)
    t0 = time.perf_counter()
    run.complete(ids, 1, 1)
    return time.perf_counter() - t0


def endpoint_long_context(params: Mapping[str, Any], thresholds: Mapping[str, float], ctx) -> Outcome:
    run = _runner(ctx)
    top_n = int(params.get("top_n", 5))
    repeats = max(1, int(params.get("repeats", 1)))
    budget = float(params.get("time_budget_s", 60.0))
    server_limit = ctx.notes.get("max_model_len")
    rungs, skipped, last = [], [], None
    for length in _ladder([int(x) for x in params.get("lengths", [1024, 8192, 32768])], server_limit):
        if server_limit and length + 1 > server_limit:
            skipped.append(f"{length}: beyond the server's max_model_len {server_limit}")
            continue
        ref, why = (None, f"estimated {last[1] * (length / last[0]) ** 2:.0f}s > budget {budget:.0f}s") \
            if last is not None and last[1] * (length / last[0]) ** 2 > budget else (None, None)
        t_ref = time.perf_counter()
        if why is None:
            ref, why = _reference_last(ctx, length, top_n)
        t_ref = time.perf_counter() - t_ref
        if ref is not None:
            last = (length, max(t_ref, 1e-3))
        t0 = time.perf_counter()
        c = run.complete(_prompt(ctx, length), 1, top_n)
        seconds = time.perf_counter() - t0
        times = [seconds] + [_timed(run, ctx, length, r) for r in range(1, repeats)]
        if not c.logprobs or not c.logprobs[0] or not all(math.isfinite(v) for v in c.logprobs[0].values()):
            return Outcome({"rungs": rungs}, status="fail", message=f"rung {length}: no finite top-{top_n} logprobs "
                                                                     f"in the answer")
        got = c.logprobs[0]
        rung: dict[str, Any] = {"length": length, "seconds": round(seconds, 4), "compared": ref is not None,
                                "latency_s": {q: round(percentile(times, float(q[1:])), 4) for q in ("p50", "p90", "p99")}
                                | {"n": len(times)}}
        if ref is not None:
            common = [i for i in got if i in ref]
            rung["top1_match"] = float(max(got, key=got.get) == max(ref, key=ref.get))
            rung["logprob_max_abs"] = max((abs(got[i] - ref[i]) for i in common), default=math.inf)
        else:
            rung["why_not_compared"] = why
        rungs.append(rung)
    compared = [r for r in rungs if r["compared"]]
    if not compared:
        raise Skip("no rung could be compared with the reference: "
                   + "; ".join(skipped + [f"{r['length']}: {r['why_not_compared']}" for r in rungs]))
    m = {"top1_agreement": sum(r["top1_match"] for r in compared) / len(compared),
         "logprob_max_abs": max(r["logprob_max_abs"] for r in compared),
         "max_length": max(r["length"] for r in rungs), "rungs": rungs}
    served_only = [r["length"] for r in rungs if not r["compared"]]
    msg = (f"rungs {[r['length'] for r in compared]} vs the reference (next token after the prompt, top-{top_n})"
           + (f"; {served_only} served only (the reference cannot reach them)" if served_only else "")
           + (f"; skipped {'; '.join(skipped)}" if skipped else ""))
    return _judged(m, thresholds, msg)
