"""``adapt serve``: an OpenAI-compatible HTTP service over the Engine.

Library API::

    with start_server(engine, port=0) as srv:        # 127.0.0.1, a free port
        urllib.request.urlopen(srv.url + "/health")
    serve(engine, host="127.0.0.1", port=8000)       # blocks until SIGINT / SIGTERM

Routes: GET /health, GET /v1/models, POST /v1/completions, POST /v1/chat/completions (see protocol.py
for the fields). Files: protocol (request parsing), loop (the engine thread, continuous batching),
service (routes without HTTP), responses (OpenAI bodies and chunks), http (the stdlib HTTP server).
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable

from adapt.errors import RuntimeConfigError
from adapt.runtime.server.errors import APIError
from adapt.runtime.server.http import APIServer, RunningServer
from adapt.runtime.server.service import Service, ServiceConfig

__all__ = ["APIError", "RunningServer", "Service", "ServiceConfig", "serve", "start_server"]

DEFAULT_HOST = "127.0.0.1"


def start_server(engine, host: str = DEFAULT_HOST, port: int = 0, model_name: str | None = None,
                 config: ServiceConfig | None = None, verbose: bool = False) -> RunningServer:
    """Bind ``host:port`` (0: a free port), start the engine loop and the HTTP thread; returns at once."""
    cfg = config or ServiceConfig(model_name=model_name or _default_name(engine))
    try:
        server = APIServer((host, int(port)), Service(engine, cfg), verbose=verbose)
    except OSError as e:
        raise RuntimeConfigError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    return RunningServer(server).start()


def serve(engine, host: str = DEFAULT_HOST, port: int = 8000, model_name: str | None = None,
          config: ServiceConfig | None = None, on_ready: Callable[[RunningServer], None] | None = None,
          drain_s: float = 10.0, verbose: bool = False) -> None:
    """Serve until SIGINT or SIGTERM, then stop accepting, drain in-flight requests for up to ``drain_s``
    seconds and stop. Must run on the main thread (signal handlers)."""
    stop = threading.Event()
    previous = {s: signal.signal(s, lambda *_: stop.set()) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        srv = start_server(engine, host, port, model_name, config, verbose)
        try:
            if on_ready is not None:
                on_ready(srv)
            while not stop.wait(0.5):
                if not srv.service.loop.alive:
                    raise RuntimeConfigError(f"the engine loop stopped: {srv.service.loop.error}")
        finally:
            srv.stop(drain_s)
    finally:
        for s, h in previous.items():
            signal.signal(s, h)


def _default_name(engine) -> str:
    return engine.path.name if getattr(engine, "path", None) is not None else "adapt"
