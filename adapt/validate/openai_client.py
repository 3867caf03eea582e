"""A small client for OpenAI-compatible servers (vLLM, SGLang, llama.cpp, a vendor's fork, adapt serve).

Standard library only (``http.client``): validate and ``adapt bench serve`` need exact control over what is
sent, what counts as an answer and how long a silent socket is waited for, and no extra dependency. Every
failure becomes one ``EndpointError`` whose ``kind`` says what went wrong, for reports and error counts:

    unreachable  no TCP connection (refused, unknown host)
    timeout      no byte for ``timeout`` seconds (a stalled request or stream)
    http         a status other than 200 (the server's error message kept)
    malformed    a 200 whose body is not the JSON / SSE an OpenAI server sends
    stream       the stream ended early (no ``data: [DONE]``) or carried an error event

Extensions (``return_token_ids``, ``ignore_eos``, ...) are negotiated: ``post_negotiated`` sends them,
and when the server answers 400 naming one it drops that field, remembers it, and sends the request again.
"""

from __future__ import annotations

import http.client
import json
import socket
import time
import urllib.parse
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

KINDS = ("unreachable", "timeout", "http", "malformed", "stream")


class EndpointError(Exception):
    """A request that got no usable answer; ``kind`` is one of ``KINDS``."""

    def __init__(self, kind: str, message: str, status: int | None = None, param: str | None = None):
        super().__init__(message)
        self.kind, self.status, self.param = kind, status, param


def _error_param(body: Any) -> tuple[str, str | None]:
    """(message, param) of an OpenAI-shaped error body ``{"error": {"message", "param", ...}}``."""
    err = body.get("error") if isinstance(body, dict) else None
    if isinstance(err, dict):
        return str(err.get("message", "")), err.get("param") if isinstance(err.get("param"), str) else None
    if isinstance(body, dict) and isinstance(body.get("detail"), (str, list)):  # FastAPI's validation shape
        return json.dumps(body["detail"])[:300], None
    return json.dumps(body)[:300] if body is not None else "", None


@dataclass
class Client:
    """One server at ``url`` (``http://host:port``, with or without a trailing ``/v1``)."""

    url: str
    api_key: str | None = None
    timeout: float = 60.0
    dropped: set[str] = field(default_factory=set)  # extensions the server refused

    def __post_init__(self) -> None:
        u = urllib.parse.urlsplit(self.url if "://" in self.url else "http://" + self.url)
        if u.scheme not in ("http", "https") or not u.hostname:
            raise ValueError(f"--endpoint {self.url!r}: expected http://HOST:PORT")
        self.scheme, self.host = u.scheme, u.hostname
        self.port = u.port or (443 if u.scheme == "https" else 80)
        self.base = u.path.rstrip("/").removesuffix("/v1")
        self.url = f"{u.scheme}://{u.netloc}{self.base}"

    # ------------------------------------------------------------------------------------------ plumbing

    def _conn(self, timeout: float | None) -> http.client.HTTPConnection:
        cls = http.client.HTTPSConnection if self.scheme == "https" else http.client.HTTPConnection
        return cls(self.host, self.port, timeout=self.timeout if timeout is None else timeout)

    def _headers(self, body: bool) -> dict[str, str]:
        h = {"Accept": "application/json"}
        if body:
            h["Content-Type"] = "application/json"
        if self.api_key:
            h["Authorization"] = f"Bearer {self.api_key}"
        return h

    def _open(self, method: str, path: str, body: dict | None, timeout: float | None):
        conn = self._conn(timeout)
        data = json.dumps(body).encode() if body is not None else None
        try:
            conn.request(method, self.base + path, body=data, headers=self._headers(data is not None))
            return conn, conn.getresponse()
        except (socket.timeout, TimeoutError):
            conn.close()
            raise EndpointError("timeout", f"{method} {path}: no answer within {self._t(timeout):g} s") from None
        except (ConnectionRefusedError, socket.gaierror) as e:
            conn.close()
            raise EndpointError("unreachable", f"{method} {path}: {self._say(e)}") from None
        except (http.client.HTTPException, ConnectionResetError, BrokenPipeError) as e:
            conn.close()  # it accepted the connection but sent no HTTP answer
            raise EndpointError("malformed", f"{method} {path}: no HTTP answer ({self._say(e)})") from None
        except OSError as e:
            conn.close()
            raise EndpointError("unreachable", f"{method} {path}: {self._say(e)}") from None

    def _t(self, timeout: float | None) -> float:
        return self.timeout if timeout is None else timeout

    def _say(self, e: BaseException) -> str:
        if isinstance(e, ConnectionRefusedError):
            return f"connection refused at {self.host}:{self.port} (is the server up?)"
        return f"{type(e).__name__}: {e}" if str(e) else type(e).__name__

    def _read(self, method: str, path: str, resp, timeout: float | None) -> bytes:
        try:
            return resp.read()
        except (socket.timeout, TimeoutError):
            raise EndpointError("timeout", f"{method} {path}: the body stalled for {self._t(timeout):g} s") from None
        except (OSError, http.client.HTTPException) as e:
            raise EndpointError("malformed", f"{method} {path}: body cut off ({self._say(e)})") from None

    def _json(self, method: str, path: str, raw: bytes, status: int) -> Any:
        try:
            return json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError):
            what = "an error" if status != 200 else "a body"
            raise EndpointError("malformed" if status == 200 else "http",
                                f"{method} {path}: HTTP {status} with {what} that is not JSON: {raw[:120]!r}",
                                status=status) from None

    # ------------------------------------------------------------------------------------------ calls

    def get(self, path: str, timeout: float | None = None) -> tuple[int, Any]:
        """(status, parsed JSON or the text) of GET ``path``; raises only when no answer came."""
        conn, resp = self._open("GET", path, None, timeout)
        try:
            raw = self._read("GET", path, resp, timeout)
        finally:
            conn.close()
        try:
            return resp.status, json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError):
            return resp.status, raw.decode("utf-8", "replace")

    def post(self, path: str, body: dict, timeout: float | None = None) -> dict[str, Any]:
        """The JSON answer of POST ``path``; any status but 200 raises ``EndpointError('http')``."""
        conn, resp = self._open("POST", path, body, timeout)
        try:
            raw = self._read("POST", path, resp, timeout)
        finally:
            conn.close()
        doc = self._json("POST", path, raw, resp.status)
        if resp.status != 200:
            msg, param = _error_param(doc)
            raise EndpointError("http", f"POST {path}: HTTP {resp.status} {msg}", status=resp.status, param=param)
        if not isinstance(doc, dict):
            raise EndpointError("malformed", f"POST {path}: answer is {type(doc).__name__}, not an object")
        return doc

    def stream(self, path: str, body: dict, timeout: float | None = None) -> Iterator[tuple[float, dict]]:
        """POST with ``stream: true``: yields (perf_counter time, event) per ``data:`` line until ``[DONE]``.

        ``timeout`` bounds every read, so a stream that stalls mid-way raises ``timeout``; one that ends
        without ``[DONE]`` raises ``stream``.
        """
        conn, resp = self._open("POST", path, {**body, "stream": True}, timeout)
        try:
            if resp.status != 200:
                doc = self._json("POST", path, self._read("POST", path, resp, timeout), resp.status)
                msg, param = _error_param(doc)
                raise EndpointError("http", f"POST {path} (stream): HTTP {resp.status} {msg}", status=resp.status,
                                    param=param)
            n = 0
            while True:
                try:
                    line = resp.readline()
                except (socket.timeout, TimeoutError):
                    raise EndpointError("timeout", f"POST {path}: the stream stalled for {self._t(timeout):g} s "
                                                   f"after {n} events") from None
                except (OSError, http.client.HTTPException) as e:
                    raise EndpointError("stream", f"POST {path}: stream cut off after {n} events "
                                                  f"({self._say(e)})") from None
                if not line:
                    raise EndpointError("stream", f"POST {path}: the stream ended after {n} events without "
                                                  "data: [DONE]")
                line = line.strip()
                if not line.startswith(b"data:"):
                    continue  # blank separators, comments (": ping"), event: lines
                data = line[5:].strip()
                if data == b"[DONE]":
                    return
                try:
                    ev = json.loads(data)
                except (json.JSONDecodeError, UnicodeDecodeError):
                    raise EndpointError("malformed", f"POST {path}: stream event {n} is not JSON: "
                                                     f"{data[:120]!r}") from None
                if not isinstance(ev, dict):
                    raise EndpointError("malformed", f"POST {path}: stream event {n} is not an object")
                if "error" in ev:
                    raise EndpointError("stream", f"POST {path}: error event: {_error_param(ev)[0]}")
                n += 1
                yield time.perf_counter(), ev
        finally:
            conn.close()

    def post_negotiated(self, path: str, body: dict, extensions: dict[str, Any], timeout: float | None = None,
                        stream: bool = False) -> Any:
        """POST ``body`` plus the ``extensions`` this server has not refused yet; a 400 naming one of them
        drops it (for this client's lifetime) and retries. Returns the JSON, or the event list when ``stream``."""
        while True:
            ext = {k: v for k, v in extensions.items() if k not in self.dropped}
            try:
                if stream:
                    return list(self.stream(path, {**body, **ext}, timeout))
                return self.post(path, {**body, **ext}, timeout)
            except EndpointError as e:
                hit = self._refused(e, ext)
                if hit is None:
                    raise
                self.dropped.add(hit)

    @staticmethod
    def _refused(e: EndpointError, ext: dict[str, Any]) -> str | None:
        if e.kind != "http" or e.status not in (400, 422) or not ext:
            return None
        if e.param in ext:
            return e.param
        return next((k for k in ext if k in str(e)), None)
