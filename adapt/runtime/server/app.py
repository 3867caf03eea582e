"""The FastAPI app: routes, the API key, the connection limit, OpenAI-shaped errors, SSE streams.

The HTTP side is async (uvicorn's event loop); the one engine loop thread runs the model. Bodies are read
as bytes, size-checked, parsed as JSON and validated by the pydantic models of protocol.py, so every
refusal is a one-line OpenAI-shaped error naming the field. Every route but ``/health``,
``/health/golden`` and ``/metrics`` needs ``Authorization: Bearer KEY`` when a key is set (``/metrics``
too with ``metrics_auth``); the key is compared in constant time.
"""

from __future__ import annotations

import hmac
import json
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from adapt.runtime.server.errors import APIError, bad_request
from adapt.runtime.server.metrics import CONTENT_TYPE
from adapt.runtime.server.protocol import DetokenizeRequest, TokenizeRequest
from adapt.runtime.server.requests import chat_ids, validate
from adapt.runtime.server.service import Service

ROUTES = ("GET /health", "GET /health/golden", "GET /metrics", "GET /version", "GET /v1/models",
          "GET /v1/models/{id}", "POST /tokenize", "POST /detokenize", "POST /v1/completions",
          "POST /v1/chat/completions")
_OPEN = ("/health", "/health/golden")  # never behind the key: load balancers probe them
_GENERATION = ("/v1/completions", "/v1/chat/completions")


def _version() -> str:
    try:
        from importlib.metadata import version

        return version("adapt")
    except Exception:  # noqa: BLE001 - not installed as a distribution (a source checkout)
        return "0+unknown"


def error_response(e: APIError, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status, headers=headers)


class Limits:
    """Pure ASGI middleware: the API key and the open-request limit, before any routing or body read."""

    def __init__(self, app, service: Service):
        self.app, self.service = app, service
        self.open = 0

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        cfg = self.service.config
        path = scope["path"].rstrip("/") or "/"
        if cfg.api_key and path not in _OPEN and (path != "/metrics" or cfg.metrics_auth):
            if not _authorized(scope, cfg.api_key):
                e = APIError(401, "invalid or missing API key: send 'Authorization: Bearer KEY'",
                             "invalid_request_error", None, "invalid_api_key")
                return await error_response(e, {"WWW-Authenticate": "Bearer"})(scope, receive, send)
        if self.open >= cfg.max_connections and path not in _OPEN:
            e = APIError(429, f"the service has {self.open} open requests (limit {cfg.max_connections}); retry later",
                         "server_overloaded", None, "overloaded")
            return await error_response(e, {"Retry-After": str(cfg.retry_after_s)})(scope, receive, send)
        gen = path in _GENERATION  # counted so that an idle engine waits for a burst still being parsed
        self.open += 1
        self.service.http_open += gen
        try:
            await self.app(scope, receive, send)
        finally:
            self.open -= 1
            self.service.http_open -= gen


def _authorized(scope, key: str) -> bool:
    for name, value in scope.get("headers", ()):
        if name == b"authorization":
            scheme, _, token = value.decode("latin-1").partition(" ")
            return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), key.encode())
    return False


async def _body(request: Request, limit: int) -> Any:
    n = request.headers.get("content-length")
    if n is not None and n.isdigit() and int(n) > limit:
        raise APIError(413, f"request body of {n} bytes exceeds the limit of {limit} bytes", "invalid_request_error",
                       None, "request_too_large")
    raw = bytearray()
    async for chunk in request.stream():
        raw += chunk
        if len(raw) > limit:
            raise APIError(413, f"request body exceeds the limit of {limit} bytes", "invalid_request_error", None,
                           "request_too_large")
    try:
        return json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise bad_request(f"the request body is not valid JSON: {e}", None, "invalid_json") from None


def _sse(chunks) -> StreamingResponse:
    async def events():
        try:
            async for c in chunks:
                yield b"data: " + json.dumps(c).encode("utf-8") + b"\n\n"
            yield b"data: [DONE]\n\n"
        finally:
            await chunks.aclose()  # the client went away: aborts the request in the engine
    # exactly "text/event-stream" (no charset parameter): some clients compare the header whole
    return StreamingResponse(events(), headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})


def build_app(service: Service, golden=None) -> Any:
    """The ASGI app serving ``service``; ``golden`` (health.GoldenCheck) answers /health/golden."""
    app = FastAPI(title="adapt serve", version=_version(), docs_url=None, redoc_url=None, openapi_url=None)
    cfg = service.config

    @app.exception_handler(APIError)
    async def _api_error(request: Request, e: APIError):
        headers = {"Retry-After": str(cfg.retry_after_s)} if e.status in (429, 503) else None
        return error_response(e, headers)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, e: StarletteHTTPException):
        method, path = request.method, request.url.path
        if e.status_code == 405:
            return error_response(APIError(405, f"{method} {path} is not allowed", "invalid_request_error", None,
                                           "method_not_allowed"), dict(e.headers or {}))
        if e.status_code == 404:
            return error_response(APIError(404, f"no route {method} {path}; routes: {', '.join(ROUTES)}",
                                           "invalid_request_error", None, "not_found"))
        return error_response(APIError(e.status_code, str(e.detail), "invalid_request_error"))

    @app.get("/health")
    async def health():
        status, body = service.health()
        return JSONResponse(body, status_code=status)

    @app.get("/health/golden")
    async def health_golden():
        if golden is None:
            raise APIError(404, "no golden check configured: start with --health-golden FILE",
                           "invalid_request_error", None, "not_found")
        status, body = await golden.answer()
        return JSONResponse(body, status_code=status)

    @app.get("/metrics")
    async def metrics():
        return Response(service.metrics.exposition(), media_type=CONTENT_TYPE)

    @app.get("/version")
    async def version():
        return {"version": _version()}

    @app.get("/v1/models")
    async def models():
        return service.models()

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str):
        service.check_model(model_id)
        return service.model_card()

    @app.post("/tokenize")
    async def tokenize(request: Request):
        req = validate(TokenizeRequest, await _body(request, cfg.max_request_bytes))
        service.check_model(req.model)
        tok = service.tokenizer
        if tok is None:
            raise bad_request("the model has no tokenizer", "prompt")
        if (req.prompt is None) == (req.messages is None):
            raise bad_request("send exactly one of 'prompt' and 'messages'", "prompt")
        if req.prompt is not None:
            ids = tok.encode(req.prompt)
        else:  # with images: the placeholders expanded to the image token counts, as a completion would see them
            parts: list = []
            ids = chat_ids(req.messages, tok, parts, service.max_images)
            if parts:
                ids, _ = await service.load_images(ids, parts)
        return {"count": len(ids), "max_model_len": service.engine.max_model_len, "tokens": ids}

    @app.post("/detokenize")
    async def detokenize(request: Request):
        req = validate(DetokenizeRequest, await _body(request, cfg.max_request_bytes))
        service.check_model(req.model)
        if service.tokenizer is None:
            raise bad_request("the model has no tokenizer", "tokens")
        vocab = service.engine.spec.vocab_size
        bad = [t for t in req.tokens if t >= vocab]
        if bad:
            raise bad_request(f"token id {bad[0]} is outside the vocabulary [0, {vocab})", "tokens")
        return {"prompt": service.tokenizer.decode(req.tokens)}

    async def generation(route: str, request: Request):
        req = await service.prepare(route, await _body(request, cfg.max_request_bytes))
        if req.stream:
            return _sse(service.stream(req))
        try:
            return await service.generate(req, request.is_disconnected)
        except ConnectionAbortedError:
            return Response(status_code=499)  # nobody reads it; nginx's "client closed request"

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await generation("completion", request)

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        return await generation("chat", request)

    return Limits(app, service)
