"""The checklist through an OpenAI-compatible endpoint (``adapt validate --endpoint URL``).

``endpoint_registry()`` is the registry an endpoint run uses: every check kind of the main registry maps to
its endpoint form where a black box allows one, and to a ``skip`` with the reason where it does not (the
layer, operator, loading and KV items need the weights or the runtime's insides). An ``EndpointError``
(server down mid-run, 500, stall, malformed JSON) makes the item ``fail`` with the reason, never a crash.

Endpoint forms: ``end_to_end`` tokens / logprobs (the same check, through ``EndpointRunner``; the logits
comparisons skip), ``service``, ``chat_template``, ``batch_invariance``, ``long_context``
(checks/endpoint_ladder.py) and ``image_path`` (checks/endpoint_image.py: image_url data URLs). Thresholds
a black box cannot measure (``startup_s`` of a
server started elsewhere, ``cosine`` of logits it does not return) are dropped by name and the message
says so; every other threshold applies as written.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from adapt.validate.checklist import _REGISTRY, Outcome, Skip, apply_thresholds, register_check
from adapt.validate.checks.end_to_end import end_to_end
from adapt.validate.openai_client import EndpointError

CHAT = [{"role": "user", "content": "Say hello."}]

SKIP_REASONS = {
    "manifest_verify": "needs the shard's files; an endpoint shows only its API",
    "memory_vs_profile": "needs the runtime's own memory accounting, which an endpoint does not expose",
    "staged_init": "the server was started elsewhere: its startup stages are not visible through the API",
    "parallel_consistency": "the server's parallel layout is its own and cannot be rerun on one rank through "
                            "the API (batch_invariance checks its answers under concurrency)",
    "operator_alignment": "needs the runtime's kernels; an endpoint is a black box",
    "layer_alignment": "needs per-layer hidden states; an endpoint is a black box",
    "kv_quant_impact": "the server's KV cache dtype is its own and cannot be switched through the API",
    "weight_quant_impact": "needs the unquantized model's logits and per-layer hidden states beside the served "
                           "model's; an endpoint is a black box",
}
# metric -> why an endpoint cannot report it (its threshold is dropped, by name, with this reason)
UNMEASURABLE = {"startup_s": "the server was started elsewhere", "cosine": "the API returns top-N logprobs, "
                "not logits", "max_abs": "the API returns top-N logprobs, not logits"}


def _judged(metrics: dict[str, Any], thresholds: Mapping[str, float], message: str) -> Outcome:
    """Apply every threshold except those of UNMEASURABLE metrics the check did not report."""
    dropped = [n for n in thresholds if n[:-4] in UNMEASURABLE and n[:-4] not in metrics]
    broken = apply_thresholds(metrics, {k: v for k, v in thresholds.items() if k not in dropped})
    note = "; ".join(f"{n[:-4]} not measurable ({UNMEASURABLE[n[:-4]]})" for n in dropped)
    msg = f"{'; '.join(broken)}: {message}" if broken else message
    return Outcome(metrics, status="fail" if broken else "pass", message=msg + (f"; {note}" if note else ""))


def _guard(fn: Callable) -> Callable:
    def run(params, thresholds, ctx):
        try:
            return fn(params, thresholds, ctx)
        except EndpointError as e:
            return Outcome({}, status="fail", message=f"endpoint {e.kind}: {e}")
    run.__name__ = getattr(fn, "__name__", "check")
    return run


def _skipper(reason: str) -> Callable:
    def skip(params, thresholds, ctx):
        raise Skip(reason)
    return skip


def _runner(ctx):
    run = ctx.target.runner
    if run is None or getattr(run, "runtime", "") != "endpoint":
        raise Skip("runs against an --endpoint target (adapt's own runtime: see the service item)")
    return run


@register_check("chat_template")
def chat_template(params: Mapping[str, Any], thresholds: Mapping[str, float], ctx) -> Outcome:
    """The served chat prompt is the reference template's rendering: the server's ``prompt_token_ids`` (or
    its usage.prompt_tokens where it sends no ids) against the reference's, and its greedy chat answer against
    a completion of the reference's rendered ids (the same prompt must give the same tokens)."""
    run = _runner(ctx)
    ref_ids = _reference_chat(ctx)
    n = int(params.get("max_new_tokens", 8))
    body = run._body(messages=CHAT, max_tokens=n, temperature=0.0)
    ext = {"return_token_ids": True, "ignore_eos": True}
    doc = run.client.post_negotiated("/v1/chat/completions", body, ext)
    ch = doc.get("choices") or [{}]
    msg = (ch[0].get("message") or {}) if isinstance(ch[0], dict) else {}
    if not isinstance(msg.get("content"), str):
        raise EndpointError("malformed", f"/v1/chat/completions: no choices[0].message.content: {str(doc)[:200]}")
    served = ch[0].get("prompt_token_ids") or doc.get("prompt_token_ids")  # adapt: in the choice; vLLM: top level
    m: dict[str, Any] = {}
    if isinstance(served, list):
        m["prompt_match"] = float(served == ref_ids)
        how = "prompt_token_ids"
    else:
        m["prompt_match"] = float((doc.get("usage") or {}).get("prompt_tokens") == len(ref_ids))
        how = "usage.prompt_tokens (the server sends no prompt_token_ids)"
    plain = run.complete(ref_ids, n, 1)
    m["answer_match"] = float(msg["content"] == plain.text)
    events = run.client.post_negotiated("/v1/chat/completions", body, ext, stream=True)
    streamed = "".join(str((c.get("delta") or {}).get("content") or "") for _, e in events
                       for c in e.get("choices") or [])
    m["stream_match"] = float(streamed == msg["content"])
    m["chat_match"] = min(m["prompt_match"], m["answer_match"], m["stream_match"])
    bad = [k for k in ("prompt_match", "answer_match", "stream_match") if m[k] < 1.0]
    return _judged(m, thresholds, f"chat prompt ({how}), greedy answer and stream equal the reference template's"
                   if not bad else f"differs: {', '.join(bad)}")


def _reference_chat(ctx) -> list[int]:
    ids = getattr(ctx.reference, "chat_prompt_ids", lambda: None)()
    if ids is not None and getattr(ctx.reference, "chat_messages", None) == CHAT:  # a golden of a server's rendering
        return ids
    tok = ctx.notes.get("tokenizer")
    if tok is None or not tok.chat_template:
        raise Skip("the reference has no tokenizer with a chat template (pass --tokenizer DIR, or a reference "
                   "checkpoint that ships one)")
    return list(tok.encode_chat(CHAT))


@register_check("batch_invariance")
def batch_invariance(params: Mapping[str, Any], thresholds: Mapping[str, float], ctx) -> Outcome:
    """The validation prompts alone, then all at once inside a burst of ``fillers`` other requests: greedy
    tokens must be identical and the chosen tokens' logprobs close."""
    run = _runner(ctx)
    n, top_n, fillers = int(params.get("max_new_tokens", 16)), int(params.get("top_n", 5)), int(params.get("fillers", 8))
    alone = [ctx.target_generation(i, n, top_n) for i in range(len(ctx.prompts))]
    g = torch.Generator().manual_seed(7)
    others = [torch.randint(3, ctx.reference.vocab_size, (int(8 + 9 * k % 40),), generator=g).tolist()
              for k in range(fillers)]
    jobs = [list(p) for p in ctx.prompts] + others
    gate = threading.Barrier(len(jobs))

    def one(ids):
        gate.wait(timeout=run.client.timeout)
        return run.complete(ids, n, top_n)

    with ThreadPoolExecutor(len(jobs)) as pool:
        got = list(pool.map(one, jobs))[: len(ctx.prompts)]
    same, worst, firsts = [], 0.0, []
    for a, b in zip(alone, got):
        same.append(a.tokens == b.tokens)
        k = next((i for i, (x, y) in enumerate(zip(a.tokens, b.tokens)) if x != y), min(len(a.tokens), len(b.tokens)))
        firsts.append(k if a.tokens != b.tokens else None)
        for i in range(k):
            t = a.tokens[i]
            if t in a.logprobs[i] and t in b.logprobs[i]:
                worst = max(worst, abs(a.logprobs[i][t] - b.logprobs[i][t]))
    m = {"token_match": sum(same) / len(same), "logprob_max_abs": worst, "batch_size": len(jobs)}
    bad = [f"prompt {i} from token {k}" for i, k in enumerate(firsts) if k is not None]
    return _judged(m, thresholds, f"{len(ctx.prompts)} prompts alone and in a burst of {len(jobs)}: identical"
                   if not bad else f"differs inside the batch: {', '.join(bad)}")


def endpoint_service(params: Mapping[str, Any], thresholds: Mapping[str, float], ctx) -> Outcome:
    """The service item of an endpoint: /v1/models lists the model, /health answers where the server has it,
    greedy tokens of the first prompt equal the reference's, and the stream reassembles to the plain answer."""
    run = _runner(ctx)
    n = int(params.get("max_new_tokens", 16))
    ref = ctx.reference.generation(0, n, 1)
    if ref is None:
        raise Skip(f"the golden directory stored fewer than {n} tokens")
    status, _ = run.client.get("/health")
    plain = run.complete(ctx.prompts[0], n, 1)
    ids, text = run.stream_complete(ctx.prompts[0], n)
    m = {"token_match": float(plain.tokens == ref.tokens), "health_status": status,
         "stream_match": float(text == plain.text and (ids is None or ids == plain.tokens))}
    k = next((i for i, (a, b) in enumerate(zip(plain.tokens, ref.tokens)) if a != b), None)
    diff = "" if k is None else f"; greedy tokens differ from the reference at position {k}"
    return _judged(m, thresholds, f"{ctx.notes.get('served_model')} listed; /health HTTP {status}; {n} greedy "
                                  f"tokens plain and streamed{diff}")


def endpoint_image(params: Mapping[str, Any], thresholds: Mapping[str, float], ctx) -> Outcome:
    cfg = getattr(ctx.reference, "doc", {}).get("config") if hasattr(ctx.reference, "doc") else None
    if cfg is None and hasattr(ctx.reference, "model"):
        cfg = ctx.reference.model.model.config.to_dict()
    if not (cfg or {}).get("vision_config"):
        raise Skip("text-only model: no vision tower")
    from adapt.validate.checks.endpoint_image import endpoint_image as through_the_api

    return through_the_api(params, thresholds, ctx, _runner(ctx), _judged)


@register_check("serving_load")
def serving_load(params: Mapping[str, Any], thresholds: Mapping[str, float], ctx) -> Outcome:
    """Latency percentiles and throughput per concurrency level (checks/endpoint_load.py)."""
    from adapt.validate.checks.endpoint_load import endpoint_load

    return endpoint_load(params, thresholds, ctx, _runner(ctx), _judged)


def endpoint_registry() -> dict[str, Callable]:
    """kind -> check for an endpoint target (see the module docstring)."""
    from adapt.validate.checks.endpoint_ladder import endpoint_long_context

    reg: dict[str, Callable] = {k: _skipper(f"{SKIP_REASONS.get(k, 'needs the weights')}") for k in _REGISTRY}
    reg.update({"end_to_end": end_to_end, "chat_template": chat_template, "batch_invariance": batch_invariance,
                "service": endpoint_service, "long_context": endpoint_long_context, "serving_load": serving_load, "image_path": endpoint_image})
    return {k: _guard(v) for k, v in reg.items()}
