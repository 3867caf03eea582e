"""Images in adapt serve: OpenAI ``image_url`` content parts on /v1/chat/completions.

Served tiny llava-1.5 and Qwen2.5-VL (transformers' random models, tests/runtime/vision/vlm.py) through the
official openai client give exactly the greedy tokens of ``adapt run --image --chat`` (run_generation, the
CLI's core, and the CLI itself) on the same image, for several sizes incl. non-square, alone and concurrently with text
requests; the tower runs once per request (n = 2 included). Every bad image is a 400 in OpenAI's error
shape naming the part, and the server answers the next request: not an image, corrupt bytes, unsupported
media type, too many bytes, too many pixels, a file path, a remote URL while remote images are off, and,
with them on, remote fetches from a 127.0.0.1 HTTP server that fail, stall, redirect off http or send too
much; too many images; an image to a text-only model.
"""

from __future__ import annotations

import asyncio
import base64
import http.server
import io
import threading
import time

import pytest

pytest.importorskip("PIL")
openai = pytest.importorskip("openai")

from tests.runtime.server.conftest import Client  # noqa: E402
from tests.runtime.vision.vlm import IMAGE_TOKEN, make_image, save_vlm  # noqa: E402

SIZES = [(30, 30), (45, 20), (20, 50), (64, 33)]
N = 6  # greedy tokens per request
MAX_IMAGE_BYTES = 16 << 10
MAX_IMAGE_PIXELS = 100 * 100
_PATHS: dict = {}  # kind -> the served checkpoint


def _png(im) -> bytes:
    buf = io.BytesIO()
    im.save(buf, "PNG")
    return buf.getvalue()


def _url(data: bytes, media: str = "image/png") -> str:
    return f"data:{media};base64," + base64.b64encode(data).decode()


def _messages(urls: list[str], text: str = "What is it?") -> list[dict]:
    """adapt run --chat's order: the images, then the text."""
    return [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": u}} for u in urls]
             + [{"type": "text", "text": text}]}]


def _engine(path):
    from adapt.runtime.engine import Engine

    return Engine.from_pretrained(path, kv_cache_memory="16MiB", max_model_len=512, max_num_seqs=8)


class _Counted:
    """Wraps model.encode_images to count tower runs (the loop thread calls it)."""

    def __init__(self, model):
        self.calls, self.fn = 0, model.encode_images
        model.encode_images = self

    def __call__(self, *a, **k):
        self.calls += 1
        return self.fn(*a, **k)


@pytest.fixture(scope="module", params=("llava", "qwen2_5_vl"))
def served(request, tmp_path_factory):
    """(kind, server, offline greedy tokens per size from run_generation, the tower-call counter)."""
    from adapt.runtime.run import run_generation
    from adapt.runtime.server import ServiceConfig, start_server

    kind = request.param
    _, path = save_vlm(kind, tmp_path_factory.mktemp("srv-" + kind) / "model")
    _PATHS[kind] = path
    eng = _engine(path)
    want = {}
    for i, (w, h) in enumerate(SIZES):
        doc = run_generation(path, ["What is it?"], chat=True, images=[_url(_png(make_image(w, h, seed=i)))],
                             max_tokens=N, temperature=0.0, ignore_eos=True, engine=eng)
        o = doc["outputs"][0]
        assert IMAGE_TOKEN[kind] in o["prompt_token_ids"]
        want[(w, h)] = (o["prompt_token_ids"], o["token_ids"])
    two = [_url(_png(make_image(*SIZES[1], seed=1))), _url(_png(make_image(*SIZES[2], seed=2)))]
    doc = run_generation(path, ["Compare them."], chat=True, images=two, max_tokens=N, ignore_eos=True, engine=eng)
    want["two"] = (doc["outputs"][0]["prompt_token_ids"], doc["outputs"][0]["token_ids"])
    doc = run_generation(path, ["Hello world"], chat=True, max_tokens=N, ignore_eos=True, engine=eng)
    want["text"] = (doc["outputs"][0]["prompt_token_ids"], doc["outputs"][0]["token_ids"])
    counter = _Counted(eng.model)
    cfg = ServiceConfig("vlm", limit_images_per_prompt=2, max_image_bytes=MAX_IMAGE_BYTES,
                        max_image_pixels=MAX_IMAGE_PIXELS)
    srv = start_server(eng, config=cfg)
    yield kind, srv, want, counter
    srv.stop()


def test_the_cli_adapt_run_image_gives_the_served_tokens(served, capsys):
    """The literal CLI (its own engine loaded from disk) on a non-square image equals the served answer."""
    import json

    from adapt.cli.main import main

    kind, srv, want, _ = served
    url = _url(_png(make_image(*SIZES[1], seed=1)))
    try:
        main(["run", str(_PATHS[kind]), "--image", url, "--prompt", "What is it?", "--chat", "-n", str(N),
              "--ignore-eos", "--format", "json"])
    except SystemExit as e:
        assert not e.code, capsys.readouterr().err
    cli = json.loads(capsys.readouterr().out)["outputs"][0]["token_ids"]
    r = _chat(_client(srv), _messages([url]))
    assert cli == r.choices[0].model_extra["token_ids"] == want[SIZES[1]][1]


def _client(srv):
    return openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0, timeout=60)


def _chat(c, messages, **kw):
    r = c.chat.completions.create(model="vlm", messages=messages, max_tokens=N, temperature=0,
                                  extra_body={"ignore_eos": True, "return_token_ids": True}, **kw)
    return r


def test_openai_client_image_url_equals_adapt_run_image(served):
    kind, srv, want, counter = served
    c = _client(srv)
    for i, (w, h) in enumerate(SIZES):
        r = _chat(c, _messages([_url(_png(make_image(w, h, seed=i)))]))
        ch = r.choices[0]
        assert ch.model_extra["prompt_token_ids"] == want[(w, h)][0], (w, h)
        assert ch.model_extra["token_ids"] == want[(w, h)][1], (w, h)
        assert r.usage.prompt_tokens == len(want[(w, h)][0])  # the image tokens count in the usage
    r = _chat(c, _messages([_url(_png(make_image(*SIZES[1], seed=1))), _url(_png(make_image(*SIZES[2], seed=2)))],
                           "Compare them."))
    assert r.choices[0].model_extra["token_ids"] == want["two"][1]
    # a JPEG and a streamed answer take the same path
    jpeg = io.BytesIO()
    make_image(40, 30, seed=9).save(jpeg, "JPEG")
    ids = []
    for chunk in c.chat.completions.create(model="vlm", messages=_messages([_url(jpeg.getvalue(), "image/jpeg")]),
                                           max_tokens=N, temperature=0, stream=True,
                                           extra_body={"ignore_eos": True, "return_token_ids": True}):
        ids += chunk.choices[0].model_extra.get("token_ids") or [] if chunk.choices else []
    assert len(ids) == N


def test_the_tower_runs_once_per_request_and_n_choices_share_it(served):
    kind, srv, want, counter = served
    before = counter.calls
    r = _chat(_client(srv), _messages([_url(_png(make_image(*SIZES[0], seed=0)))]), n=2)
    assert counter.calls == before + 1
    assert [ch.model_extra["token_ids"] for ch in r.choices] == [want[SIZES[0]][1]] * 2


def test_tokenize_counts_the_image_tokens(served):
    kind, srv, want, _ = served
    status, body = Client(srv.url).post("/tokenize", {"messages": _messages([_url(_png(make_image(*SIZES[3],
                                                                                                  seed=3)))])})
    assert status == 200 and body["tokens"] == want[SIZES[3]][0]


def test_concurrent_image_and_text_requests(served):
    kind, srv, want, _ = served

    async def main():
        c = openai.AsyncOpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0, timeout=120)

        async def one(key):
            msgs = ([{"role": "user", "content": "Hello world"}] if key == "text"
                    else _messages([_url(_png(make_image(*key, seed=SIZES.index(key))))]))
            r = await c.chat.completions.create(model="vlm", messages=msgs, max_tokens=N, temperature=0,
                                                extra_body={"ignore_eos": True, "return_token_ids": True})
            return r.choices[0].model_extra["token_ids"]

        keys = [k for s in SIZES for k in (s, "text")] * 2
        return keys, await asyncio.gather(*[one(k) for k in keys])

    keys, got = asyncio.run(main())
    assert got == [want[k][1] for k in keys]


def _bomb() -> bytes:
    from PIL import Image

    data = _png(Image.new("1", (9000, 8000)))
    assert len(data) < MAX_IMAGE_BYTES
    return data


def _zero_width_png() -> bytes:
    """A 1x1 PNG whose header says 0 pixels wide (CRC fixed, so only the size is wrong)."""
    import struct
    import zlib

    d = bytearray(_png(make_image(1, 1)))
    ihdr = bytearray(d[16:29])
    ihdr[0:4] = struct.pack(">I", 0)
    d[16:29], d[29:33] = ihdr, struct.pack(">I", zlib.crc32(b"IHDR" + bytes(ihdr)))
    return bytes(d)


def _bad_cases(kind):
    from PIL import Image

    noise = make_image(90, 90, seed=7)
    big = _png(noise)
    assert len(big) > MAX_IMAGE_BYTES and 90 * 90 <= MAX_IMAGE_PIXELS
    good = _png(make_image(30, 30))
    img = lambda u: _messages([u])  # noqa: E731
    return {
        "not_an_image": (img(_url(b"hello, not an image")), "invalid_image"),
        "corrupt": (img(_url(good[: len(good) // 2])), "invalid_image"),
        "unsupported_media_type": (img(_url(b"<svg xmlns='http://www.w3.org/2000/svg'/>", "image/svg+xml")),
                                   "invalid_image_format"),
        "bad_base64": (img("data:image/png;base64,@@@@"), "invalid_image_url"),
        "too_many_bytes": (img(_url(big)), "image_too_large"),
        "too_many_pixels": (img(_url(_png(Image.new("RGB", (120, 120), (9, 9, 9))))), "image_too_large"),
        "decompression_bomb": (img(_url(_bomb())), "image_too_large"),  # 72M pixels in 9 kB: refused from the header
        "zero_width": (img(_url(_zero_width_png())), "invalid_image"),
        "file_path": (img("/etc/hostname"), "invalid_image_url"),
        "remote_off": (img("http://127.0.0.1:9/a.png"), "remote_images_disabled"),
        "too_many_images": (_messages([_url(good)] * 3), "too_many_images"),
        "detail_high": ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": _url(good),
                                                                                          "detail": "high"}}]}],
                        "unsupported"),
        "system_image": ([{"role": "system", "content": [{"type": "image_url", "image_url": {"url": _url(good)}}]},
                          {"role": "user", "content": "hi"}], "invalid_value"),
    }


def _assert_openai_400(status, body, code):
    assert status == 400, body
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    e = body["error"]
    assert e["type"] == "invalid_request_error" and e["code"] == code, e
    assert e["param"].startswith("messages[") and "\n" not in e["message"], e


@pytest.mark.parametrize("case", list(_bad_cases("llava")))
def test_bad_images_are_400_and_the_server_keeps_serving(served, case):
    kind, srv, want, _ = served
    messages, code = _bad_cases(kind)[case]
    c = Client(srv.url)
    status, body = c.post("/v1/chat/completions", {"model": "vlm", "messages": messages, "max_tokens": N})
    _assert_openai_400(status, body, code)
    if case != "system_image":
        assert body["error"]["param"].startswith("messages[0].content["), body
    if case in ("too_many_pixels", "decompression_bomb"):
        assert "pixels is over the limit" in body["error"]["message"], body
    r = _chat(_client(srv), _messages([_url(_png(make_image(*SIZES[0], seed=0)))]))
    assert r.choices[0].model_extra["token_ids"] == want[SIZES[0]][1]


@pytest.mark.parametrize("part,param,code", [
    ({"type": "image_url", "image_url": {"uri": "x"}}, "messages[0].content[0].image_url.url", "missing_field"),
    ({"type": "image_url", "image_url": {"url": 5}}, "messages[0].content[0].image_url.url", "invalid_type"),
    ({"type": "image_url"}, "messages[0].content[0].image_url", "missing_field"),
    ({"type": "image", "image": "x"}, "messages[0].content[0]", "invalid_type"),
    ({"type": "image_url", "image_url": {"url": "x", "detail": "max"}}, "messages[0].content[0].image_url.detail",
     "invalid_type"),
])
def test_malformed_image_parts_name_the_field(served, part, param, code):
    kind, srv, want, _ = served
    status, body = Client(srv.url).post("/v1/chat/completions", {"messages": [{"role": "user", "content": [part]}]})
    assert status == 400 and body["error"]["param"] == param and body["error"]["code"] == code, body


def test_the_openai_client_raises_bad_request_for_a_bad_image(served):
    kind, srv, want, _ = served
    with pytest.raises(openai.BadRequestError) as e:
        _chat(_client(srv), _messages([_url(b"garbage")]))
    assert e.value.status_code == 400 and e.value.code == "invalid_image"
    assert "messages[0].content[0]" in e.value.message


def test_image_tokens_count_against_the_prefill_budget():
    """Image sequences are prefilled whole, never chunked, and their placeholder tokens fill the step's
    budget (max_num_batched_tokens) like any prompt token; a lone one larger than the budget still runs."""
    from adapt.runtime.cache.block_manager import BlockManager
    from adapt.runtime.sampling import SamplingParams
    from adapt.runtime.scheduler import Scheduler

    sched = Scheduler(BlockManager(32, 4), max_num_seqs=4, max_num_batched_tokens=12, watermark=0.0,
                      chunked_prefill=True)
    p = SamplingParams(max_tokens=2)
    a = sched.add([1] + [9] * 10, p, mm=object())  # 11 tokens, 10 of them image tokens
    b = sched.add([1] + [9] * 10, p, mm=object())
    t = sched.add([1, 2, 3, 4, 5, 6], p)
    batch = sched.schedule()
    assert batch.kind == "prefill" and batch.seqs == [a] and batch.num_tokens == 11  # b's 11 would pass 12
    sched.postprocess([a], [7])
    assert sched.schedule().kind == "decode"  # a's decode step alternates with the prefills
    sched.postprocess([a], [7])
    batch = sched.schedule()
    assert batch.kind == "prefill" and batch.seqs == [b, t] and batch.num_tokens == 12  # t chunked into the rest
    assert t.num_computed == 1 and b.num_computed == 11
    sched = Scheduler(BlockManager(32, 4), max_num_batched_tokens=12, watermark=0.0, chunked_prefill=True)
    big = sched.add([1] + [9] * 19, p, mm=object())
    batch = sched.schedule()
    assert batch.seqs == [big] and batch.num_tokens == 20


# -- remote images (flag on), a text-only model ---------------------------------------------------------


class _Handler(http.server.BaseHTTPRequestHandler):
    png = b""

    def log_message(self, *a):
        pass

    def do_GET(self):  # noqa: N802
        p = self.path
        if p == "/ok.png":
            return self._send(200, self.png, "image/png")
        if p == "/redirect":
            self.send_response(302)
            self.send_header("Location", "/ok.png")
            self.end_headers()
            return None
        if p == "/to-file":
            self.send_response(302)
            self.send_header("Location", "file:///etc/hostname")
            self.end_headers()
            return None
        if p == "/svg":
            return self._send(200, b"<svg/>", "image/svg+xml")
        if p == "/big":
            return self._send(200, b"\0" * (MAX_IMAGE_BYTES + 10), "image/png")
        if p == "/big-chunked":  # no Content-Length: the limit holds while reading
            self.send_response(200)
            self.send_header("Content-Type", "image/png")
            self.end_headers()
            for _ in range(8):
                self.wfile.write(b"\0" * (4 << 10))
            return None
        if p == "/slow":  # headers only after the time limit
            time.sleep(2.5)
            return self._send(200, self.png, "image/png")
        if p == "/drip":  # a byte at a time, each in time, the whole past the limit
            self.send_response(200)
            self.send_header("Content-Length", str(len(self.png)))
            self.end_headers()
            try:
                for i in range(10):
                    self.wfile.write(self.png[i:i + 1])
                    self.wfile.flush()
                    time.sleep(0.3)
            except OSError:
                pass
            return None
        return self._send(404, b"no", "text/plain")

    def _send(self, status, body, ctype):
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        try:
            self.wfile.write(body)
        except OSError:
            pass


@pytest.fixture(scope="module")
def remote(tmp_path_factory):
    """(server with --allow-remote-images and a 1 s fetch limit, image HTTP base URL, want tokens, the PNG)."""
    from adapt.runtime.run import run_generation
    from adapt.runtime.server import ServiceConfig, start_server

    _, path = save_vlm("llava", tmp_path_factory.mktemp("remote") / "model")
    eng = _engine(path)
    png = _png(make_image(45, 20, seed=5))
    doc = run_generation(path, ["What is it?"], chat=True, images=[_url(png)], max_tokens=N, ignore_eos=True,
                         engine=eng)
    _Handler.png = png
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    srv = start_server(eng, config=ServiceConfig("vlm", allow_remote_images=True, image_fetch_timeout_s=1.0,
                                                 max_image_bytes=MAX_IMAGE_BYTES))
    yield srv, f"http://127.0.0.1:{httpd.server_address[1]}", doc["outputs"][0]["token_ids"]
    srv.stop()
    httpd.shutdown()


def test_remote_image_equals_the_data_url(remote):
    srv, base, want = remote
    for p in ("/ok.png", "/redirect"):
        assert _chat(_client(srv), _messages([base + p])).choices[0].model_extra["token_ids"] == want


@pytest.mark.parametrize("path,code,words", [
    ("/missing.png", "image_fetch_failed", "HTTP 404"),
    ("/slow", "image_fetch_failed", "within 1 s"),
    ("/drip", "image_fetch_failed", "within 1 s"),
    ("/to-file", "image_fetch_failed", "not an http(s) URL"),
    ("/svg", "invalid_image_format", "unsupported media type"),
    ("/big", "image_too_large", "more than"),
    ("/big-chunked", "image_too_large", "more than"),
])
def test_remote_fetch_failures_are_400(remote, path, code, words):
    srv, base, want = remote
    t0 = time.monotonic()
    status, body = Client(srv.url).post("/v1/chat/completions", {"messages": _messages([base + path]),
                                                                 "max_tokens": N})
    _assert_openai_400(status, body, code)
    assert words in body["error"]["message"]
    assert time.monotonic() - t0 < 2.5  # the limit is over the whole fetch
    assert _chat(_client(srv), _messages([base + "/ok.png"])).choices[0].model_extra["token_ids"] == want


def test_remote_refused_port_is_400(remote):
    srv, _, _ = remote
    status, body = Client(srv.url).post("/v1/chat/completions", {"messages": _messages(["http://127.0.0.1:9/a.png"]),
                                                                 "max_tokens": N})
    _assert_openai_400(status, body, "image_fetch_failed")


def test_a_text_only_model_refuses_images(tiny_llama):
    from adapt.runtime.server import ServiceConfig, start_server

    from tests.runtime.server.conftest import load_engine

    srv = start_server(load_engine(tiny_llama), config=ServiceConfig("tiny"))
    try:
        c = Client(srv.url)
        status, body = c.post("/v1/chat/completions", {"messages": _messages([_url(_png(make_image(30, 30)))])})
        _assert_openai_400(status, body, "images_not_supported")
        assert "no vision tower" in body["error"]["message"]
        status, body = c.post("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                                       "max_tokens": 2})
        assert status == 200, body
    finally:
        srv.stop()
