"""OpenAI-shaped response bodies and stream chunks from the engine loop's per-sequence output."""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from adapt.runtime.server.loop import Delta
from adapt.runtime.server.requests import GenRequest


@dataclass
class Choice:
    """One sequence's output collected from its Deltas."""

    index: int
    prompt_token_ids: list[int]
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[tuple[int, float, list[tuple[int, float]]]] = field(default_factory=list)
    finish_reason: str | None = None
    prompt_logprobs: list | None = None  # [None, (id, logprob, top), ...] per prompt position

    def add(self, d: Delta) -> None:
        if d.prompt_logprobs is not None:
            self.prompt_logprobs = d.prompt_logprobs
        self.text += d.text
        self.token_ids += d.token_ids
        self.logprobs += d.logprobs
        if d.finish_reason is not None:
            self.finish_reason = d.finish_reason


def new_id(kind: str) -> str:
    return ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex


def token_text(tokenizer, tid: int) -> str:
    if tokenizer is None:
        return f"token_id:{tid}"
    return tokenizer.decode([tid], skip_special_tokens=False)


def completion_logprobs(entries, tokenizer, offset: int = 0) -> dict[str, Any]:
    """The legacy completions ``logprobs`` object: tokens, token_logprobs, top_logprobs, text_offset.
    An entry (token id, None, None) is a token without logprob (echo's first prompt token)."""
    tokens, lps, tops, offsets = [], [], [], []
    for tid, lp, top in entries:
        s = token_text(tokenizer, tid)
        offsets.append(offset)
        offset += len(s)
        tokens.append(s)
        lps.append(lp)
        tops.append({token_text(tokenizer, t): v for t, v in top} if top else None)
    return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offsets}


def _prompt_entries(c: Choice) -> list:
    """The prompt's (id, logprob, top) entries, the first token's (id, None, None)."""
    lps = c.prompt_logprobs or [None]
    out = [(c.prompt_token_ids[0], None, None)]
    out += [e if e is not None else (t, None, None) for t, e in zip(c.prompt_token_ids[1:], lps[1:])]
    return out


def vllm_prompt_logprobs(c: Choice, tokenizer) -> list[dict[str, Any] | None]:
    """vLLM's ``prompt_logprobs``: per prompt position None (the first) or {token id: {logprob, rank,
    decoded_token}} holding the prompt's own token and the top N."""
    out: list[dict[str, Any] | None] = [None]
    for tid, lp, top in _prompt_entries(c)[1:]:
        d: dict[str, Any] = {}
        for rank, (t, v) in enumerate(top or [], start=1):
            d[str(t)] = {"logprob": v, "rank": rank, "decoded_token": token_text(tokenizer, t)}
        if str(tid) not in d:
            rank = 1 + sum(1 for _, v in (top or []) if v > lp) if top else None
            d = {str(tid): {"logprob": lp, "rank": rank, "decoded_token": token_text(tokenizer, tid)}, **d}
        out.append(d)
    return out


def chat_logprobs(entries, tokenizer) -> dict[str, Any]:
    """The chat ``logprobs`` object: content = [{token, logprob, bytes, top_logprobs}]."""
    def one(tid: int, lp: float) -> dict[str, Any]:
        s = token_text(tokenizer, tid)
        return {"token": s, "logprob": lp, "bytes": list(s.encode("utf-8"))}
    return {"content": [dict(one(t, lp), top_logprobs=[one(a, b) for a, b in top]) for t, lp, top in entries]}


def usage(choices: list[Choice]) -> dict[str, int]:
    p = sum(len(c.prompt_token_ids) for c in choices)
    c = sum(len(x.token_ids) for x in choices)
    return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}


def _ids(req: GenRequest, c: Choice, body: dict[str, Any]) -> dict[str, Any]:
    if req.return_token_ids:
        body["prompt_token_ids"] = c.prompt_token_ids
        body["token_ids"] = c.token_ids
    return body


def full_response(req: GenRequest, model: str, choices: list[Choice], tokenizer) -> dict[str, Any]:
    """The non-streamed body of /v1/completions or /v1/chat/completions."""
    out = []
    for c in choices:
        if req.kind == "chat":
            lp = chat_logprobs(c.logprobs, tokenizer) if req.top_logprobs is not None else None
            body = {"index": c.index, "message": {"role": "assistant", "content": c.text}, "logprobs": lp,
                    "finish_reason": c.finish_reason}
        else:
            text, entries = c.text, c.logprobs
            if req.echo:
                prompt_text = tokenizer.decode(c.prompt_token_ids) if tokenizer is not None else ""
                text, entries = prompt_text + text, _prompt_entries(c) + list(entries)
            lp = completion_logprobs(entries, tokenizer) if req.top_logprobs is not None else None
            body = {"index": c.index, "text": text, "logprobs": lp, "finish_reason": c.finish_reason}
            if req.prompt_logprobs_asked:
                body["prompt_logprobs"] = vllm_prompt_logprobs(c, tokenizer)
        out.append(_ids(req, c, body))
    return {"id": new_id(req.kind), "object": "chat.completion" if req.kind == "chat" else "text_completion",
            "created": int(time.time()), "model": model, "choices": out, "usage": usage(choices)}


class Chunker:
    """Stream chunks of one request: same id and created time on every chunk, as OpenAI sends them."""

    def __init__(self, req: GenRequest, model: str, tokenizer):
        self.req, self.model, self.tokenizer = req, model, tokenizer
        self.id, self.created = new_id(req.kind), int(time.time())
        self.object = "chat.completion.chunk" if req.kind == "chat" else "text_completion"
        self._offsets: dict[int, int] = {}

    def _wrap(self, choices: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
        return {"id": self.id, "object": self.object, "created": self.created, "model": self.model,
                "choices": choices, **extra}

    def role(self, index: int) -> dict[str, Any]:
        """Chat's first chunk of each choice: the assistant role with empty content."""
        return self._wrap([{"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                            "finish_reason": None}])

    def delta(self, d: Delta, choices: list[Choice] | None = None) -> dict[str, Any]:
        """One chunk of a Delta; with ``continuous_usage_stats`` it carries the usage so far."""
        r = self.req
        if r.kind == "chat":
            lp = chat_logprobs(d.logprobs, self.tokenizer) if r.top_logprobs is not None else None
            ch = {"index": d.index, "delta": {"content": d.text} if d.text or d.finish_reason is None else {},
                  "logprobs": lp, "finish_reason": d.finish_reason}
        else:
            off = self._offsets.get(d.index, 0)
            lp = completion_logprobs(d.logprobs, self.tokenizer, off) if r.top_logprobs is not None else None
            self._offsets[d.index] = off + len(d.text)
            ch = {"index": d.index, "text": d.text, "logprobs": lp, "finish_reason": d.finish_reason}
        if r.return_token_ids:
            ch["token_ids"] = d.token_ids
            if d.prompt_token_ids is not None:
                ch["prompt_token_ids"] = d.prompt_token_ids
        if r.continuous_usage and choices is not None:
            return self._wrap([ch], usage=usage(choices))
        return self._wrap([ch])

    def usage(self, choices: list[Choice]) -> dict[str, Any]:
        """The final chunk with ``stream_options.include_usage``: no choices, the request's usage."""
        return self._wrap([], usage=usage(choices))
