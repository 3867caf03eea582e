"""`adapt validate --endpoint URL`: a black-box server against the reference.

adapt serve of the same tiny checkpoint passes; a server of the copy whose layer-1 o_proj is scaled by 1.05
fails; an independent transformers-based server (tests/fixtures/openai_server.py) passes too, with token ids
mapped through the reference tokenizer; a server that computes differently inside a batch fails
batch_invariance; a server that is down exits 2, one that answers 500, malformed JSON or stalls mid-stream
fails items with the reason."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import yaml
from safetensors.torch import load_file, save_file

from adapt.validate.checklist import default_checklist_path
from tests.fixtures.openai_server import FixtureServer, _Model
from tests.validate.test_validate_cli import run_cli

ENDPOINT_ITEMS = ["greedy_token_match", "logprob_closeness", "long_context_ladder", "service_api",
                  "chat_template_parity", "batch_invariance", "serving_load"]


def endpoint_models(root: Path, clean: Path) -> dict:
    """The clean checkpoint, its copy with layer-1 o_proj scaled by 1.05, and the shipped checklist with the
    ladder at lengths a CPU test affords."""
    oproj = root / "oproj"
    shutil.copytree(clean, oproj)
    t = load_file(oproj / "model.safetensors")
    k = "model.layers.1.self_attn.o_proj.weight"
    t[k] = t[k] * 1.05
    save_file(t, oproj / "model.safetensors", metadata={"format": "pt"})
    doc = yaml.safe_load(default_checklist_path().read_text())
    for s in doc["sections"]:
        for it in s["items"]:
            if it["id"] == "long_context_ladder":
                it["params"]["lengths"] = [128, 512]
    cl = root / "checklist.yaml"
    cl.write_text(yaml.safe_dump(doc))
    return {"clean": clean, "oproj": oproj, "checklist": cl}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    from adapt.runtime.init_model import init_model

    root = tmp_path_factory.mktemp("ep")
    return endpoint_models(root, Path(init_model("tiny-llama", root / "clean")))


def _serve(path: Path, max_model_len: int = 2048):
    from adapt.runtime.engine import Engine
    from adapt.runtime.server import ServiceConfig, start_server

    eng = Engine.from_pretrained(path, kv_cache_memory=64 << 20, max_model_len=max_model_len)
    return start_server(eng, config=ServiceConfig(model_name=path.name))


def _validate(url: str, models, out: Path, *extra: str) -> tuple[int, dict]:
    rc = run_cli("validate", "--endpoint", url, "--reference", models["clean"], "--out", out,
                 "--checklist", models["checklist"], *extra)
    return rc, json.loads((out / "report.json").read_text()) if (out / "report.json").is_file() else {}


def _status(r: dict) -> dict[str, str]:
    return {it["id"]: it["status"] for it in r["items"]}


def _only(*ids: str) -> list[str]:
    return [a for i in ids for a in ("--only", i)]


def test_adapt_serve_passes_and_the_o_proj_copy_fails(models, tmp_path):
    srv = _serve(models["clean"])
    try:
        rc, r = _validate(srv.url, models, tmp_path / "ok")
    finally:
        srv.stop()
    st = _status(r)
    assert rc == 0, [(it["id"], it["message"]) for it in r["items"] if it["status"] in ("fail", "error")]
    assert all(st[i] == "pass" for i in ENDPOINT_ITEMS), st
    assert st["hidden_states"] == "skip" and st["prefill_logits"] == "skip"
    ep = r["environment"]["endpoint"]
    assert ep["served_model_name"] == "clean" and ep["v1_models"]["data"][0]["id"] == "clean"
    assert ep["token_ids"] == ["server (return_token_ids)"] and "version" in ep
    ladder = next(it for it in r["items"] if it["id"] == "long_context_ladder")["metrics"]
    assert [x["length"] for x in ladder["rungs"]] == [128, 512] and ladder["logprob_max_abs"] < 2e-4
    assert all(x["latency_s"]["n"] == 3 and 0 < x["latency_s"]["p50"] <= x["latency_s"]["p99"] for x in ladder["rungs"])
    load = next(it for it in r["items"] if it["id"] == "serving_load")["metrics"]
    assert st["serving_load"] == "pass" and [x["concurrency"] for x in load["levels"]] == [1, 2, 4, 8], load
    assert all(x["completed"] == 8 and x["ttft_s"]["p50"] <= x["ttft_s"]["p99"] for x in load["levels"])
    html = (tmp_path / "ok" / "report.html").read_text()
    for fig in ("long_context_ladder-latency", "long_context_ladder-error", "serving_load-ttft", "serving_load-tps"):
        assert f'<svg id="fig-{fig}"' in html, fig
    srv = _serve(models["oproj"])
    try:
        rc, r = _validate(srv.url, models, tmp_path / "bad", *_only("text_inference", "long_context"))
    finally:
        srv.stop()
    st = _status(r)
    assert rc == 1 and st["greedy_token_match"] == "fail" and st["long_context_ladder"] == "fail", st
    assert r["first_divergence"] is None  # a black box names no layer


@pytest.fixture(scope="module")
def hf_model(models):
    return _Model(models["clean"])


def test_independent_transformers_server_passes(models, hf_model, tmp_path):
    with FixtureServer(models["clean"], model=hf_model) as url:
        rc, r = _validate(url, models, tmp_path / "fx")
    st = _status(r)
    assert rc == 0, [(it["id"], it["message"]) for it in r["items"] if it["status"] in ("fail", "error")]
    assert all(st[i] == "pass" for i in ENDPOINT_ITEMS), st
    ep = r["environment"]["endpoint"]
    assert ep["token_ids"] == ["token_id:N keys"] and "return_token_ids" in ep["extensions_refused"]
    chat = next(it for it in r["items"] if it["id"] == "chat_template_parity")
    assert "usage.prompt_tokens" in chat["message"]


def test_batch_invariance_catches_a_server_that_differs_inside_a_batch(models, hf_model, tmp_path):
    with FixtureServer(models["clean"], model=hf_model, perturb_batch=True) as url:
        rc, r = _validate(url, models, tmp_path / "pb", *_only("greedy_token_match", "batch_invariance"))
    st = _status(r)
    assert rc == 1 and st == {"greedy_token_match": "pass", "batch_invariance": "fail"}, r["items"]
    bi = next(it for it in r["items"] if it["id"] == "batch_invariance")
    assert bi["metrics"]["token_match"] < 1.0 and "inside the batch" in bi["message"]


def test_a_server_that_is_down_exits_2(models, tmp_path, capsys):
    import socket

    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()  # nothing listens there now
    rc, r = _validate(f"http://127.0.0.1:{port}", models, tmp_path / "down", *_only("greedy_token_match"))
    err = capsys.readouterr().err
    assert rc == 2 and not r and "nothing could be reached" in err and "Traceback" not in err


@pytest.mark.parametrize("mode,why", [("error500", "HTTP 500"), ("malformed", "not JSON"), ("stall", "stalled")])
def test_faulty_servers_fail_items_with_the_reason(models, hf_model, tmp_path, capsys, mode, why):
    with FixtureServer(models["clean"], model=hf_model, mode=mode) as url:
        rc, r = _validate(url, models, tmp_path / mode, "--timeout", "1", *_only("greedy_token_match", "service_api"))
    assert rc == 1 and "Traceback" not in capsys.readouterr().err
    st = _status(r)
    failed = {it["id"]: it["message"] for it in r["items"] if it["status"] == "fail"}
    assert "service_api" in failed and why in failed["service_api"], r["items"]
    if mode != "stall":  # a stall hits only the stream; plain completions still answer
        assert why in failed["greedy_token_match"]
    else:
        assert st["greedy_token_match"] == "pass"
