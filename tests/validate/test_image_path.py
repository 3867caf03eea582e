"""The checklist's image_path item on tiny llava-1.5 and Qwen2.5-VL: passes against the model itself; with the
projector's second linear scaled by 1.05 (or one tower block's MLP) it fails, the run exits 1 and
first_divergence names the projector (the tower block)."""

from __future__ import annotations

import json
import shutil

import pytest

pytest.importorskip("PIL")

from tests.runtime.vision.vlm import save_vlm  # noqa: E402

PROJECTOR = {"llava": "multi_modal_projector.linear_2.weight", "qwen2_5_vl": "visual.merger.mlp.2.weight"}
BLOCK0 = {"llava": "vision_tower.encoder.layers.0.mlp.fc2.weight", "qwen2_5_vl": "visual.blocks.0.mlp.down_proj.weight"}


def _validate(target, reference, out, capsys, only=("image_path",)):
    from adapt.cli.main import main

    args = ["validate", str(target), "--reference", str(reference), "--out", str(out), "--format", "json"]
    for o in only:
        args += ["--only", o]
    code = 0
    try:
        main(args)
    except SystemExit as e:
        code = e.code or 0
    doc = json.loads(capsys.readouterr().out)
    return code, doc, {it["id"]: it for it in doc["items"]}


def _scaled(src, dst, name, factor=1.05):
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    sd = load_file(str(dst / "model.safetensors"))
    sd[name] = sd[name] * factor
    save_file(sd, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


@pytest.fixture(scope="module", params=("llava", "qwen2_5_vl"))
def vlm(request, tmp_path_factory):
    d = tmp_path_factory.mktemp("val-" + request.param)
    _, path = save_vlm(request.param, d / "model")
    return request.param, path, d


def test_image_path_passes_against_itself(vlm, capsys):
    kind, path, d = vlm
    code, doc, items = _validate(path, path, d / "ok", capsys)
    it = items["image_path"]
    assert code == 0 and it["status"] == "pass", it["message"]
    m = it["metrics"]
    assert m["images"] == 5 and m["pixel_max_abs"] == 0.0 and m["max_abs"] < 1e-4
    sizes = {r["image"]: r["size"] for r in m["per_image"]}
    assert sizes["wide"][0] > 2 * sizes["wide"][1] and sizes["tall"][1] > 2 * sizes["tall"][0]
    assert all(r["tokens_match"] for r in m["per_image"])
    assert all(t["thumbnail"].startswith("data:image/png;base64,") for t in m["thumbnails"])
    html = (d / "ok" / "report.html").read_text()
    assert html.count('<img src="data:image/png;base64,') == 5
    assert doc["first_divergence"] is None


def test_a_scaled_projector_fails_and_is_named(vlm, capsys):
    kind, path, d = vlm
    bad = _scaled(path, d / "bad-projector", PROJECTOR[kind])
    code, doc, items = _validate(bad, path, d / "out-projector", capsys)
    assert code == 1 and items["image_path"]["status"] == "fail"
    assert doc["first_divergence"]["module"] == "projector"


def test_a_scaled_tower_block_is_named(vlm, capsys):
    kind, path, d = vlm
    bad = _scaled(path, d / "bad-block", BLOCK0[kind])
    code, doc, items = _validate(bad, path, d / "out-block", capsys)
    assert code == 1 and items["image_path"]["status"] == "fail"
    fd = doc["first_divergence"]
    assert fd["module"] == "vision_tower" and fd["layer"] == 0
