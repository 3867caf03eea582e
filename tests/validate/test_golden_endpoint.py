"""`adapt validate dump --endpoint URL MODEL --out GOLDEN`: a golden recorded from a running server.

Recorded from adapt serve of the tiny checkpoint, it is read by `adapt validate MODEL --reference GOLDEN` like a
transformers golden: the same checkpoint passes, the copy whose layer-1 o_proj is scaled by 1.05 fails. Recorded
from the independent transformers fixture server that sends no token ids and knows neither prompt_logprobs nor
echo, the ids come from the reference tokenizer and the per-position items skip with the reason. A server that
is down, answers 500 or malformed JSON is one line, exit 2, and the golden directory is left as it was."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from adapt.runtime.tokenizer import Tokenizer
from adapt.validate.checks.endpoint import CHAT
from adapt.validate.golden import GoldenReference
from adapt.validate.reference import HFReference
from tests.fixtures.openai_server import FixtureServer
from tests.validate.test_endpoint import _serve, _status, hf_model, models  # noqa: F401  (module fixtures)
from tests.validate.test_validate_cli import run_cli

LONG = "128,512"  # the rungs of the test checklist (tests/validate/test_endpoint.py)


@pytest.fixture(scope="module")
def served_golden(models, tmp_path_factory):  # noqa: F811
    out = tmp_path_factory.mktemp("gep") / "golden"
    srv = _serve(models["clean"])
    try:
        rc = run_cli("validate", "dump", "--endpoint", srv.url, models["clean"], "--out", out, "--long-lengths", LONG)
    finally:
        srv.stop()
    assert rc == 0
    return out


def _validate(target, golden, models, out, *extra) -> tuple[int, dict]:  # noqa: F811
    rc = run_cli("validate", target, "--reference", golden, "--out", out, "--checklist", models["checklist"], *extra)
    return rc, json.loads((out / "report.json").read_text())


def test_golden_from_adapt_serve_matches_the_transformers_reference(served_golden, models):  # noqa: F811
    doc = json.loads((served_golden / "golden.json").read_text())
    assert doc["format"] == "adapt-golden" and doc["source"] == "endpoint"
    ep = doc["endpoint"]
    assert ep["v1_models"]["data"][0]["id"] == "clean" and ep["version"]["version"]
    assert ep["token_ids"] == ["server (return_token_ids)"] and ep["prompt_logprobs"] == "prompt_logprobs (token ids)"
    assert doc["long_context"]["lengths"] == [128, 512]
    assert doc["chat"]["source"] == "server (prompt_token_ids)" and (served_golden / "tokenizer.json").is_file()
    assert doc["chat"]["prompt_token_ids"] == Tokenizer.from_dir(models["clean"]).encode_chat(CHAT)
    g, h = GoldenReference(served_golden), HFReference(models["clean"])
    assert g.prompts == h.prompts and not g.has_logits and not g.has_layers
    for i in range(len(g.prompts)):
        assert g.generation(i, 16, 5).tokens == h.generation(i, 16, 5).tokens
        rows, lp = g.prompt_top(i), torch.log_softmax(h.logits(i).double(), -1)
        assert len(rows) == len(g.prompts[i]) - 1 and all(len(r) >= 20 for r in rows)
        assert max(abs(float(lp[t, k]) - v) for t, r in enumerate(rows) for k, v in r.items()) < 2e-4
    top = g.long_logprobs(512)
    ref = torch.log_softmax(h.long_logits(512)[-1].double(), -1)
    assert max(top, key=top.get) == int(ref.argmax()) and max(abs(float(ref[k]) - v) for k, v in top.items()) < 2e-4


def test_validate_against_the_endpoint_golden_passes_and_the_o_proj_copy_fails(served_golden, models, tmp_path):  # noqa: F811
    rc, r = _validate(models["clean"], served_golden, models, tmp_path / "ok",
                      "--only", "text_inference", "--only", "long_context", "--only", "layer_alignment")
    st = _status(r)
    assert rc == 0, r["items"]
    assert {k: st[k] for k in ("greedy_token_match", "logprob_closeness", "top1_agreement", "long_context_ladder")} \
        == dict.fromkeys(("greedy_token_match", "logprob_closeness", "top1_agreement", "long_context_ladder"), "pass")
    msgs = {it["id"]: it["message"] for it in r["items"]}
    assert st["prefill_logits"] == st["next_token_kl"] == st["hidden_states"] == "skip"
    assert "top-N logprobs" in msgs["prefill_logits"] and "recorded from an endpoint" in msgs["hidden_states"]
    assert "cosine, max_abs not measurable" in msgs["long_context_ladder"]
    assert r["environment"]["reference_endpoint"]["served_model_name"] == "clean"
    rc, r = _validate(models["oproj"], served_golden, models, tmp_path / "bad",
                      "--only", "text_inference", "--only", "long_context")
    st = _status(r)
    assert rc == 1 and st["greedy_token_match"] == "fail" and st["long_context_ladder"] == "fail", st
    assert r["first_divergence"] is None  # no layer outputs in the golden: no layer is named


def test_validate_endpoint_against_the_endpoint_golden(served_golden, models, hf_model, tmp_path):  # noqa: F811
    """The vendor's server (here the transformers fixture) judged against the golden of the reference server: the
    golden's tokenizer copy maps nothing here (token_id:N keys) but renders the chat template for the fixture,
    which sends no prompt ids."""
    with FixtureServer(models["clean"], model=hf_model) as url:
        rc = run_cli("validate", "--endpoint", url, "--reference", served_golden, "--out", tmp_path / "r",
                     "--checklist", models["checklist"], "--only", "text_inference", "--only", "long_context",
                     "--only", "chat_template_parity")
    r = json.loads((tmp_path / "r" / "report.json").read_text())
    st = _status(r)
    assert rc == 0 and st["greedy_token_match"] == st["long_context_ladder"] == st["chat_template_parity"] == "pass", \
        r["items"]


def test_chat_parity_holds_a_server_to_the_reference_servers_rendering(served_golden, models, tmp_path):  # noqa: F811
    """The chat item compares with the golden's recorded rendering, not a re-rendering: a golden whose recorded
    chat prompt lost its last id fails a server that renders the template right."""
    bad = tmp_path / "golden"
    shutil.copytree(served_golden, bad)
    doc = json.loads((bad / "golden.json").read_text())
    doc["chat"]["prompt_token_ids"] = doc["chat"]["prompt_token_ids"][:-1]
    (bad / "golden.json").write_text(json.dumps(doc))
    srv = _serve(models["clean"])
    try:
        rc = run_cli("validate", "--endpoint", srv.url, "--reference", bad, "--out", tmp_path / "r",
                     "--checklist", models["checklist"], "--only", "chat_template_parity")
    finally:
        srv.stop()
    item = json.loads((tmp_path / "r" / "report.json").read_text())["items"][0]
    assert rc == 1 and item["status"] == "fail" and item["metrics"]["prompt_match"] == 0.0, item


def test_golden_from_a_server_that_sends_no_token_ids(models, hf_model, tmp_path, capsys):  # noqa: F811
    """Token texts mapped through the reference tokenizer: the random tiny model's 16 tokens after its seeded 12-token
    prompt are all mappable; after the 8-token prompt it emits lone UTF-8 bytes that decode to U+FFFD alike, so
    the ids cannot be told apart from the text and the dump refuses rather than guess."""
    with FixtureServer(models["clean"], model=hf_model, token_id_keys=False) as url:
        rc = run_cli("validate", "dump", "--endpoint", url, models["clean"], "--out", tmp_path / "g",
                     "--long-lengths", "128", "--top-n", "5", "--prompt-lengths", "12")
        assert rc == 0
        rc = run_cli("validate", "dump", "--endpoint", url, models["clean"], "--out", tmp_path / "g8",
                     "--long-lengths", "none", "--prompt-lengths", "8")
    assert rc == 2 and "token identity cannot be established" in capsys.readouterr().err
    assert not (tmp_path / "g8").exists()
    doc = json.loads((tmp_path / "g" / "golden.json").read_text())
    ep = doc["endpoint"]
    assert ep["token_ids"] == ["reference tokenizer"] and ep["version"] is None
    assert ep["prompt_logprobs"] == "none" and {"prompt_logprobs", "echo"} <= set(ep["extensions_refused"])
    g, h = GoldenReference(tmp_path / "g"), HFReference(models["clean"], prompt_lengths=(12,))
    assert g.prompts == h.prompts and g.generation(0, 16, 5).tokens == h.generation(0, 16, 5).tokens
    rc, r = _validate(models["clean"], tmp_path / "g", models, tmp_path / "r", "--only", "text_inference")
    st = _status(r)
    assert rc == 0 and st["greedy_token_match"] == "pass" and st["top1_agreement"] == "skip", r["items"]


@pytest.mark.parametrize("mode,why", [("down", "nothing could be reached"), ("error500", "HTTP 500"),
                                      ("malformed", "not JSON")])
def test_a_faulty_server_is_one_line_exit_2_and_nothing_written(models, hf_model, tmp_path, capsys, mode, why):  # noqa: F811
    out = tmp_path / "golden"
    out.mkdir()
    (out / "golden.json").write_text("{}")  # an earlier golden stays as it was
    if mode == "down":
        import socket

        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{s.getsockname()[1]}"
        s.close()
        rc = run_cli("validate", "dump", "--endpoint", url, models["clean"], "--out", out)
    else:
        with FixtureServer(models["clean"], model=hf_model, mode=mode) as url:
            rc = run_cli("validate", "dump", "--endpoint", url, models["clean"], "--out", out)
    err = capsys.readouterr().err
    assert rc == 2 and why in err and "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["golden"]  # no temporary directory left beside it
    assert [p.name for p in out.iterdir()] == ["golden.json"] and (out / "golden.json").read_text() == "{}"


def test_flags_that_run_the_reference_here_are_refused_with_endpoint(models, tmp_path, capsys):  # noqa: F811
    rc = run_cli("validate", "dump", "--endpoint", "http://127.0.0.1:9", models["clean"], "--out", tmp_path / "g",
                 "--stream")
    assert rc == 2 and "--endpoint records it from a server" in capsys.readouterr().err
    assert not (tmp_path / "g").exists()


def test_prompt_logprobs_through_echo_where_prompt_logprobs_is_refused(models):  # noqa: F811
    """OpenAI's legacy way (echo + logprobs), keyed by token text: rows equal the reference where the texts map to
    single ids; a row holding a text several ids share stays empty instead of naming a wrong top-1."""
    from adapt.validate.endpoint import EndpointRunner, TokenMap
    from adapt.validate.golden_endpoint import _Recorder
    from adapt.validate.openai_client import Client

    h = HFReference(models["clean"])
    srv = _serve(models["clean"])
    try:
        client = Client(srv.url, dropped={"prompt_logprobs"})
        tok = Tokenizer.from_dir(models["clean"])
        rec = _Recorder(EndpointRunner(client, "clean", h.num_layers, h.vocab_size, TokenMap(tok, h.vocab_size)), 5)
        rows = rec.prompt_top(h.prompts[3])
    finally:
        srv.stop()
    assert rec.prompt_source == "echo (texts mapped through the reference tokenizer)"
    lp = torch.log_softmax(h.logits(3).double(), -1)
    full = [t for t, r in enumerate(rows) if r]
    assert len(rows) == len(h.prompts[3]) - 1 and len(full) >= len(rows) // 2, rows
    for t in full:
        assert max(rows[t], key=rows[t].get) == int(lp[t].argmax())
        assert max(abs(float(lp[t, k]) - v) for k, v in rows[t].items()) < 2e-4


def test_api_key_and_served_model_name(models, tmp_path, capsys):  # noqa: F811
    from adapt.runtime.engine import Engine
    from adapt.runtime.server import ServiceConfig, start_server

    eng = Engine.from_pretrained(models["clean"], kv_cache_memory=64 << 20, max_model_len=2048)
    srv = start_server(eng, config=ServiceConfig(model_name="served", api_key="k3y"))
    try:
        base = ("validate", "dump", "--endpoint", srv.url, models["clean"], "--long-lengths", "none",
                "--max-new-tokens", "4", "--prompt-lengths", "8")
        assert run_cli(*base, "--out", tmp_path / "a") == 2
        assert "wrong --api-key" in capsys.readouterr().err and not (tmp_path / "a").exists()
        assert run_cli(*base, "--out", tmp_path / "b", "--api-key", "k3y", "--served-model-name", "other") == 2
        assert "the endpoint serves served" in capsys.readouterr().err
        assert run_cli(*base, "--out", tmp_path / "c", "--api-key", "k3y", "--served-model-name", "served") == 0
    finally:
        srv.stop()
    assert json.loads((tmp_path / "c" / "golden.json").read_text())["endpoint"]["served_model_name"] == "served"


def test_chat_prompt_ids_where_vllm_puts_them():
    """vLLM sends a chat answer's prompt_token_ids at the top level of the response, adapt serve in the choice."""
    from types import SimpleNamespace

    from adapt.validate.golden_endpoint import _Recorder

    def runner(doc):
        client = SimpleNamespace(post_negotiated=lambda *a, **k: doc)
        return SimpleNamespace(client=client, _body=lambda **kw: kw)

    msg = {"index": 0, "message": {"role": "assistant", "content": "x"}}
    top = _Recorder(runner({"choices": [msg], "prompt_token_ids": [5, 6, 7]}), 5).chat_prompt_ids(CHAT)
    inner = _Recorder(runner({"choices": [{**msg, "prompt_token_ids": [5, 6]}]}), 5).chat_prompt_ids(CHAT)
    none = _Recorder(runner({"choices": [msg]}), 5).chat_prompt_ids(CHAT)
    assert top == ([5, 6, 7], "server (prompt_token_ids)") and inner == ([5, 6], "server (prompt_token_ids)")
    assert none == (None, "the server sends no prompt_token_ids")
