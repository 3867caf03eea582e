"""``adapt serve``: an OpenAI-compatible HTTP service over the Engine (FastAPI on uvicorn).

Library API::

    with start_server(engine, port=0) as srv:        # 127.0.0.1, a free port
        urllib.request.urlopen(srv.url + "/health")
    serve(engine, host="127.0.0.1", port=8000)       # blocks until SIGINT / SIGTERM

Files: protocol (the API's pydantic models, shared with clients), requests (models -> engine requests),
loop (the engine thread, continuous batching), service (routes without HTTP), responses (OpenAI bodies
and chunks), metrics (Prometheus), health (the golden replay), app (FastAPI), server (uvicorn thread).
"""

from __future__ import annotations

import asyncio
import signal
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

from adapt.errors import RuntimeConfigError
from adapt.runtime.server.errors import APIError
from adapt.runtime.server.service import Service, ServiceConfig

__all__ = ["APIError", "RunningServer", "Service", "ServiceConfig", "serve", "start_server"]

DEFAULT_HOST = "127.0.0.1"


class RunningServer:
    """A started service: uvicorn on a background thread with its own event loop; ``url``, ``stop()``."""

    def __init__(self, service: Service, sock: socket.socket, verbose: bool = False):
        import uvicorn

        from adapt.runtime.server.app import build_app
        from adapt.runtime.server.health import GoldenCheck, load_golden

        self.service = service
        self.sock = sock
        cfg = service.config
        self.golden = None
        if cfg.health_golden:
            cases = load_golden(cfg.health_golden, service.engine.spec.vocab_size)
            self.golden = GoldenCheck(service, cases, str(cfg.health_golden), cfg.health_golden_interval_s)
        self.app = build_app(service, self.golden)
        ucfg = uvicorn.Config(self.app, log_level="info" if verbose else "warning", access_log=verbose,
                              backlog=cfg.backlog, timeout_keep_alive=max(5, int(cfg.read_timeout_s)),
                              lifespan="off", timeout_graceful_shutdown=30)
        self.uvicorn = uvicorn.Server(ucfg)
        self._aloop: asyncio.AbstractEventLoop | None = None
        self._thread = threading.Thread(target=self._run, name="adapt-http", daemon=True)

    def _run(self) -> None:
        async def main():
            self._aloop = asyncio.get_running_loop()
            await self.uvicorn.serve(sockets=[self.sock])
        with asyncio.Runner(loop_factory=_loop_factory()) as runner:
            runner.run(main())

    @property
    def host(self) -> str:
        return str(self.sock.getsockname()[0])

    @property
    def port(self) -> int:
        return int(self.sock.getsockname()[1])

    @property
    def url(self) -> str:
        host = self.host if ":" not in self.host else f"[{self.host}]"
        return f"http://{host}:{self.port}"

    def start(self, timeout: float = 30.0) -> "RunningServer":
        self.service.start()
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self.uvicorn.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                self.service.stop()
                raise RuntimeConfigError("the HTTP server did not start")
            time.sleep(0.01)
        if self.golden is not None:  # the first answer at start-up; a mismatch shows on /health/golden
            self.call(self.golden.run(), timeout=self.service.config.request_timeout_s)
        return self

    def call(self, coro, timeout: float | None = None) -> Any:
        """Run a coroutine on the server's event loop from another thread; its result."""
        return asyncio.run_coroutine_threadsafe(coro, self._aloop).result(timeout)

    def stop(self, drain_s: float = 0.0) -> None:
        """Stop accepting, let in-flight requests finish for up to ``drain_s`` seconds, stop the engine loop
        (requests still in flight then get 503), close the socket."""
        self.uvicorn.should_exit = True
        deadline = time.monotonic() + drain_s
        while self.service.pending and time.monotonic() < deadline:
            time.sleep(0.05)
        self.service.stop()
        self._thread.join(10.0)
        if self._thread.is_alive():  # connections that will not close: give up on them
            self.uvicorn.force_exit = True
            self._thread.join(5.0)
        self.sock.close()

    def __enter__(self) -> "RunningServer":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()


def _listen(host: str, port: int, backlog: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, int(port)))
        sock.listen(backlog)
    except OSError as e:
        sock.close()
        raise RuntimeConfigError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    sock.set_inheritable(True)
    return sock


def _loop_factory():
    """uvloop's event loop where it is installed (a base dependency off Windows), else asyncio's: the HTTP side's
    per-event cost is CPU taken from the engine on a small host."""
    try:
        import uvloop
    except ImportError:
        return None
    return uvloop.new_event_loop


def start_server(engine, host: str = DEFAULT_HOST, port: int = 0, model_name: str | None = None,
                 config: ServiceConfig | None = None, verbose: bool = False) -> RunningServer:
    """Bind ``host:port`` (0: a free port), start the engine loop and the HTTP thread; returns at once."""
    cfg = config or ServiceConfig(model_name=model_name or _default_name(engine))
    sock = _listen(host, port, cfg.backlog)
    try:
        return RunningServer(Service(engine, cfg), sock, verbose).start()
    except BaseException:
        sock.close()
        raise


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
