"""`adapt validate --endpoint` against llama.cpp (slow; where llama-cpp-python and gguf install).

The built-in tiny Llama (its llama3 RoPE scaling dropped: a plain Llama both engines read the same way) is
written as a float32 GGUF and run by llama.cpp's engine (llama-cpp-python's ``Llama``) behind the test's
OpenAI front (tests/fixtures/openai_server.py). llama-cpp-python's own server takes only text prompts, and
the checklist's prompts are token ids. The GGUF of the copy whose layer-1 o_proj is scaled by 1.05 fails."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow
pytest.importorskip("gguf", reason="gguf is not installed (pip install gguf)")
pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed (pip install llama-cpp-python: it "
                    "compiles llama.cpp from source)")

from tests.fixtures.gguf_llama import LlamaCppModel, write_llama_gguf  # noqa: E402
from tests.fixtures.openai_server import FixtureServer  # noqa: E402
from tests.validate.test_endpoint import _status, _validate, endpoint_models  # noqa: E402

ITEMS = ["greedy_token_match", "logprob_closeness", "long_context_ladder", "service_api", "chat_template_parity",
         "batch_invariance", "serving_load"]


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    from adapt.runtime.init_model import init_model

    root = tmp_path_factory.mktemp("lcpp")
    clean = Path(init_model("tiny-llama", root / "clean"))
    cfg = json.loads((clean / "config.json").read_text())
    cfg.pop("rope_scaling", None)
    cfg["max_position_embeddings"] = 1024
    (clean / "config.json").write_text(json.dumps(cfg, indent=2))
    m = endpoint_models(root, clean)
    return m | {"gguf": write_llama_gguf(clean, root / "clean.gguf"),
                "gguf_bad": write_llama_gguf(m["oproj"], root / "o.gguf")}


def test_llama_cpp_server_passes_and_its_o_proj_copy_fails(llama, tmp_path):
    m = LlamaCppModel(llama["gguf"], llama["clean"], n_ctx=1024)
    with FixtureServer(llama["clean"], model=m, max_model_len=1024) as url:
        rc, r = _validate(url, llama, tmp_path / "ok")
    st = _status(r)
    assert rc == 0, [(it["id"], it["message"]) for it in r["items"] if it["status"] in ("fail", "error")]
    assert all(st[i] == "pass" for i in ITEMS), st
    assert st["greedy_token_match"] == "pass" and st["logprob_closeness"] == "pass", st
    close = next(it for it in r["items"] if it["id"] == "logprob_closeness")
    print("llama.cpp vs transformers:", close["message"])
    bad = LlamaCppModel(llama["gguf_bad"], llama["clean"], n_ctx=1024)
    with FixtureServer(llama["clean"], model=bad, max_model_len=1024) as url:
        rc, r = _validate(url, llama, tmp_path / "bad", "--only", "text_inference")
    assert rc == 1 and _status(r)["greedy_token_match"] == "fail", _status(r)
