"""validate --endpoint's image_path item: the sweep's images as image_url data URLs to a served tiny llava-1.5 /
Qwen2.5-VL against transformers with the same images. adapt serve of the checkpoint passes (served prompts equal
the reference's, placeholder counts included, and so do the greedy tokens and their logprobs); a server of the copy
whose projector's second linear is scaled by 1.05 fails the item on the logprobs and the run exits 1."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("PIL")

from tests.runtime.vision.vlm import save_vlm  # noqa: E402
from tests.validate.test_image_path import PROJECTOR, _scaled  # noqa: E402
from tests.validate.test_validate_cli import run_cli  # noqa: E402


@pytest.fixture(scope="module", params=("llava", "qwen2_5_vl"))
def vlm(request, tmp_path_factory):
    d = tmp_path_factory.mktemp("ep-img-" + request.param)
    _, path = save_vlm(request.param, d / "model")
    return request.param, path, d


def _served_validate(model, reference, out):
    from adapt.runtime.engine import Engine
    from adapt.runtime.server import ServiceConfig, start_server

    srv = start_server(Engine.from_pretrained(model, kv_cache_memory="16MiB", max_model_len=512),
                       config=ServiceConfig("vlm"))
    try:
        rc = run_cli("validate", "--endpoint", srv.url, "--reference", reference, "--out", out, "--only",
                     "image_path")
    finally:
        srv.stop()
    doc = json.loads((out / "report.json").read_text())
    return rc, next(it for it in doc["items"] if it["id"] == "image_path")


def test_adapt_serve_passes_the_image_item_and_a_scaled_projector_fails(vlm):
    kind, path, d = vlm
    rc, it = _served_validate(path, path, d / "ok")
    assert rc == 0 and it["status"] == "pass", it["message"]
    m = it["metrics"]
    assert m["images"] == 5 and m["prompt_match"] == 1.0 and m["token_match"] == 1.0
    assert all(r["reference_tokens"] > 0 for r in m["per_image"])
    assert m["max_abs"] < 1e-4  # the chosen tokens' logprobs, float32 on both sides
    assert "cosine not measurable" in it["message"]  # the API returns no logits
    bad = _scaled(path, d / "bad", PROJECTOR[kind])
    rc, it = _served_validate(bad, path, d / "bad-out")
    assert rc == 1 and it["status"] == "fail" and "max_abs" in it["message"], it["message"]
    assert it["metrics"]["max_abs"] > 2e-4  # the float32 bound is 1e-4
    assert it["metrics"]["prompt_match"] == 1.0  # the preprocessing is the same: only the answers differ
