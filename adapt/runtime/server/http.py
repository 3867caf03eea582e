"""HTTP/1.1 over the standard library: routing, body limits, JSON and server-sent events.

``ThreadingHTTPServer`` gives each connection a thread; those threads only parse, tokenize and wait on
their request's queue, while the one engine loop thread runs the model. Streams are chunked
``text/event-stream`` (``data: {...}`` events, then ``data: [DONE]``); other bodies carry a
Content-Length, so connections are kept alive.
"""

from __future__ import annotations

import json
import threading
import time
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from adapt.runtime.server.errors import APIError, bad_request
from adapt.runtime.server.service import Service

GET_ROUTES = {"/health": "health", "/v1/models": "models"}
POST_ROUTES = {"/v1/completions": "completion", "/v1/chat/completions": "chat"}


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: "APIServer"

    def setup(self) -> None:
        self.timeout = self.server.service.config.read_timeout_s  # a stalled client cannot hold a thread
        super().setup()

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the base class's name
        if self.server.verbose:
            super().log_message(format, *args)

    # -- routing --------------------------------------------------------------------------------------

    def _route(self) -> str:
        return self.path.split("?", 1)[0].rstrip("/") or "/"

    def do_GET(self) -> None:  # noqa: N802 - http.server's naming
        path = self._route()
        svc = self.server.service
        if path == "/health":
            status, body = svc.health()
            return self._json(status, body)
        if path == "/v1/models":
            return self._json(200, svc.models())
        self._not_allowed_or_missing(path, "GET")

    def do_POST(self) -> None:  # noqa: N802
        path = self._route()
        if path not in POST_ROUTES:
            self._discard_body()
            return self._not_allowed_or_missing(path, "POST")
        try:
            body = self._read_json()
            svc = self.server.service
            req = svc.parse(POST_ROUTES[path], body)
            if req.stream:
                return self._sse(svc.stream(req))
            self._json(200, svc.generate(req))
        except APIError as e:
            self._error(e)

    def do_PUT(self) -> None:  # noqa: N802
        self._discard_body()
        self._not_allowed_or_missing(self._route(), "PUT")

    do_DELETE = do_PATCH = do_PUT

    def _not_allowed_or_missing(self, path: str, method: str) -> None:
        if path in GET_ROUTES or path in POST_ROUTES:
            allow = "GET" if path in GET_ROUTES else "POST"
            return self._error(APIError(405, f"{method} {path} is not allowed; use {allow}", "invalid_request_error",
                                        None, "method_not_allowed"), {"Allow": allow})
        self._error(APIError(404, f"no route {method} {path}; routes: GET /health, GET /v1/models, POST "
                                  "/v1/completions, POST /v1/chat/completions", "invalid_request_error", None,
                             "not_found"))

    # -- bodies ---------------------------------------------------------------------------------------

    def _length(self) -> int | None:
        v = self.headers.get("Content-Length")
        if v is None:
            return None
        try:
            n = int(v)
        except ValueError:
            n = -1
        if n < 0:
            raise bad_request(f"bad Content-Length {v!r}")
        return n

    def _discard_body(self) -> None:
        try:
            n = self._length() or 0
        except APIError:
            n = 0
        if n <= self.server.service.config.max_request_bytes:
            self.rfile.read(n)
        else:
            self.close_connection = True

    def _read_json(self) -> Any:
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
            self.close_connection = True
            raise APIError(411, "chunked request bodies are not supported; send Content-Length",
                           "invalid_request_error", None, "length_required")
        n = self._length()
        if n is None:
            self.close_connection = True
            raise APIError(411, "Content-Length is required", "invalid_request_error", None, "length_required")
        limit = self.server.service.config.max_request_bytes
        if n > limit:
            self.close_connection = True  # the body is left unread
            raise APIError(413, f"request body of {n} bytes exceeds the limit of {limit} bytes",
                           "invalid_request_error", None, "request_too_large")
        raw = self.rfile.read(n)
        if len(raw) < n:
            self.close_connection = True
            raise bad_request("the request body ended early")
        try:
            return json.loads(raw)
        except (ValueError, UnicodeDecodeError) as e:
            raise bad_request(f"the request body is not valid JSON: {e}", None, "invalid_json") from None

    # -- responses ------------------------------------------------------------------------------------

    def _json(self, status: int, body: Any, headers: dict[str, str] | None = None) -> None:
        data = json.dumps(body).encode("utf-8")
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        if self.close_connection:
            self.send_header("Connection", "close")
        self.end_headers()
        self.wfile.write(data)

    def _error(self, e: APIError, headers: dict[str, str] | None = None) -> None:
        self._json(e.status, e.body(), headers)

    def _sse(self, chunks) -> None:
        self.send_response(HTTPStatus.OK)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Cache-Control", "no-cache")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        try:
            for c in chunks:
                self._chunk(b"data: " + json.dumps(c).encode("utf-8") + b"\n\n")
            self._chunk(b"data: [DONE]\n\n")
            self._chunk(b"")
        except (BrokenPipeError, ConnectionResetError, TimeoutError, OSError):
            self.close_connection = True  # the client went away; closing the generator aborts the request
        finally:
            chunks.close()

    def _chunk(self, data: bytes) -> None:
        self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
        self.wfile.flush()


class APIServer(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, address: tuple[str, int], service: Service, verbose: bool = False):
        self.service, self.verbose = service, verbose
        super().__init__(address, Handler)

    @property
    def port(self) -> int:
        return int(self.server_address[1])


class RunningServer:
    """A started service on a background thread: ``url``, ``stop()``; also a context manager."""

    def __init__(self, server: APIServer):
        self.server = server
        self.service = server.service
        self._thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.2},
                                        name="adapt-http", daemon=True)

    @property
    def host(self) -> str:
        return str(self.server.server_address[0])

    @property
    def port(self) -> int:
        return self.server.port

    @property
    def url(self) -> str:
        host = self.host if ":" not in self.host else f"[{self.host}]"
        return f"http://{host}:{self.port}"

    def start(self) -> "RunningServer":
        self.service.start()
        self._thread.start()
        return self

    def stop(self, drain_s: float = 0.0) -> None:
        """Stop accepting, let in-flight requests finish for up to ``drain_s`` seconds, stop the engine loop
        (requests still in flight then get 503), close the socket."""
        self.server.shutdown()
        deadline = time.monotonic() + drain_s
        while self.service.pending and time.monotonic() < deadline:
            time.sleep(0.05)
        self.service.stop()
        self.server.server_close()
        self._thread.join(5.0)

    def __enter__(self) -> "RunningServer":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()
