"""service: ``adapt serve`` over the target's engine answers what the engine answers offline.

The "healthy but wrong" failure mode: a service can pass /health and return well-formed JSON while its
tokens differ from the runtime's (a dropped sampling field, a template applied twice, a batching bug).
The check computes the engine's own greedy tokens for the first validation prompt, then starts the
service in-process on 127.0.0.1 with a free port over the same engine, waits for /health (bounded),
sends the same greedy completion plain and streamed, a chat completion plain and streamed (when the
tokenizer has a chat template), and stops it.

Metrics: ``token_match`` (1.0 when the service's greedy tokens equal the engine's), ``token_agreement``
(positions equal), ``stream_match`` (streamed tokens and text equal the plain response), ``chat_ok`` (the served
chat prompt is the template's rendering; the item fails when it is not; absent without a template),
``startup_s`` (bind + engine loop + first /health; the model is already loaded), ``shutdown_s``.
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from collections.abc import Mapping
from typing import Any

from adapt.validate.checklist import Outcome, Skip, register_check

CHAT = [{"role": "user", "content": "Say hello."}]


def _call(url: str, body: dict | None, timeout: float) -> tuple[int, Any]:
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            if r.headers.get("Content-Type") == "text/event-stream":
                events = [line.decode()[6:].strip() for line in r if line.startswith(b"data: ")]
                return r.status, [e if e == "[DONE]" else json.loads(e) for e in events]
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")


def _wait_health(url: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    last = "no answer"
    while time.monotonic() < deadline:
        try:
            status, body = _call(url + "/health", None, 2.0)
            if status == 200:
                return
            last = f"HTTP {status}: {body}"
        except OSError as e:
            last = str(e)
        time.sleep(0.05)
    raise TimeoutError(f"/health did not answer 200 within {timeout:g} s ({last})")


def _ok(status: int, body: Any, what: str) -> Any:
    if status != 200:
        raise RuntimeError(f"{what}: HTTP {status} {json.dumps(body)[:300]}")
    return body


def _streamed(events: list, chat: bool) -> tuple[list[int], str]:
    if not events or events[-1] != "[DONE]":
        raise RuntimeError("the stream did not end with data: [DONE]")
    ids, text = [], ""
    for e in events[:-1]:
        if "error" in e:
            raise RuntimeError(f"stream error: {e['error'].get('message')}")
        for c in e["choices"]:
            ids += c.get("token_ids", [])
            text += c["delta"].get("content", "") if chat else c["text"]
    return ids, text


@register_check("service")
def service(params: Mapping[str, Any], thresholds: Mapping[str, float], ctx) -> Outcome:
    engine = ctx.target.engine
    if engine is None:
        raise Skip("the service serves adapt's runtime, which did not run this target "
                   f"({ctx.target.reason or 'runtime ' + ctx.target.runtime})")
    from adapt.runtime.sampling import SamplingParams
    from adapt.runtime.server import ServiceConfig, start_server

    n = int(params.get("max_new_tokens", 16))
    timeout = float(params.get("timeout_s", 60))
    prompt = [int(t) for t in ctx.prompts[0]]
    # offline first: while the service runs, its engine loop is the engine's only user
    offline = engine.generate([prompt], SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))[0].token_ids
    tok = engine.tokenizer
    t0 = time.perf_counter()
    srv = start_server(engine, "127.0.0.1", 0, config=ServiceConfig("validate", request_timeout_s=timeout))
    m: dict[str, Any] = {}
    try:
        _wait_health(srv.url, timeout)
        m["startup_s"] = time.perf_counter() - t0
        req = {"model": "validate", "prompt": prompt, "max_tokens": n, "temperature": 0, "ignore_eos": True,
               "return_token_ids": True}
        c = _ok(*_call(srv.url + "/v1/completions", req, timeout), "completion")["choices"][0]
        got = c["token_ids"]
        m["token_match"] = float(got == offline)
        m["token_agreement"] = sum(a == b for a, b in zip(got, offline)) / max(len(offline), 1)
        s_ids, s_text = _streamed(_ok(*_call(srv.url + "/v1/completions", {**req, "stream": True}, timeout),
                                      "streamed completion"), chat=False)
        stream_ok = s_ids == got and s_text == c["text"]
        chat_note = "no chat template"
        if tok is not None and tok.chat_template:
            creq = {"messages": CHAT, "max_tokens": min(n, 8), "temperature": 0, "return_token_ids": True}
            cc = _ok(*_call(srv.url + "/v1/chat/completions", creq, timeout), "chat completion")["choices"][0]
            m["chat_ok"] = float(cc["prompt_token_ids"] == tok.encode_chat(CHAT)
                                 and isinstance(cc["message"]["content"], str))
            c_ids, c_text = _streamed(_ok(*_call(srv.url + "/v1/chat/completions", {**creq, "stream": True},
                                                 timeout), "streamed chat"), chat=True)
            stream_ok = stream_ok and c_ids == cc["token_ids"] and c_text == cc["message"]["content"]
            chat_note = "chat plain and streamed"
        m["stream_match"] = float(stream_ok)
    except (OSError, TimeoutError, RuntimeError, KeyError, ValueError) as e:
        return Outcome(m, status="fail", message=f"service at {srv.url}: {e}")
    finally:
        t1 = time.perf_counter()
        srv.stop()
        m["shutdown_s"] = time.perf_counter() - t1
    first = next((i for i in range(max(len(got), len(offline)))
                  if i >= len(got) or i >= len(offline) or got[i] != offline[i]), None)
    diff = "" if first is None else f"; greedy tokens differ from the engine's offline run at position {first}"
    if m.get("chat_ok") == 0.0:
        return Outcome(m, status="fail", message="chat: the served prompt is not the chat template's rendering")
    return Outcome(m, message=f"started in {m['startup_s']:.3f}s; {n} greedy tokens via HTTP vs offline; "
                              f"{chat_note}{diff}")
