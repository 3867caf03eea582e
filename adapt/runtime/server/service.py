"""What each route does, independent of HTTP: models, health, tokenize, completions and chat over the loop.

A generation request is parsed (requests.py), checked against the model's context and the KV cache,
split into ``n`` engine sequences per prompt, submitted to the EngineLoop, and either collected into one
body or yielded as stream chunks. The engine loop's events reach the asyncio side through ``Bridge``: one
``call_soon_threadsafe`` per loop iteration, whatever the number of tokens. A request past
``request_timeout_s``, or whose client went away, is aborted in the engine, freeing its KV blocks.

Images (chat ``image_url`` parts, vision models): counted and checked before the template runs, then fetched
/ decoded / preprocessed off the event loop by ``vision.processor.preprocess`` (the code of ``adapt run
--image``), under the config's limits; file paths are never read for a client. The placeholders are expanded
to the processor's token counts, so the context check, the KV check and the scheduler's token budget count
the image tokens; the tower runs once per request at its first prefill (vision/request.py), its features
shared by the request's ``n`` sequences. Every bad image is a 400 naming its part.
"""

from __future__ import annotations

import asyncio
import dataclasses
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from adapt.errors import AdaptError, ImageInputError
from adapt.runtime.server.errors import APIError, bad_request
from adapt.runtime.server.loop import Delta, EngineLoop, Failed
from adapt.runtime.server.metrics import ServiceMetrics
from adapt.runtime.server.requests import GenRequest, ImagePart, parse_chat, parse_completion, with_max_tokens
from adapt.runtime.vision.inputs import FETCH_TIMEOUT_S, MAX_BYTES, MAX_PIXELS, ImageLimits
from adapt.runtime.server.responses import Choice, Chunker, full_response


@dataclass(frozen=True)
class ServiceConfig:
    """Limits and options of the service. ``max_pending`` generation requests may be in flight and
    ``max_connections`` HTTP requests open; more get 429 with Retry-After."""

    model_name: str
    max_request_bytes: int = 8 << 20
    request_timeout_s: float = 600.0
    read_timeout_s: float = 30.0
    max_pending: int = 512
    max_connections: int = 2048
    backlog: int = 2048
    api_key: str | None = None
    metrics_auth: bool = False  # /metrics behind the key too
    metrics_prefix: str = "adapt"
    health_golden: str | None = None  # a golden dir / file replayed by GET /health/golden
    health_golden_interval_s: float = 300.0
    retry_after_s: int = 1
    batch_window_s: float = 0.002  # an idle engine waits this long after each arrival of a burst (loop.py)
    allow_remote_images: bool = False  # image_url parts may be http(s) URLs (fetched by the server)
    limit_images_per_prompt: int = 4
    max_image_bytes: int = MAX_BYTES  # encoded bytes of one image (a data: URL is bounded by the body too)
    max_image_pixels: int = MAX_PIXELS  # decoded width x height of one image, read from its header
    image_fetch_timeout_s: float = FETCH_TIMEOUT_S  # one remote image's whole fetch

    @property
    def image_limits(self) -> ImageLimits:
        return ImageLimits(self.max_image_bytes, self.max_image_pixels, self.allow_remote_images,
                           self.image_fetch_timeout_s, allow_files=False)


class Bridge:
    """Carries the loop thread's events to asyncio queues, one wake-up of each event loop per flush."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pending: list[tuple[Sink, Any]] = []

    def post(self, sink: "Sink", ev: Any) -> None:
        with self._lock:
            self._pending.append((sink, ev))

    def flush(self) -> None:
        with self._lock:
            items, self._pending = self._pending, []
        by_loop: dict[asyncio.AbstractEventLoop, list] = {}
        for sink, ev in items:
            by_loop.setdefault(sink.aloop, []).append((sink, ev))
        for aloop, batch in by_loop.items():
            try:
                aloop.call_soon_threadsafe(_deliver, batch)
            except RuntimeError:  # that event loop is closed: nobody is listening any more
                pass


def _deliver(batch: list) -> None:
    for sink, ev in batch:
        sink.push(ev)


def _wake(waiter: asyncio.Future) -> None:
    if not waiter.done():
        waiter.set_result(None)


class Sink:
    """A request's events on its event loop; the engine loop calls ``put`` from its thread. ``get`` hands
    over every event delivered so far, waiting on one bare future when there is none (no task, no queue per
    event: each stream wakes once per engine step for a few microseconds of the HTTP thread)."""

    def __init__(self, bridge: Bridge):
        self.bridge = bridge
        self.aloop = asyncio.get_running_loop()
        self._events: list = []
        self._waiter: asyncio.Future | None = None

    def put(self, ev: Any) -> None:
        self.bridge.post(self, ev)

    def push(self, ev: Any) -> None:
        """On the event loop: one event arrived."""
        self._events.append(ev)
        if self._waiter is not None:
            _wake(self._waiter)

    async def get(self, timeout: float) -> list:
        """Every event not yet taken, after waiting up to ``timeout`` seconds for one; [] if none came."""
        if not self._events:
            waiter = self._waiter = self.aloop.create_future()
            timer = self.aloop.call_later(timeout, _wake, waiter)
            try:
                await waiter
            finally:
                timer.cancel()
                self._waiter = None
        out, self._events = self._events, []
        return out


class Service:
    """The engine loop plus the routes. ``start()`` before serving, ``stop()`` after."""

    def __init__(self, engine, config: ServiceConfig):
        self.engine, self.config = engine, config
        self.tokenizer = engine.tokenizer
        self.metrics = ServiceMetrics(config.model_name, config.metrics_prefix, self._state)
        self.http_open = 0  # generation requests the HTTP side has accepted (app.Limits counts them)
        self.loop = EngineLoop(engine, on_finish=self.metrics.finished, on_token=self.metrics.token_gap,
                               batch_window_s=config.batch_window_s, arriving=self.arriving)
        self.bridge = Bridge()
        self.loop.flush_hooks.append(self.bridge.flush)
        self.created = int(time.time())
        self._pending = 0
        self._lock = threading.Lock()
        self._weight_bytes = sum(t.numel() * t.element_size() for t in
                                 list(engine.model.parameters()) + list(engine.model.buffers()))
        self._processor, self._no_images = None, None  # a vision model's image processor, or why there is none
        if engine.spec.vision is None:
            self._no_images = "this model has no vision tower, it takes no images"
        else:
            try:
                self._processor = engine.image_processor()
            except AdaptError as e:  # e.g. no preprocessor_config.json: text still serves
                self._no_images = f"the server cannot read images: {e}"

    def start(self) -> None:
        self.loop.start()

    def stop(self) -> None:
        self.loop.stop()

    def arriving(self) -> int:
        """Generation requests accepted over HTTP and not yet submitted to the loop (read on the loop thread)."""
        return self.http_open - self._pending

    @property
    def pending(self) -> int:
        """Generation requests in flight."""
        return self._pending

    def _state(self) -> dict:
        bm = self.engine.block_manager
        pc = bm.prefix_cache
        load = self.loop.load()
        # from the HTTP thread while the loop runs: read counters only (usage() iterates the tables)
        kv_usage = 1.0 - bm.num_free_blocks / bm.num_blocks
        return {"running": load["running"], "waiting": load["waiting"], "kv_usage": kv_usage,
                "kv_bytes": self.engine.pool.total_bytes, "weight_bytes": self._weight_bytes,
                "pc_queries": pc.queries if pc is not None else 0, "pc_hits": pc.hits if pc is not None else 0,
                "preemptions": self.loop.stats["preemptions"]}

    # -- plain routes ---------------------------------------------------------------------------------

    def health(self) -> tuple[int, dict[str, Any]]:
        if not self.loop.alive:
            return 503, {"status": "error", "error": self.loop.error or "engine loop not running"}
        return 200, {"status": "ok", "model": self.config.model_name, **self.loop.load()}

    def model_card(self) -> dict[str, Any]:
        return {"id": self.config.model_name, "object": "model", "created": self.created, "owned_by": "adapt",
                "max_model_len": self.engine.max_model_len}

    def models(self) -> dict[str, Any]:
        return {"object": "list", "data": [self.model_card()]}

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.config.model_name:
            raise APIError(404, f"the model {model!r} does not exist; this service serves "
                                f"{self.config.model_name!r}", "invalid_request_error", "model", "model_not_found")

    # -- generation -----------------------------------------------------------------------------------

    @property
    def max_images(self) -> int:
        """Images one request may hold (0: none, a text model)."""
        return 0 if self.engine.spec.vision is None else self.config.limit_images_per_prompt

    def parse(self, route: str, body: Any) -> GenRequest:
        """Parse and check a generation body; raises APIError. A chat request with images comes back with
        ``images`` set and unchecked against the context: ``prepare`` loads them."""
        vocab = self.engine.spec.vocab_size
        if route == "chat":
            req = parse_chat(body, self.tokenizer, vocab, self.max_images)
        else:
            req = parse_completion(body, self.tokenizer, vocab)
        self.check_model(req.model)
        return req if req.images else self._fit(req)

    async def prepare(self, route: str, body: Any) -> GenRequest:
        """``parse``, then a chat request's images loaded (off the event loop) and its prompt expanded."""
        req = self.parse(route, body)
        if not req.images:
            return req
        ids, mm = await self.load_images(req.prompts[0], req.images)
        return self._fit(dataclasses.replace(req, prompts=[ids], mm=mm, images=[]))

    async def load_images(self, ids: list[int], parts: list[ImagePart]) -> tuple[list[int], Any]:
        """(ids with each image placeholder expanded, the request's RequestImages) in a worker thread."""
        return await asyncio.to_thread(self._load_images, ids, parts)

    def _load_images(self, ids: list[int], parts: list[ImagePart]) -> tuple[list[int], Any]:
        from adapt.runtime.vision.processor import expand_placeholders, preprocess
        from adapt.runtime.vision.request import make_request

        if self._processor is None:
            raise bad_request(f"{parts[0].param}: {self._no_images}", parts[0].param, "images_not_supported")
        limits, inputs = self.config.image_limits, []
        for part in parts:
            try:
                inputs.append(preprocess(self._processor, part.url, limits))
            except ImageInputError as e:
                raise bad_request(f"{part.param}: {e}", part.param, e.code) from None
            except Exception as e:  # noqa: BLE001 - a client's bytes reached the decoder or processor: a 400, not a 500
                raise bad_request(f"{part.param}: the image could not be preprocessed ({type(e).__name__}: {e})",
                                  part.param, "invalid_image") from None
        spec = self.engine.spec
        try:
            ids = expand_placeholders(ids, inputs, spec.vision.image_token_id)
            return ids, make_request(spec, ids, inputs)
        except ImageInputError as e:  # the template dropped an image part, or the text holds a placeholder
            raise bad_request(f"{e}: the chat template renders one placeholder per image part and the text must "
                              f"hold none", "messages", "invalid_value") from None

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
            if n >= limit and not (req.max_tokens_zero and n == limit):
                raise bad_request(f"this model's maximum context length is {limit} tokens; the prompt has {n}",
                                  "messages" if req.kind == "chat" else "prompt", "context_length_exceeded")
            room = min(limit - n, cache_tokens - n + 1)  # the last sampled token is never cached
            if room < 1 and not req.max_tokens_zero:
                raise bad_request(f"the prompt has {n} tokens; the KV cache holds {cache_tokens}",
                                  "prompt", "context_length_exceeded")
            if req.max_tokens_given and not req.max_tokens_zero and req.params.max_tokens > room:
                raise bad_request(
                    f"this model's maximum context length is {limit} tokens (KV cache: {cache_tokens}); you "
                    f"requested {n + req.params.max_tokens} tokens ({n} in the prompt, {req.params.max_tokens} in "
                    f"the completion); reduce max_tokens to at most {room}", "max_tokens", "context_length_exceeded")
            rooms.append(max(room, 1))
        want = req.params.max_tokens
        if not req.max_tokens_given:  # OpenAI's defaults: chat runs to the context's end, completions 16
            want = min(rooms) if req.kind == "chat" else min(want, min(rooms))
        return with_max_tokens(req, want)

    def _submit(self, req: GenRequest) -> tuple[Sink, list[int], list[Choice]]:
        with self._lock:
            if self._pending >= self.config.max_pending:
                raise APIError(429, f"the service has {self._pending} requests in flight; retry later",
                               "server_overloaded", None, "overloaded")
            self._pending += 1
        if not self.loop.alive:
            self._release()
            raise APIError(503, f"the engine is not running ({self.loop.error or 'stopped'})", "server_error")
        sink = Sink(self.bridge)
        sids, choices = [], []
        for i, p in enumerate(req.prompts):
            for j in range(req.n):
                idx = i * req.n + j
                params = req.params
                if req.n > 1 and params.seed is not None:  # n seeded choices differ, and repeat
                    params = dataclasses.replace(params, seed=params.seed + j)
                sids.append(self.loop.submit(p, params, sink, idx, drop_output=req.max_tokens_zero, mm=req.mm))
                choices.append(Choice(idx, list(p)))
        return sink, sids, choices

    def _release(self) -> None:
        with self._lock:
            self._pending -= 1

    async def _events(self, sink: Sink, choices: list[Choice],
                      gone: Callable[[], Awaitable[bool]] | None = None) -> AsyncIterator[list[Delta]]:
        """Batches of Deltas until every choice has finished; APIError on failure or timeout, and
        ConnectionAbortedError when ``gone()`` says the client left."""
        deadline = time.monotonic() + self.config.request_timeout_s
        open_ = len(choices)
        while open_:
            left = deadline - time.monotonic()
            if left <= 0:
                raise APIError(504, f"the request did not finish within {self.config.request_timeout_s:g} s",
                               "timeout_error", None, "timeout")
            batch = await sink.get(min(left, 1.0))
            if not batch:
                if gone is not None and await gone():
                    raise ConnectionAbortedError("the client went away")
                continue
            out = []
            for e in batch:
                if isinstance(e, Failed):
                    raise APIError(e.status, e.message, "invalid_request_error" if e.status == 400 else "server_error")
                choices[e.index].add(e)
                if e.finish_reason is not None:
                    open_ -= 1
                out.append(e)
            yield out

    def _abort(self, sids: list[int], choices: list[Choice]) -> None:
        for sid, c in zip(sids, choices):
            if c.finish_reason is None:
                self.loop.abort(sid)

    async def generate(self, req: GenRequest, gone: Callable[[], Awaitable[bool]] | None = None) -> dict[str, Any]:
        """The whole body of a non-streamed request."""
        sink, sids, choices = self._submit(req)
        try:
            async for _ in self._events(sink, choices, gone):
                pass
        finally:
            self._abort(sids, choices)
            self._release()
        return full_response(req, self.config.model_name, choices, self.tokenizer)

    async def stream(self, req: GenRequest) -> AsyncIterator[dict[str, Any]]:
        """Chunk bodies of a streamed request; an error mid-stream is yielded as an error body. Closing the
        iterator (the client went away) aborts the request."""
        sink, sids, choices = self._submit(req)
        ch = Chunker(req, self.config.model_name, self.tokenizer)
        try:
            if req.kind == "chat":
                for c in choices:
                    yield ch.role(c.index)
            async for batch in self._events(sink, choices):
                for d in batch:
                    if d.text or d.finish_reason is not None or d.logprobs or req.return_token_ids:
                        yield ch.delta(d, choices)
            if req.include_usage:
                yield ch.usage(choices)
        except APIError as e:
            yield e.body()
        finally:
            self._abort(sids, choices)
            self._release()
