"""Request bodies of /v1/completions and /v1/chat/completions, checked field by field.

Every field is either understood, accepted at its no-op value (``presence_penalty: 0``, ``echo: false``,
``best_of: 1`` ...), or refused with a 400 naming it: an OpenAI client never gets an answer computed
with a setting silently dropped. Extensions, as vLLM spells them: ``top_k``, ``ignore_eos``,
``stop_token_ids``, and ``return_token_ids`` (each choice also carries ``prompt_token_ids`` and
``token_ids``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from adapt.errors import AdaptError
from adapt.runtime.sampling import MAX_LOGPROBS, SamplingParams
from adapt.runtime.server.errors import bad_request

MAX_STOP = 4  # OpenAI's limit on stop sequences
_COMMON = {"model", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "n", "stream", "stream_options",
           "presence_penalty", "frequency_penalty", "logit_bias", "user", "ignore_eos", "stop_token_ids",
           "return_token_ids"}
COMPLETION_FIELDS = _COMMON | {"prompt", "logprobs", "echo", "best_of", "suffix"}
CHAT_FIELDS = _COMMON | {"messages", "max_completion_tokens", "logprobs", "top_logprobs", "tools", "tool_choice",
                         "response_format", "parallel_tool_calls"}
# field -> the values it may take although adapt does not implement the feature
_NOOP = {"presence_penalty": (0, 0.0), "frequency_penalty": (0, 0.0), "echo": (False,), "best_of": (1,),
         "suffix": ("",), "tools": ([],), "tool_choice": ("none",), "parallel_tool_calls": (True, False)}


@dataclass
class GenRequest:
    """A parsed request: one engine sequence per prompt, all with the same sampling params."""

    kind: str  # "completion" | "chat"
    model: str | None
    prompts: list[list[int]]
    params: SamplingParams
    max_tokens_given: bool
    stream: bool = False
    include_usage: bool = False
    top_logprobs: int | None = None  # None: no logprobs; n: the chosen token and the n most likely
    return_token_ids: bool = False


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_num(x: Any) -> bool:
    return (isinstance(x, (int, float)) and not isinstance(x, bool)) and math.isfinite(x)


def _type_error(name: str, want: str, got: Any):
    return bad_request(f"'{name}' must be {want}, got {type(got).__name__} {_short(got)}", name, "invalid_type")


def _short(v: Any) -> str:
    s = repr(v)
    return s if len(s) <= 60 else s[:57] + "..."


def _check_fields(body: dict, allowed: set[str]) -> None:
    for k in body:
        if k not in allowed:
            raise bad_request(f"unrecognized request argument supplied: {k!r}", k, "unknown_field")
    for k, ok in _NOOP.items():
        v = body.get(k)
        if k in body and v is not None and not any(v == o and type(v) is type(o) for o in ok):
            raise bad_request(f"'{k}' = {_short(v)} is not supported by adapt serve (accepted: "
                              f"{', '.join(map(repr, ok))} or null)", k, "unsupported")
    n = body.get("n")
    if n is not None and not (_is_int(n) and n == 1):
        raise bad_request(f"'n' must be 1 (adapt serve returns one choice per prompt), got {_short(n)}", "n",
                          "unsupported")
    lb = body.get("logit_bias")
    if lb not in (None, {}):
        raise bad_request("'logit_bias' is not supported by adapt serve", "logit_bias", "unsupported")
    rf = body.get("response_format")
    if rf is not None and rf != {"type": "text"}:
        raise bad_request("'response_format' other than {\"type\": \"text\"} is not supported", "response_format",
                          "unsupported")
    if "user" in body and not isinstance(body["user"], (str, type(None))):
        raise _type_error("user", "a string", body["user"])
    if "model" in body and not isinstance(body["model"], (str, type(None))):
        raise _type_error("model", "a string", body["model"])


def _opt(body: dict, name: str, check, want: str, default: Any = None) -> Any:
    v = body.get(name)
    if v is None:
        return default
    if not check(v):
        raise _type_error(name, want, v)
    return v


def _bool(body: dict, name: str) -> bool:
    return _opt(body, name, lambda v: isinstance(v, bool), "a boolean", False)


def _stop(body: dict) -> tuple[str, ...]:
    v = body.get("stop")
    if v is None:
        return ()
    stops = [v] if isinstance(v, str) else v
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise _type_error("stop", "a non-empty string or a list of them", v)
    if len(stops) > MAX_STOP:
        raise bad_request(f"'stop' takes at most {MAX_STOP} sequences, got {len(stops)}", "stop")
    return tuple(stops)


def _include_usage(body: dict, stream: bool) -> bool:
    so = body.get("stream_options")
    if so is None:
        return False
    if not isinstance(so, dict) or set(so) - {"include_usage"}:
        raise bad_request("'stream_options' takes only {\"include_usage\": bool}", "stream_options")
    if not stream:
        raise bad_request("'stream_options' is allowed only with 'stream': true", "stream_options")
    return _bool(so, "include_usage")


def _sampling(body: dict, max_tokens: int, top_logprobs: int | None) -> SamplingParams:
    temperature = _opt(body, "temperature", lambda v: _is_num(v) and v >= 0, "a number >= 0", 1.0)
    top_p = _opt(body, "top_p", lambda v: _is_num(v) and 0 < v <= 1, "a number in (0, 1]", 1.0)
    top_k = _opt(body, "top_k", lambda v: _is_int(v) and (v >= 1 or v in (0, -1)), "an integer >= 1 (0 or -1: off)")
    seed = _opt(body, "seed", _is_int, "an integer")
    stop_ids = _opt(body, "stop_token_ids", lambda v: isinstance(v, list) and all(_is_int(i) and i >= 0 for i in v),
                    "a list of integers >= 0", [])
    try:
        return SamplingParams(temperature=float(temperature), top_k=top_k, top_p=float(top_p), seed=seed,
                              max_tokens=max_tokens, stop=_stop(body), stop_token_ids=tuple(stop_ids),
                              ignore_eos=_bool(body, "ignore_eos"), logprobs=top_logprobs)
    except AdaptError as e:  # SamplingParams' own range checks
        raise bad_request(str(e)) from None


def _max_tokens(body: dict, *names: str) -> int | None:
    for name in names:
        v = body.get(name)
        if v is not None:
            if not (_is_int(v) and v >= 1):
                raise _type_error(name, "an integer >= 1", v)
            return v
    return None


def _prompts(v: Any, tokenizer) -> list[list[int]]:
    """prompt: a string, a list of strings, a list of token ids, or a list of token-id lists."""
    if isinstance(v, str):
        items: list[Any] = [v]
    elif isinstance(v, list) and v and all(_is_int(t) for t in v):
        items = [v]
    elif isinstance(v, list) and v and all(isinstance(p, (str, list)) for p in v):
        items = v
    else:
        raise _type_error("prompt", "a string, a list of strings, a list of token ids or a list of token-id lists",
                          v)
    out = []
    for p in items:
        if isinstance(p, str):
            if tokenizer is None:
                raise bad_request("the model has no tokenizer (tokenizer.json or tiktoken.model): send 'prompt' as token ids", "prompt")
            ids = tokenizer.encode(p)
        elif all(_is_int(t) for t in p):
            ids = list(p)
        else:
            raise _type_error("prompt", "token ids (integers)", p)
        if not ids:
            raise bad_request("prompt is empty (it encodes to no tokens)", "prompt")
        out.append(ids)
    return out


def _content(m: dict, i: int) -> str:
    c = m.get("content")
    if c is None or isinstance(c, str):
        return c or ""
    if isinstance(c, list):
        parts = []
        for part in c:
            if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
                raise bad_request(f"messages[{i}].content: only text parts are supported", f"messages[{i}].content")
            parts.append(part["text"])
        return "".join(parts)
    raise _type_error(f"messages[{i}].content", "a string or a list of text parts", c)


def _messages(v: Any) -> list[dict[str, Any]]:
    if not isinstance(v, list) or not v:
        raise _type_error("messages", "a non-empty list of {role, content} objects", v)
    out = []
    for i, m in enumerate(v):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise bad_request(f"messages[{i}] must be an object with a string 'role'", f"messages[{i}]")
        if m.get("content") is None and m["role"] != "assistant":  # only an assistant turn may come without text
            raise bad_request(f"messages[{i}].content is required for role {m['role']!r}", f"messages[{i}].content",
                              "missing_field")
        out.append({**{k: x for k, x in m.items() if k not in ("content",)}, "content": _content(m, i)})
    return out


def parse_completion(body: dict, tokenizer) -> GenRequest:
    """POST /v1/completions body -> GenRequest (raises APIError 400)."""
    _check_fields(body, COMPLETION_FIELDS)
    if "prompt" not in body:
        raise bad_request("'prompt' is required", "prompt", "missing_field")
    prompts = _prompts(body["prompt"], tokenizer)
    logprobs = _opt(body, "logprobs", lambda v: _is_int(v) and 0 <= v <= MAX_LOGPROBS,
                    f"an integer in [0, {MAX_LOGPROBS}]")
    mt = _max_tokens(body, "max_tokens")
    stream = _bool(body, "stream")
    return GenRequest("completion", body.get("model"), prompts, _sampling(body, mt or 16, logprobs), mt is not None,
                      stream, _include_usage(body, stream), logprobs, _bool(body, "return_token_ids"))


def parse_chat(body: dict, tokenizer) -> GenRequest:
    """POST /v1/chat/completions body -> GenRequest; messages go through the checkpoint's chat template."""
    _check_fields(body, CHAT_FIELDS)
    if "messages" not in body:
        raise bad_request("'messages' is required", "messages", "missing_field")
    messages = _messages(body["messages"])
    if tokenizer is None:
        raise bad_request("the model has no tokenizer, so no chat template: use /v1/completions with token ids",
                          "messages")
    try:
        ids = tokenizer.encode_chat(messages)
    except AdaptError as e:  # no template, or the template's raise_exception
        raise bad_request(str(e), "messages") from None
    if not ids:
        raise bad_request("the chat template rendered no tokens", "messages")
    want = _bool(body, "logprobs")
    top = _opt(body, "top_logprobs", lambda v: _is_int(v) and 0 <= v <= MAX_LOGPROBS,
               f"an integer in [0, {MAX_LOGPROBS}]")
    if top is not None and not want:
        raise bad_request("'top_logprobs' needs 'logprobs': true", "top_logprobs")
    logprobs = (top or 0) if want else None
    mt = _max_tokens(body, "max_completion_tokens", "max_tokens")
    stream = _bool(body, "stream")
    return GenRequest("chat", body.get("model"), [ids], _sampling(body, mt or 1, logprobs), mt is not None, stream,
                      _include_usage(body, stream), logprobs, _bool(body, "return_token_ids"))
