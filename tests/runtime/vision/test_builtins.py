"""The multimodal built-ins: `adapt init-model tiny-llava | tiny-qwen2.5-vl` write a checkpoint transformers loads
(processor files included), the same bytes every time, and `adapt run --image --chat` on it gives transformers'
greedy tokens; `adapt day0 tiny-qwen2.5-vl` (slow) runs the chain with image_path passing."""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("PIL")

from adapt.runtime.init_model import init_model  # noqa: E402
from tests.runtime.vision.vlm import make_image  # noqa: E402


@pytest.mark.parametrize("name", ["tiny-llava", "tiny-qwen2.5-vl"])
def test_builtin_vlm_loads_in_transformers_and_runs_token_identical(name, tmp_path, capsys):
    import transformers

    from adapt.cli.main import main

    a = init_model(name, tmp_path / "a")
    b = init_model(name, tmp_path / "b")
    for f in ("model.safetensors", "tokenizer.json", "preprocessor_config.json", "tokenizer_config.json"):
        assert (a / f).read_bytes() == (b / f).read_bytes(), f
    im = make_image(64, 40, seed=9)
    im.save(tmp_path / "im.png")
    try:
        main(["run", str(a), "--image", str(tmp_path / "im.png"), "--prompt", "Describe", "--chat", "-n", "5",
              "--ignore-eos", "--format", "json"])
    except SystemExit as e:
        assert not e.code
    o = json.loads(capsys.readouterr().out)["outputs"][0]
    model = transformers.AutoModelForImageTextToText.from_pretrained(a).eval()
    proc = transformers.AutoImageProcessor.from_pretrained(str(a), backend="pil")
    hf = proc(images=[im], return_tensors="pt")
    x = torch.tensor([o["prompt_token_ids"]])
    kw = dict(pixel_values=hf["pixel_values"])
    if "image_grid_thw" in hf:
        kw.update(image_grid_thw=hf["image_grid_thw"], mm_token_type_ids=(x == model.config.image_token_id).int())
    with torch.no_grad():
        want = model.generate(x, max_new_tokens=5, min_new_tokens=5, do_sample=False, **kw)[0, x.shape[1]:].tolist()
    assert o["token_ids"] == want


@pytest.mark.slow
def test_day0_tiny_qwen25_vl_passes_the_image_item(tmp_path):
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "adapt", "day0", "tiny-qwen2.5-vl", "--out", str(tmp_path / "d")],
                         capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-2000:]
    report = json.loads((tmp_path / "d" / "validate" / "report.json").read_text())
    item = next(i for i in report["items"] if i["id"] == "image_path")
    assert item["status"] == "pass", item["message"]
