"""`adapt run --image` through the CLI (in process): text prompts with the placeholder text, --chat content parts,
data: URLs, several images; and bad images as one line with a non-zero exit."""

from __future__ import annotations

import base64
import io
import json

import pytest
import torch

pytest.importorskip("PIL")

from tests.runtime.vision.vlm import IMAGE_TOKEN, PLACEHOLDER, image_processor, make_image, save_vlm  # noqa: E402


def _main(args, capsys):
    from adapt.cli.main import main

    code = 0
    try:
        main(args)
    except SystemExit as e:
        code = e.code or 0
    out = capsys.readouterr()
    return code, out.out, out.err


def _data_url(im, fmt="PNG"):
    buf = io.BytesIO()
    im.save(buf, fmt)
    return f"data:image/{fmt.lower()};base64," + base64.b64encode(buf.getvalue()).decode()


@pytest.fixture(scope="module", params=("llava", "qwen2_5_vl"))
def vlm(request, tmp_path_factory):
    d = tmp_path_factory.mktemp("cli-" + request.param)
    model, path = save_vlm(request.param, d / "model")
    return request.param, model, path, d


def _hf_greedy(kind, model, path, ids, images, n):
    from adapt.runtime.tokenizer import Tokenizer  # noqa: F401  (the same tokenizer file as adapt's)

    hf = image_processor(kind)(images=images, return_tensors="pt")
    x = torch.tensor([ids])
    kw = dict(pixel_values=hf["pixel_values"])
    if kind == "qwen2_5_vl":
        kw.update(image_grid_thw=hf["image_grid_thw"], mm_token_type_ids=(x == IMAGE_TOKEN[kind]).int())
    with torch.no_grad():
        return model.generate(x, max_new_tokens=n, min_new_tokens=n, do_sample=False, **kw)[0, len(ids):].tolist()


def test_run_image_text_prompt_and_data_url_match_transformers(vlm, capsys):
    kind, model, path, d = vlm
    a, b = make_image(45, 20, seed=3), make_image(20, 50, seed=4)
    a.save(d / "a.png")
    prompt = f"Look {PLACEHOLDER[kind]} and {PLACEHOLDER[kind]} now"
    code, out, err = _main(["run", str(path), "--image", str(d / "a.png"), "--image", _data_url(b), "--prompt", prompt,
                            "-n", "6", "--ignore-eos", "--format", "json"], capsys)
    assert code == 0, err
    doc = json.loads(out)
    o = doc["outputs"][0]
    assert doc["stats"]["vision"]["images"] == 2 and doc["stats"]["vision"]["encoder_s"] > 0
    assert o["token_ids"] == _hf_greedy(kind, model, path, o["prompt_token_ids"], [a, b], 6)
    # the expansion is the processor's: as many image tokens as the image takes
    n_img = sum(1 for t in o["prompt_token_ids"] if t == IMAGE_TOKEN[kind])
    assert n_img == doc["stats"]["vision"]["tokens"]


def test_run_image_chat_puts_the_image_in_as_a_content_part(vlm, capsys):
    kind, model, path, d = vlm
    im = make_image(33, 33, seed=5)
    code, out, err = _main(["run", str(path), "--image", _data_url(im), "--prompt", "What is it?", "--chat", "-n", "4",
                            "--ignore-eos", "--format", "json"], capsys)
    assert code == 0, err
    o = json.loads(out)["outputs"][0]
    assert IMAGE_TOKEN[kind] in o["prompt_token_ids"]
    assert o["token_ids"] == _hf_greedy(kind, model, path, o["prompt_token_ids"], [im], 4)


@pytest.mark.parametrize("case", ["not_an_image", "truncated", "missing", "too_many", "bad_base64", "remote"])
def test_bad_images_are_one_line_and_exit_1(vlm, capsys, case):
    kind, _, path, d = vlm
    good = make_image(30, 30)
    buf = io.BytesIO()
    good.save(buf, "PNG")
    src = {"not_an_image": "data:image/png;base64," + base64.b64encode(b"hello world").decode(),
           "truncated": "data:image/png;base64," + base64.b64encode(buf.getvalue()[:60]).decode(),
           "missing": str(d / "nope.png"), "too_many": _data_url(good), "bad_base64": "data:image/png;base64,@@@",
           "remote": "http://127.0.0.1:9/x.png"}[case]
    args = ["run", str(path), "--image", src, "--prompt", "no placeholder" if case == "too_many" else PLACEHOLDER[kind]]
    code, out, err = _main(args, capsys)
    assert code == 1 and out == ""
    assert err.startswith("error:") and "Traceback" not in err and len(err.strip().splitlines()) <= 2


def test_text_model_refuses_an_image(tmp_path, capsys):
    from tests.fixtures.tiny import save_tiny

    _, path = save_tiny("llama", tmp_path / "m")
    make_image(10, 10).save(tmp_path / "a.png")
    code, _, err = _main(["run", str(path), "--image", str(tmp_path / "a.png"), "--prompt-ids", "1,2"], capsys)
    assert code == 1 and "no vision tower" in err
