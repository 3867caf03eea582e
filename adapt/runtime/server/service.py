"""What each route does, independent of HTTP: models, health, completions and chat over the engine loop.

A generation request is parsed (protocol.py), checked against the model's context and the KV cache,
split into one engine sequence per prompt, submitted to the EngineLoop, and either collected into one
body or yielded as stream chunks. A request past ``request_timeout_s``, or whose client went away
mid-stream, is aborted in the engine, freeing its KV blocks.
"""

from __future__ import annotations

import dataclasses
import queue
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from adapt.runtime.server.errors import APIError, bad_request
from adapt.runtime.server.loop import Delta, EngineLoop, Failed, wait_event
from adapt.runtime.server.protocol import GenRequest, parse_chat, parse_completion
from adapt.runtime.server.responses import Choice, Chunker, full_response


@dataclass(frozen=True)
class ServiceConfig:
    """Limits of the service. ``max_pending`` requests may be in flight; more get 503."""

    model_name: str
    max_request_bytes: int = 8 << 20
    request_timeout_s: float = 600.0
    read_timeout_s: float = 30.0
    max_pending: int = 512


class Service:
    """The engine loop plus the routes. ``start()`` before serving, ``stop()`` after."""

    def __init__(self, engine, config: ServiceConfig):
        self.engine, self.config = engine, config
        self.tokenizer = engine.tokenizer
        self.loop = EngineLoop(engine)
        self.created = int(time.time())
        self._pending = 0
        self._lock = threading.Lock()

    def start(self) -> None:
        self.loop.start()

    def stop(self) -> None:
        self.loop.stop()

    @property
    def pending(self) -> int:
        """Generation requests in flight."""
        return self._pending

    # -- plain routes ---------------------------------------------------------------------------------

    def health(self) -> tuple[int, dict[str, Any]]:
        if not self.loop.alive:
            return 503, {"status": "error", "error": self.loop.error or "engine loop not running"}
        return 200, {"status": "ok", "model": self.config.model_name, **self.loop.load()}

    def models(self) -> dict[str, Any]:
        return {"object": "list", "data": [{"id": self.config.model_name, "object": "model",
                                            "created": self.created, "owned_by": "adapt",
                                            "max_model_len": self.engine.max_model_len}]}

    # -- generation -----------------------------------------------------------------------------------

    def parse(self, route: str, body: Any) -> GenRequest:
        """Parse and check a generation body; raises APIError."""
        if not isinstance(body, dict):
            raise bad_request("the request body must be a JSON object")
        req = parse_chat(body, self.tokenizer) if route == "chat" else parse_completion(body, self.tokenizer)
        if req.model is not None and req.model != self.config.model_name:
            raise APIError(404, f"the model {req.model!r} does not exist; this service serves "
                                f"{self.config.model_name!r}", "invalid_request_error", "model", "model_not_found")
        return self._fit(req)

    def _fit(self, req: GenRequest) -> GenRequest:
        """Check every prompt against the context and the cache; an unset max_tokens is clamped to fit."""
        eng = self.engine
        limit, vocab = eng.max_model_len, eng.spec.vocab_size
        bm = eng.block_manager
        cache_tokens = bm.num_blocks * bm.block_size
        rooms = []
        for p in req.prompts:
            bad = [t for t in p if not 0 <= t < vocab]
            if bad:
                raise bad_request(f"token id {bad[0]} is outside the vocabulary [0, {vocab})", "prompt")
            n = len(p)
            if n >= limit:
                raise bad_request(f"this model's maximum context length is {limit} tokens; the prompt has {n}",
                                  "messages" if req.kind == "chat" else "prompt", "context_length_exceeded")
            room = min(limit - n, cache_tokens - n + 1)  # the last sampled token is never cached
            if room < 1:
                raise bad_request(f"the prompt has {n} tokens; the KV cache holds {cache_tokens}",
                                  "prompt", "context_length_exceeded")
            if req.max_tokens_given and req.params.max_tokens > room:
                raise bad_request(
                    f"this model's maximum context length is {limit} tokens (KV cache: {cache_tokens}); you "
                    f"requested {n + req.params.max_tokens} tokens ({n} in the prompt, {req.params.max_tokens} in "
                    f"the completion); reduce max_tokens to at most {room}", "max_tokens", "context_length_exceeded")
            rooms.append(room)
        want = req.params.max_tokens
        if not req.max_tokens_given:  # OpenAI's defaults: chat runs to the context's end, completions 16
            want = min(rooms) if req.kind == "chat" else min(want, min(rooms))
        if want != req.params.max_tokens:
            req = dataclasses.replace(req, params=dataclasses.replace(req.params, max_tokens=want))
        return req

    def _submit(self, req: GenRequest) -> tuple[queue.Queue, list[int], list[Choice]]:
        with self._lock:
            if self._pending >= self.config.max_pending:
                raise APIError(503, f"the service has {self._pending} requests in flight; retry later",
                               "server_overloaded", None, "overloaded")
            self._pending += 1
        if not self.loop.alive:
            self._release()
            raise APIError(503, f"the engine is not running ({self.loop.error or 'stopped'})", "server_error")
        out: queue.Queue = queue.Queue()
        sids = [self.loop.submit(p, req.params, out, i) for i, p in enumerate(req.prompts)]
        return out, sids, [Choice(i, list(p)) for i, p in enumerate(req.prompts)]

    def _release(self) -> None:
        with self._lock:
            self._pending -= 1

    def _events(self, out: queue.Queue, choices: list[Choice]) -> Iterator[Delta]:
        """Deltas until every choice has finished; APIError on failure or timeout."""
        deadline = time.monotonic() + self.config.request_timeout_s
        open_ = len(choices)
        while open_:
            ev = wait_event(out, deadline)
            if ev is None:
                raise APIError(504, f"the request did not finish within {self.config.request_timeout_s:g} s",
                               "timeout_error", None, "timeout")
            if isinstance(ev, Failed):
                raise APIError(ev.status, ev.message, "invalid_request_error" if ev.status == 400 else "server_error")
            choices[ev.index].add(ev)
            if ev.finish_reason is not None:
                open_ -= 1
            yield ev

    def _abort(self, sids: list[int], choices: list[Choice]) -> None:
        for sid, c in zip(sids, choices):
            if c.finish_reason is None:
                self.loop.abort(sid)

    def generate(self, req: GenRequest) -> dict[str, Any]:
        """The whole body of a non-streamed request."""
        out, sids, choices = self._submit(req)
        try:
            for _ in self._events(out, choices):
                pass
        finally:
            self._abort(sids, choices)
            self._release()
        return full_response(req, self.config.model_name, choices, self.tokenizer)

    def stream(self, req: GenRequest) -> Iterator[dict[str, Any]]:
        """Chunk bodies of a streamed request; an error mid-stream is yielded as an error body. Closing the
        iterator (the client went away) aborts the request."""
        out, sids, choices = self._submit(req)
        ch = Chunker(req, self.config.model_name, self.tokenizer)
        try:
            if req.kind == "chat":
                for c in choices:
                    yield ch.role(c.index)
            for d in self._events(out, choices):
                if d.text or d.finish_reason is not None or d.logprobs or req.return_token_ids:
                    yield ch.delta(d)
            if req.include_usage:
                yield ch.usage(choices)
        except APIError as e:
            yield e.body()
        finally:
            self._abort(sids, choices)
            self._release()
