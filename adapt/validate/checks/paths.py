"""parallel_consistency, long_context and kv_quant_impact (image_path: checks/image.py).

Each needs a stage that may be missing (a vision tower, the distributed runtime, a KV cache that can
be quantized) and is ``skip`` with the reason then. The long-context ladder runs the rungs the model's
``max_position_embeddings`` and a time budget allow: a rung's time is estimated from the previous one
(quadratic in length, attention's cost) and skipped with the estimate when it would exceed the budget.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

import torch

from adapt.validate import compare
from adapt.validate.checklist import Outcome, Skip, apply_thresholds, register_check


def _distributed_runner():
    try:
        from adapt.runtime import distributed
    except ImportError:
        return None
    return getattr(distributed, "run_layout", None)


def _divides(ctx, layout: dict[str, int]) -> None:
    """Skip, with the plan's arithmetic, a layout the model cannot divide (checked before any launch)."""
    from adapt.errors import PlanError
    from adapt.plan import ParallelPlan

    try:
        ParallelPlan.build(ctx.target.engine.spec, **layout)
    except PlanError as e:
        raise Skip(f"layout {_label(layout)}: {e}") from None


def _label(layout: dict[str, int]) -> str:
    return ".".join(f"{k}{layout.get(k, 1)}" for k in ("tp", "pp", "ep", "dp"))


@register_check("parallel_consistency")
def parallel_consistency(params: Mapping[str, Any], thresholds: Mapping[str, float], ctx) -> Outcome:
    """The layout's prefill logits of the first prompt against one rank's (max_abs, cosine), and its greedy
    tokens (``max_new_tokens``, default 4) against one rank's: any differing token fails the item. A layout
    whose ranks fail fails the item with the rank named; one the model cannot divide is skipped."""
    if ctx.target.engine is None:
        raise Skip("parallel layouts run on adapt's distributed runtime, which did not run this target "
                   f"({ctx.target.reason or 'runtime ' + ctx.target.runtime})")
    run_layout = _distributed_runner()
    if run_layout is None:
        raise Skip("adapt.runtime.distributed generates tokens but exposes no multi-rank prefill logits to "
                   "compare with one rank at these thresholds yet")
    from adapt.errors import CheckpointError, DistributedError, PlanError

    layout = {k: int(params[k]) for k in ("tp", "pp", "ep", "dp") if k in params}
    name = params.get("layout") or _label(layout)
    _divides(ctx, layout)
    n_new = int(params.get("max_new_tokens", 4))
    kw = dict(device=ctx.device, dtype=ctx.dtype, timeout_s=float(params.get("timeout_s", 180)), **layout)
    one = ctx.target_logits(0)
    try:
        run = run_layout(ctx.target.path, ctx.prompts[0], max_new_tokens=n_new, **kw)
    except (PlanError, CheckpointError) as e:  # cannot divide, or cannot re-shard: said, not failed
        raise Skip(f"layout {name}: {e}") from None
    except DistributedError as e:  # the layout's ranks failed: that is this item failing
        return Outcome({}, status="fail", message=f"layout {name}: {e}")
    many, tokens = run.logits, run.tokens
    m = {"max_abs": compare.max_abs(many, one), "cosine": compare.cosine(many, one)}
    msg = f"layout {run.layout} vs one rank, {many.shape[0]} positions ({run.seconds:.1f} s)"
    if n_new > 0:
        ref = ctx.target_generation(0, n_new, 1).tokens
        same = sum(a == b for a, b in zip(tokens, ref))
        m["greedy_tokens_identical"] = same / max(len(ref), 1)
        if tokens != ref:
            first = next((i for i, (a, b) in enumerate(zip(tokens, ref)) if a != b), min(len(tokens), len(ref)))
            return Outcome(m, status="fail", message=f"{msg}: greedy token {first} differs ({tokens} vs one "
                                                     f"rank's {ref})")
        msg += f"; {len(ref)} greedy tokens identical"
    return Outcome(m, message=msg)


def _tail(run, ids: list[int], n: int) -> torch.Tensor:
    fn = getattr(run, "tail_logits", None)
    return fn(ids, n) if fn is not None else run.prefill_logits(ids)[-n:]


@register_check("long_context")
def long_context(params: Mapping[str, Any], thresholds: Mapping[str, float], ctx) -> Outcome:
    run = ctx.need_runner()
    if ctx.low_precision:
        raise Skip(f"the ladder's {ctx.dtype} ratio needs plain torch at each rung; run it in float32")
    budget = float(params.get("time_budget_s", 60.0))
    limit = ctx.reference.max_position_embeddings
    done, skipped, worst_abs, worst_cos, worst_lp, top1, last = [], [], 0.0, 1.0, 0.0, [], None
    top_n_only: list[int] = []
    for length in sorted(int(x) for x in params.get("lengths", [1024, 8192, 32768])):
        if limit and length > limit:
            skipped.append(f"{length}: beyond max_position_embeddings {limit}")
            continue
        too_big = getattr(ctx.reference, "long_rung_too_big", None)  # a live reference computes the rung here
        if too_big is not None and too_big(length):
            skipped.append(f"{length}: {too_big(length)}")
            continue
        if last is not None and last[1] * (length / last[0]) ** 2 > budget:
            skipped.append(f"{length}: estimated {last[1] * (length / last[0]) ** 2:.0f}s > budget {budget:.0f}s")
            continue
        ids = ctx.reference.long_prompt(length)
        t0 = time.perf_counter()
        ref = ctx.reference.long_logits(length) if ids is not None else None
        top = getattr(ctx.reference, "long_logprobs", lambda _: None)(length) if ids is not None and ref is None else None
        if ref is None and top is None:
            skipped.append(f"{length}: not in the golden directory")
            continue
        if ref is None:  # a golden recorded from an endpoint: the next token's top-N logprobs after the prompt
            lp = torch.log_softmax(_tail(run, ids, 1)[-1].double(), -1)
            worst_lp = max(worst_lp, max(abs(float(lp[k]) - v) for k, v in top.items()))
            top1.append(float(int(lp.argmax()) == max(top, key=top.get)))
            top_n_only.append(length)
        else:
            tgt = _tail(run, ids, ref.shape[0])
            worst_abs = max(worst_abs, compare.max_abs(tgt, ref))
            worst_cos = min(worst_cos, compare.cosine(tgt, ref))
            worst_lp = max(worst_lp, compare.max_abs(torch.log_softmax(tgt.double(), -1),
                                                     torch.log_softmax(ref.double(), -1)))
            top1.append(compare.top1_agreement(ref, tgt))
        last = (length, time.perf_counter() - t0)
        done.append(length)
    if not done:
        raise Skip("no rung ran: " + "; ".join(skipped))
    m = {"logprob_max_abs": worst_lp, "top1_agreement": min(top1), "max_length": max(done), "rungs": len(done)}
    if len(top_n_only) < len(done):
        m.update(max_abs=worst_abs, cosine=worst_cos)
    msg = (f"rungs {done} compared (last 32 positions each)" if not top_n_only else
           f"rungs {done} compared (the next token's top-N logprobs after each prompt, as the golden holds them)")
    msg += f"; skipped {'; '.join(skipped)}" if skipped else ""
    cannot = sorted(k for k in thresholds if k[:-4] not in m)
    broken = apply_thresholds(m, {k: v for k, v in thresholds.items() if k not in cannot})
    if cannot:
        msg += f"; {', '.join(c[:-4] for c in cannot)} not measurable from top-N logprobs"
    return Outcome(m, status="fail" if broken else "pass", message="; ".join(broken + [msg]))


@register_check("kv_quant_impact")
def kv_quant_impact(params: Mapping[str, Any], thresholds: Mapping[str, float], ctx) -> Outcome:
    engine = ctx.target.engine
    if engine is None:
        raise Skip("the int8 KV cache is adapt runtime's, which did not run this target "
                   f"({ctx.target.reason or 'runtime ' + ctx.target.runtime})")
    from adapt.validate.engine_runner import decode_logits_with_kv

    kv = str(params.get("kv_dtype", "int8"))
    refs, quants, ids = [], [], []
    # every position is a decode step through the cache (slow on CPU): the first max_prompts prompts
    for p in ctx.prompts[: int(params.get("max_prompts", 2))]:
        base = decode_logits_with_kv(ctx.target, p, kv_dtype=None)
        if base is None:
            raise Skip("the runtime cannot run with a chosen KV cache dtype yet")
        refs.append(base)
        quants.append(decode_logits_with_kv(ctx.target, p, kv_dtype=kv))
        ids.append(torch.tensor(p[1:]))
    r, q = torch.cat([x[:-1] for x in refs]), torch.cat([x[:-1] for x in quants])
    m = {"top1_agreement": compare.top1_agreement(r, q), **compare.kl_divergence(r, q),
         **compare.perplexity_delta(r, q, torch.cat(ids))}
    return Outcome(m, message=f"{kv} KV cache vs the unquantized cache, {r.shape[0]} positions")
