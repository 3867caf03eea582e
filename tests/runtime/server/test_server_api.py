"""The OpenAI-compatible routes on a served tiny-llama: shapes, greedy equality with the engine, streaming,
and the error bodies."""

from __future__ import annotations

import http.client
import json
import socket

from tests.runtime.server.conftest import PROMPTS


def _choice(status_body):
    status, body = status_body
    assert status == 200, body
    return body, body["choices"][0]


def test_health_and_models(client):
    status, body = client.request("GET", "/health")
    assert status == 200 and body["status"] == "ok"
    status, body = client.request("GET", "/v1/models")
    assert status == 200 and body["object"] == "list"
    assert body["data"][0]["id"] == "tiny" and body["data"][0]["max_model_len"] == 256


def test_completion_string_equals_engine_greedy(client, offline):
    ref = offline[PROMPTS[0]]
    body, c = _choice(client.post("/v1/completions", {"model": "tiny", "prompt": PROMPTS[0], "max_tokens": 12,
                                                      "temperature": 0, "return_token_ids": True}))
    assert body["object"] == "text_completion" and body["id"].startswith("cmpl-")
    assert c["token_ids"] == ref.token_ids and c["text"] == ref.text
    assert c["prompt_token_ids"] == ref.prompt_token_ids and c["finish_reason"] == ref.finish_reason
    assert body["usage"] == {"prompt_tokens": len(ref.prompt_token_ids), "completion_tokens": 12,
                             "total_tokens": len(ref.prompt_token_ids) + 12}


def test_completion_token_ids_and_batch_of_prompts(client, offline):
    refs = [offline[p] for p in PROMPTS[:2]]
    body, c = _choice(client.post("/v1/completions", {"prompt": refs[0].prompt_token_ids, "max_tokens": 12,
                                                      "temperature": 0}))
    assert c["text"] == refs[0].text
    status, body = client.post("/v1/completions", {"prompt": [r.prompt_token_ids for r in refs], "max_tokens": 12,
                                                   "temperature": 0, "return_token_ids": True})
    assert status == 200 and [c["index"] for c in body["choices"]] == [0, 1]
    assert [c["token_ids"] for c in body["choices"]] == [r.token_ids for r in refs]
    assert body["usage"]["completion_tokens"] == 24


def test_logprobs_shapes(client):
    _, c = _choice(client.post("/v1/completions", {"prompt": "Hello", "max_tokens": 3, "temperature": 0,
                                                   "logprobs": 2}))
    lp = c["logprobs"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == 3
    assert all(len(t) <= 2 and max(t.values()) <= 0 for t in lp["top_logprobs"])
    assert "".join(lp["tokens"]) == c["text"] or len(c["text"]) > 0
    _, c = _choice(client.post("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                                        "max_tokens": 3, "temperature": 0, "logprobs": True,
                                                        "top_logprobs": 2}))
    content = c["logprobs"]["content"]
    assert len(content) == 3 and all(len(e["top_logprobs"]) == 2 and e["logprob"] <= 0 for e in content)


def test_chat_goes_through_the_template(client, engine):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": [{"type": "text",
                                                                                          "text": "hi"}]}]
    body, c = _choice(client.post("/v1/chat/completions", {"messages": messages, "max_tokens": 6, "temperature": 0,
                                                           "return_token_ids": True}))
    assert body["object"] == "chat.completion" and body["id"].startswith("chatcmpl-")
    assert c["message"]["role"] == "assistant" and isinstance(c["message"]["content"], str)
    flat = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    assert c["prompt_token_ids"] == engine.tokenizer.encode_chat(flat)
    assert body["usage"]["completion_tokens"] == len(c["token_ids"]) <= 6


def test_stream_completion_reassembles(client):
    req = {"prompt": PROMPTS[1], "max_tokens": 12, "temperature": 0}
    _, full = _choice(client.post("/v1/completions", req))
    events = client.stream("/v1/completions", {**req, "stream_options": {"include_usage": True}})
    assert events[-1] == "[DONE]"
    chunks, usage = events[:-2], events[-2]
    assert all(e["object"] == "text_completion" for e in chunks) and len({e["id"] for e in chunks}) == 1
    assert "".join(e["choices"][0]["text"] for e in chunks) == full["text"]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 12


def test_stream_chat_reassembles(client):
    req = {"messages": [{"role": "user", "content": "tell me"}], "max_tokens": 10, "temperature": 0}
    _, full = _choice(client.post("/v1/chat/completions", req))
    events = client.stream("/v1/chat/completions", req)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert all(e["object"] == "chat.completion.chunk" for e in chunks)
    text = "".join(e["choices"][0]["delta"].get("content", "") for e in chunks)
    assert text == full["message"]["content"]
    assert chunks[-1]["choices"][0]["finish_reason"] == full["finish_reason"]


def test_stop_string_cut_streamed_and_not(client, offline):
    ref = offline[PROMPTS[0]].text
    stop = ref[4:7]  # a piece of the greedy text
    req = {"prompt": PROMPTS[0], "max_tokens": 12, "temperature": 0, "stop": [stop]}
    _, c = _choice(client.post("/v1/completions", req))
    assert c["finish_reason"] == "stop" and c["text"] == ref[:ref.index(stop)]
    events = client.stream("/v1/completions", req)
    assert "".join(e["choices"][0]["text"] for e in events[:-1]) == c["text"]


def test_seeded_sampling_repeats(client):
    req = {"prompt": "abc", "max_tokens": 8, "temperature": 0.9, "top_p": 0.9, "top_k": 50, "seed": 7,
           "return_token_ids": True}
    a = _choice(client.post("/v1/completions", req))[1]["token_ids"]
    b = _choice(client.post("/v1/completions", req))[1]["token_ids"]
    assert a == b


def _err(status_body, status, param=None, code=None):
    got, body = status_body
    assert got == status, body
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    if param is not None:
        assert err["param"] == param
    if code is not None:
        assert err["code"] == code
    return err


def test_bad_requests_get_400(client):
    _err(client.request("POST", "/v1/completions", raw=b"{not json"), 400, code="invalid_json")
    _err(client.post("/v1/completions", [1, 2]), 400)
    _err(client.post("/v1/completions", {"prompt": "x", "n": 99}), 400, "n")
    _err(client.post("/v1/completions", {"prompt": "x", "n": 0}), 400, "n", "invalid_value")
    _err(client.post("/v1/completions", {"prompt": "x", "max_tokens": "8"}), 400, "max_tokens", "invalid_type")
    _err(client.post("/v1/completions", {"prompt": "x", "temperature": -1}), 400, "temperature")
    _err(client.post("/v1/completions", {"prompt": "x", "frobnicate": 1}), 400, "frobnicate", "unknown_field")
    _err(client.post("/v1/completions", {"prompt": "x", "presence_penalty": 5}), 400, "presence_penalty")
    _err(client.post("/v1/completions", {"prompt": "x", "suffix": "y"}), 400, "suffix", "unsupported")
    _err(client.post("/v1/completions", {"prompt": "x", "temperature": True}), 400, "temperature", "invalid_type")
    _err(client.post("/v1/completions", {"prompt": "x", "logit_bias": {"a": 1}}), 400, "logit_bias")
    _err(client.post("/v1/completions", {"prompt": "x", "max_tokens": 0}), 400, "max_tokens")
    _err(client.post("/v1/completions", {"prompt": "x", "max_tokens": 300}), 400, "max_tokens",
         "context_length_exceeded")
    _err(client.post("/v1/completions", {"prompt": [1, 99999]}), 400, "prompt")
    _err(client.post("/v1/completions", {"max_tokens": 3}), 400, "prompt", "missing_field")
    _err(client.post("/v1/chat/completions", {"messages": "hi"}), 400, "messages")
    _err(client.post("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "n": 30}), 400, "n")
    _err(client.post("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "video"}]}]}),
         400, "messages[0].content[0]", "invalid_type")  # the part, not "content is not a string"
    _err(client.post("/v1/completions", {"prompt": "x", "model": "gpt-4"}), 404, "model", "model_not_found")
    _err(client.post("/v1/chat/completions", {"messages": [{"role": "user"}]}), 400, "messages[0].content",
         "missing_field")
    # accepted no-op values of unsupported fields
    assert client.post("/v1/completions", {"prompt": "x", "max_tokens": 1, "presence_penalty": 0, "n": 1,
                                           "echo": False, "user": "u"})[0] == 200


def test_routes_methods_and_size_limits(client, server):
    _err(client.request("GET", "/v2/nothing"), 404, code="not_found")
    _err(client.request("POST", "/v1/embeddings", {"input": "x"}), 404)
    _err(client.request("GET", "/v1/completions"), 405, code="method_not_allowed")
    _err(client.request("POST", "/health", {}), 405)
    _err(client.request("POST", "/v1/completions", {"prompt": "x" * 5000}), 413, code="request_too_large")
    # a chunked body (no Content-Length) is read, and its size limit still holds
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as s:
        body = b'{"prompt": [1, 2], "max_tokens": 1}'
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
                  + f"{len(body):x}\r\n".encode() + body + b"\r\n0\r\n\r\n")
        head = s.recv(4096).decode()
    assert head.startswith("HTTP/1.1 200"), head
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
                  b"1400\r\n" + b" " * 0x1400 + b"\r\n0\r\n\r\n")
        head = s.recv(4096).decode()
    assert head.startswith("HTTP/1.1 413"), head
    # keep-alive: two requests on one connection
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=10)
    for _ in range(2):
        conn.request("GET", "/health")
        r = conn.getresponse()
        assert r.status == 200 and json.loads(r.read())["status"] == "ok"
    conn.close()
