"""end_to_end: the fixed prompts through the target against the reference.

``params.compare``:
  tokens    greedy continuation identical to the reference's (``token_match``: fraction of prompts)
  logprobs  vLLM's check_logprobs_close per prompt (``logprobs_close``: fraction of prompts close)
  logits    prefill logits of every prompt position: max_abs, max_rel, cosine, KL, top-1 agreement,
            top-k overlap, perplexity delta; in low precision also the ``*_vs_torch_ratio`` metrics of
            the FlashAttention 2x rule against transformers in the same dtype.
When an item fails, the runner locates the first divergent layer and sub-module (checks/layers.py).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from adapt.validate import compare
from adapt.validate.checklist import Outcome, Skip, apply_thresholds, register_check


def _vs_torch(err_target: float, err_plain: float, floor: float) -> float:
    """err_target / err_plain, with the plain error floored so an exact plain run is not a 0 divisor."""
    return err_target / max(err_plain, floor)


def _logits(ctx, k: int) -> dict[str, Any]:
    ref = [ctx.reference.logits(i) for i in range(len(ctx.prompts))]
    tgt = [ctx.target_logits(i) for i in range(len(ctx.prompts))]
    r, t = torch.cat(ref), torch.cat(tgt)  # [sum T, V]
    m = compare.logits_metrics(r, t, k)
    ids = torch.cat([torch.tensor(p[1:]) for p in ctx.prompts])
    shift_r = torch.cat([x[:-1] for x in ref])
    shift_t = torch.cat([x[:-1] for x in tgt])
    m.update(compare.perplexity_delta(shift_r, shift_t, ids))
    m["positions"] = int(r.shape[0])
    if ctx.low_precision:
        p = torch.cat([ctx.plain_logits(i) for i in range(len(ctx.prompts))])
        floor = torch.finfo(torch.bfloat16 if ctx.dtype == "bfloat16" else torch.float16).eps
        m["max_abs_vs_torch_ratio"] = _vs_torch(m["max_abs"], compare.max_abs(p, r), floor * float(r.abs().max()))
        kl_p = compare.kl_divergence(r, p)["kl_mean"]
        m["kl_mean_vs_torch_ratio"] = _vs_torch(m["kl_mean"], kl_p, 1e-8)
        dis_p = 1.0 - compare.top1_agreement(r, p)
        m["top1_disagreement_vs_torch_ratio"] = _vs_torch(1.0 - m["top1_agreement"], dis_p, 1.0 / r.shape[0])
    return m


def _top_n_rows(ctx, thresholds: Mapping[str, float]) -> Outcome:
    """Against a golden that holds each prompt position's top-N logprobs instead of logits (one recorded from
    an endpoint): ``top1_agreement`` (the target's argmax is the reference's top-1) and ``logprob_max_abs`` over
    the ids the reference holds. A threshold on what top-N logprobs cannot give (cosine, max_abs, KL) skips the
    item when it is all the item has, else is dropped by name in the message."""
    rows = [ctx.reference.prompt_top(i) for i in range(len(ctx.prompts))]
    if any(r is None for r in rows):
        raise Skip(ctx.reference._missing("prefill logits or per-position logprobs").reason)
    agree, worst, n = 0, 0.0, 0
    for i, ref in enumerate(rows):
        lp = torch.log_softmax(ctx.target_logits(i)[:-1].double(), dim=-1)  # [T-1, V]
        for t, d in enumerate(ref):
            if not d:
                continue
            n += 1
            agree += int(lp[t].argmax()) == max(d, key=d.get)
            worst = max(worst, max(abs(float(lp[t, k]) - v) for k, v in d.items()))
    m = {"top1_agreement": agree / max(n, 1), "logprob_max_abs": worst, "positions": n}
    cannot = sorted(k for k in thresholds if k[:-4] not in m)
    if cannot and len(cannot) == len(thresholds):
        raise Skip(f"{', '.join(c[:-4] for c in cannot)} need(s) the reference's logits; the golden holds the top-N "
                   "logprobs of each prompt position")
    broken = apply_thresholds(m, {k: v for k, v in thresholds.items() if k not in cannot})
    msg = "; ".join(broken) or f"{n} positions over {len(rows)} prompts vs the golden's top-N logprobs"
    if cannot:
        msg += f"; {', '.join(c[:-4] for c in cannot)} not measurable from top-N logprobs"
    return Outcome(m, status="fail" if broken else "pass", message=msg)


def _generations(ctx, n: int, top_n: int):
    pairs = []
    for i in range(len(ctx.prompts)):
        ref = ctx.reference.generation(i, n, top_n)
        if ref is None:
            raise Skip(f"the golden directory stored fewer than {n} tokens or top-{top_n} logprobs; dump again "
                       f"with --max-new-tokens {n} --top-n {top_n}")
        pairs.append((ref, ctx.target_generation(i, n, top_n)))
    return pairs


@register_check("end_to_end")
def end_to_end(params: Mapping[str, Any], thresholds: Mapping[str, float], ctx) -> Outcome:
    what = params.get("compare", "logits")
    ctx.need_runner()
    if what == "logits":
        if getattr(ctx.reference, "has_logits", True) is False:
            return _top_n_rows(ctx, thresholds)
        m = _logits(ctx, int(params.get("top_k", 5)))
        return Outcome(m, message=f"{m['positions']} positions over {len(ctx.prompts)} prompts")
    n, top_n = int(params.get("max_new_tokens", 16)), int(params.get("top_n", 5))
    pairs = _generations(ctx, n, top_n)
    if what == "tokens":
        same = [r.tokens == t.tokens for r, t in pairs]
        pos = sum(sum(a == b for a, b in zip(r.tokens, t.tokens)) for r, t in pairs)
        m = {"token_match": sum(same) / len(same), "token_agreement": pos / sum(len(r.tokens) for r, _ in pairs)}
        bad = [i for i, s in enumerate(same) if not s]
        return Outcome(m, message="identical" if not bad else f"prompts {bad} differ")
    if what == "logprobs":
        res = [compare.check_logprobs_close(r.tokens, r.logprobs, t.tokens, t.logprobs, top_n) for r, t in pairs]
        m = {"logprobs_close": sum(x.close for x in res) / len(res),
             "identical": sum(x.identical for x in res) / len(res)}
        msgs = [f"prompt {i}: {x.message}" for i, x in enumerate(res) if not x.identical]
        return Outcome(m, message="; ".join(msgs) or f"identical ({len(res)} prompts x {n} tokens)")
    raise ValueError(f"end_to_end: params.compare must be tokens, logprobs or logits; got {what!r}")
