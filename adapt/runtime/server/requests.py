"""Validated request models (protocol.py) -> what the engine runs (GenRequest), with one-line 400s.

A pydantic ValidationError becomes OpenAI's error shape naming the offending field (``param``: its path
in the body, ``messages[0].content``), code ``unknown_field`` / ``missing_field`` / ``invalid_type`` /
``invalid_value``. Fields adapt serve does not implement are accepted only at their no-op value.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ValidationError

from adapt.errors import AdaptError
from adapt.runtime.sampling import SamplingParams
from adapt.runtime.server.errors import APIError, bad_request
from adapt.runtime.server.protocol import MAX_STOP, ChatCompletionRequest, ChatMessage, CompletionRequest

MAX_N = 16  # choices per prompt
# field -> the values it may take although adapt does not implement the feature
_NOOP = {"best_of": (1,), "suffix": ("",), "tools": ([],), "tool_choice": ("none",),
         "parallel_tool_calls": (True, False), "response_format": ({"type": "text"},)}


@dataclass(frozen=True)
class ImagePart:
    """An ``image_url`` content part: where it sits in the body (``param``) and its URL."""

    param: str
    url: str


@dataclass
class GenRequest:
    """A parsed request: ``n`` engine sequences per prompt, all with the same sampling params."""

    kind: str  # "completion" | "chat"
    model: str | None
    prompts: list[list[int]]
    params: SamplingParams
    max_tokens_given: bool
    stream: bool = False
    include_usage: bool = False
    continuous_usage: bool = False
    top_logprobs: int | None = None  # None: no logprobs; n: the chosen token and the n most likely
    return_token_ids: bool = False
    n: int = 1
    echo: bool = False  # completions: the prompt's text (and logprobs) before the completion
    max_tokens_zero: bool = False  # max_tokens 0: nothing generated (echo / prompt_logprobs only)
    prompt_logprobs_asked: bool = False  # vLLM's prompt_logprobs field was sent
    images: list[ImagePart] = dataclasses.field(default_factory=list)  # chat: image parts, in prompt order
    mm: Any = None  # the loaded images (vision/request.py RequestImages), shared by the n sequences

    @property
    def num_choices(self) -> int:
        return len(self.prompts) * self.n


def validate(model: type[BaseModel], body: Any) -> BaseModel:
    """``model.model_validate(body)``, its first error as an APIError 400."""
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object")
    try:
        return model.model_validate(body)
    except ValidationError as e:
        raise _first_error(e, body) from None


def _first_error(e: ValidationError, body: dict) -> APIError:
    errs = e.errors(include_url=False)
    first = errs[0]
    # a union reports each alternative; the one that reaches deepest into what the client sent names the field
    # best (content sent as a list: its part's missing "url", not "content is not a string")
    base = path_keys(body, first["loc"])
    inside = [x for x in errs if path_keys(body, x["loc"])[:len(base)] == base]
    first = max(inside, key=lambda x: len(path_keys(body, x["loc"])))
    path = _path(body, first["loc"])
    same = [x for x in errs if _path(body, x["loc"]) == path]  # a union reports one error per alternative
    kind = first["type"]
    if kind == "extra_forbidden":
        return bad_request(f"unrecognized request argument supplied: {path!r}", path, "unknown_field")
    if kind == "missing":
        return bad_request(f"'{path}' is required", path, "missing_field")
    msgs = list(dict.fromkeys(_msg(x) for x in same))
    typed = all(x["type"].endswith("_type") or x["type"] in ("literal_error", "union_tag_invalid") for x in same)
    got = _short(_at(body, path_keys(body, first["loc"])))
    return bad_request(f"'{path}': {' or '.join(msgs)}, got {got}", path, "invalid_type" if typed else "invalid_value")


def _msg(err: dict) -> str:
    m = err["msg"]
    return m[0].lower() + m[1:] if m else m


def path_keys(body: Any, loc: tuple) -> list:
    """The leading part of a pydantic error location that exists in the body (drops union tags: a member's
    name such as ``str`` or ``list[...]``, a tagged union's ``type`` value)."""
    keys, cur, tagged = [], body, None
    for i, k in enumerate(loc):
        if isinstance(cur, dict) and cur is not tagged and cur.get("type") == k and i + 1 < len(loc):
            tagged = cur
            continue  # the tag of a discriminated union, then the member's own field
        if isinstance(k, str) and not isinstance(cur, dict):
            continue  # the name of a union member (``str``, ``list[...]``)
        if isinstance(cur, dict) and isinstance(k, str) and k in cur:
            cur = cur[k]
        elif isinstance(cur, list) and isinstance(k, int) and 0 <= k < len(cur):
            cur = cur[k]
        elif isinstance(cur, dict) and isinstance(k, str) and not keys:
            keys.append(k)  # a missing or unknown top-level field
            break
        elif isinstance(cur, dict) and isinstance(k, str):
            keys.append(k)
            break
        else:
            break
        keys.append(k)
    return keys


def _path(body: Any, loc: tuple) -> str:
    out = ""
    for k in path_keys(body, loc):
        out += f"[{k}]" if isinstance(k, int) else (f".{k}" if out else k)
    return out or "body"


def _at(body: Any, keys: list) -> Any:
    cur = body
    for k in keys:
        try:
            cur = cur[k]
        except (KeyError, IndexError, TypeError):
            return None
    return cur


def _short(v: Any) -> str:
    s = f"{type(v).__name__} {v!r}"
    return s if len(s) <= 60 else s[:57] + "..."


def _check_noop(req: BaseModel) -> None:
    for k, ok in _NOOP.items():
        v = getattr(req, k, None)
        if v is not None and not any(v == o and type(v) is type(o) for o in ok):
            raise bad_request(f"'{k}' = {_short(v)} is not supported by adapt serve (accepted: "
                              f"{', '.join(map(repr, ok))} or null)", k, "unsupported")


def _logit_bias(req: BaseModel, vocab: int) -> tuple[tuple[int, float], ...]:
    out = []
    for k, v in (req.logit_bias or {}).items():
        try:
            tid = int(k)
        except ValueError:
            raise bad_request(f"'logit_bias' keys must be token ids, got {k!r}", "logit_bias") from None
        if not 0 <= tid < vocab:
            raise bad_request(f"'logit_bias' token id {tid} is outside the vocabulary [0, {vocab})", "logit_bias")
        out.append((tid, float(v)))
    return tuple(out)


def _stream_flags(req: BaseModel) -> tuple[bool, bool, bool]:
    stream = bool(req.stream)
    so = req.stream_options
    if so is not None and not stream:
        raise bad_request("'stream_options' is allowed only with 'stream': true", "stream_options")
    return stream, bool(so and so.include_usage), bool(so and so.continuous_usage_stats)


def _sampling(req: BaseModel, max_tokens: int, logprobs: int | None, vocab: int,
              prompt_logprobs: int | None = None) -> SamplingParams:
    stop = req.stop if req.stop is not None else ()
    stops = (stop,) if isinstance(stop, str) else tuple(stop)
    if len(stops) > MAX_STOP:
        raise bad_request(f"'stop' takes at most {MAX_STOP} sequences, got {len(stops)}", "stop")
    if any(not s for s in stops):
        raise bad_request("'stop' sequences must be non-empty", "stop")
    try:
        return SamplingParams(
            temperature=float(req.temperature if req.temperature is not None else 1.0),
            top_k=req.top_k, top_p=float(req.top_p if req.top_p is not None else 1.0),
            min_p=float(req.min_p or 0.0), seed=req.seed, max_tokens=max(1, max_tokens), stop=stops,
            stop_token_ids=tuple(req.stop_token_ids or ()), ignore_eos=bool(req.ignore_eos), logprobs=logprobs,
            presence_penalty=float(req.presence_penalty or 0.0),
            frequency_penalty=float(req.frequency_penalty or 0.0),
            repetition_penalty=float(req.repetition_penalty if req.repetition_penalty is not None else 1.0),
            logit_bias=_logit_bias(req, vocab), prompt_logprobs=prompt_logprobs)
    except AdaptError as e:  # SamplingParams' own range checks
        raise bad_request(str(e)) from None


def _n(req: BaseModel) -> int:
    n = req.n or 1
    if n > MAX_N:
        raise bad_request(f"'n' must be at most {MAX_N}, got {n}", "n")
    return n


def _prompts(v: Any, tokenizer) -> list[list[int]]:
    """A string, a list of strings, a list of token ids, or a list of token-id lists -> token-id lists."""
    if isinstance(v, str) or (v and all(isinstance(t, int) for t in v)):
        items: list[Any] = [v]
    else:
        items = list(v)
    if not items:
        raise bad_request("'prompt' is empty", "prompt")
    out = []
    for p in items:
        if isinstance(p, str):
            if tokenizer is None:
                raise bad_request("the model has no tokenizer (tokenizer.json or tiktoken.model): send 'prompt' as "
                                  "token ids", "prompt")
            ids = tokenizer.encode(p)
        else:
            ids = list(p)
        if not ids:
            raise bad_request("prompt is empty (it encodes to no tokens)", "prompt")
        out.append(ids)
    return out


def chat_messages(messages: list[ChatMessage], images: list[ImagePart] | None = None,
                  max_images: int | None = None) -> list[dict[str, Any]]:
    """Messages as the chat template takes them: text parts joined to one string; a message with image parts
    keeps its parts in order, each image as ``{"type": "image"}`` (the form HF chat templates render as the
    model's placeholder) and its URL appended to ``images``. ``max_images``: the most a request may hold
    (0: the model takes none), checked before any template runs or image is read."""
    out, seen = [], 0
    for i, m in enumerate(messages):
        if m.content is None and m.role != "assistant":  # only an assistant turn may come without text
            raise bad_request(f"messages[{i}].content is required for role {m.role!r}", f"messages[{i}].content",
                              "missing_field")
        c = m.content
        if isinstance(c, list) and any(p.type == "image_url" for p in c):
            content: Any = []
            for j, p in enumerate(c):
                if p.type == "text":
                    content.append({"type": "text", "text": p.text})
                    continue
                where = f"messages[{i}].content[{j}]"
                if m.role != "user":
                    raise bad_request(f"{where}: image parts are allowed only in user messages, not {m.role!r}",
                                      where, "invalid_value")
                if p.image_url.detail not in (None, "auto"):
                    raise bad_request(f"{where}.image_url.detail = {p.image_url.detail!r} is not supported by adapt "
                                      f"serve (the checkpoint's image processor sets the resolution): send 'auto' "
                                      f"or leave it out", f"{where}.image_url.detail", "unsupported")
                seen += 1
                if max_images == 0:
                    raise bad_request(f"{where}: this model has no vision tower, it takes no images", where,
                                      "images_not_supported")
                if max_images is not None and seen > max_images:
                    raise bad_request(f"{where}: at most {max_images} image(s) per request (the server's "
                                      f"--limit-images-per-prompt)", where, "too_many_images")
                content.append({"type": "image"})
                if images is not None:
                    images.append(ImagePart(where, p.image_url.url))
        else:
            content = c if isinstance(c, str) else "".join(p.text for p in c) if c else ""
        d = {"role": m.role, "content": content}
        if m.name is not None:
            d["name"] = m.name
        out.append(d)
    return out


def chat_ids(messages: list[ChatMessage], tokenizer, images: list[ImagePart] | None = None,
             max_images: int | None = None) -> list[int]:
    """The rendered chat's token ids, one placeholder token per image (the images' URLs go to ``images``)."""
    if tokenizer is None:
        raise bad_request("the model has no tokenizer, so no chat template: use /v1/completions with token ids",
                          "messages")
    try:
        ids = tokenizer.encode_chat(chat_messages(messages, images, max_images))
    except AdaptError as e:  # no template, or the template's raise_exception
        raise bad_request(str(e), "messages") from None
    if not ids:
        raise bad_request("the chat template rendered no tokens", "messages")
    return ids


def parse_completion(body: Any, tokenizer, vocab: int) -> GenRequest:
    """POST /v1/completions body -> GenRequest (raises APIError 400)."""
    req: CompletionRequest = validate(CompletionRequest, body)  # type: ignore[assignment]
    _check_noop(req)
    prompts = _prompts(req.prompt, tokenizer)
    stream, usage, cont = _stream_flags(req)
    echo = bool(req.echo)
    mt = req.max_tokens
    if mt == 0 and not (echo or req.prompt_logprobs is not None):
        raise bad_request("'max_tokens' = 0 needs 'echo': true or 'prompt_logprobs' (nothing would be returned)",
                          "max_tokens")
    if echo and stream:
        raise bad_request("'echo' with 'stream' is not supported by adapt serve", "echo", "unsupported")
    # echo's logprobs cover the prompt too: ask the engine for the prompt's logprobs at the same top-N
    plp = req.prompt_logprobs if req.prompt_logprobs is not None else (req.logprobs if echo and req.logprobs
                                                                       is not None else None)
    params = _sampling(req, mt if mt is not None else 16, req.logprobs, vocab, plp)
    return GenRequest("completion", req.model, prompts, params, mt is not None, stream, usage, cont, req.logprobs,
                      bool(req.return_token_ids), _n(req), echo, mt == 0, req.prompt_logprobs is not None)


def parse_chat(body: Any, tokenizer, vocab: int, max_images: int | None = None) -> GenRequest:
    """POST /v1/chat/completions body -> GenRequest; messages go through the checkpoint's chat template, each
    image part as one placeholder token (the service loads the images and expands them: service.py)."""
    req: ChatCompletionRequest = validate(ChatCompletionRequest, body)  # type: ignore[assignment]
    _check_noop(req)
    if isinstance(req.tool_choice, dict):
        raise bad_request("'tool_choice' other than 'none' is not supported by adapt serve", "tool_choice",
                          "unsupported")
    images: list[ImagePart] = []
    ids = chat_ids(req.messages, tokenizer, images, max_images)
    if req.top_logprobs is not None and not req.logprobs:
        raise bad_request("'top_logprobs' needs 'logprobs': true", "top_logprobs")
    logprobs = (req.top_logprobs or 0) if req.logprobs else None
    mt = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    if mt == 0:
        raise bad_request("'max_tokens' must be >= 1 for chat completions", "max_tokens")
    stream, usage, cont = _stream_flags(req)
    return GenRequest("chat", req.model, [ids], _sampling(req, mt or 1, logprobs, vocab), mt is not None, stream,
                      usage, cont, logprobs, bool(req.return_token_ids), _n(req), images=images)


def with_max_tokens(req: GenRequest, max_tokens: int) -> GenRequest:
    if max_tokens == req.params.max_tokens:
        return req
    return dataclasses.replace(req, params=dataclasses.replace(req.params, max_tokens=max_tokens))
