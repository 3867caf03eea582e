"""The image path of adapt's runtime against transformers (float32, CPU): vision features within 1e-5 and
greedy tokens identical for tiny llava-1.5 and Qwen2.5-VL over square, wide, tall, tiny and over-size images."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("PIL")

from adapt.runtime.engine import Engine  # noqa: E402
from adapt.runtime.sampling import SamplingParams  # noqa: E402
from adapt.runtime.vision.processor import expand_placeholders  # noqa: E402
from tests.runtime.vision.vlm import IMAGE_TOKEN, image_processor, make_image, save_vlm  # noqa: E402

SIZES = [(30, 30), (45, 20), (17, 60), (6, 6), (90, 70)]  # square, wide, tall, tiny, larger than max_pixels
KINDS = ("llava", "qwen2_5_vl")


@pytest.fixture(scope="module", params=KINDS)
def vlm(request, tmp_path_factory):
    kind = request.param
    model, path = save_vlm(kind, tmp_path_factory.mktemp(kind))
    return kind, model, Engine.from_pretrained(path)


def _prompt(kind, n_images=1):
    tid = IMAGE_TOKEN[kind]
    one = [tid] if kind == "llava" else [300, tid, 302]
    return [0, 40, 41] + [x for _ in range(n_images) for x in one + [42]] + [43, 44]


def _hf_inputs(kind, images, ids):
    hf = image_processor(kind)(images=images, return_tensors="pt")
    x = torch.tensor([ids])
    kw = dict(pixel_values=hf["pixel_values"])
    if kind == "qwen2_5_vl":
        kw.update(image_grid_thw=hf["image_grid_thw"], mm_token_type_ids=(x == IMAGE_TOKEN[kind]).int())
    return x, kw


def _hf_features(kind, model, kw):
    with torch.no_grad():
        if kind == "llava":
            return torch.cat(list(model.model.get_image_features(pixel_values=kw["pixel_values"]).pooler_output))
        out = model.model.visual(kw["pixel_values"], grid_thw=kw["image_grid_thw"])
        return out.pooler_output


@pytest.mark.parametrize("size", SIZES)
def test_features_and_greedy_tokens_match_transformers(vlm, size):
    kind, model, eng = vlm
    im = make_image(*size, seed=size[0])
    pre = eng.image_processor()(im)
    ids = expand_placeholders(_prompt(kind), [pre], IMAGE_TOKEN[kind])
    x, kw = _hf_inputs(kind, [im], ids)
    assert torch.equal(pre.pixel_values.reshape(kw["pixel_values"].shape), kw["pixel_values"])
    feats = eng.model.encode_images([pre], eng.kernels)
    ref = _hf_features(kind, model, kw).reshape(feats.shape)
    assert (feats - ref).abs().max().item() < 1e-5
    out = eng.generate([ids], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), images=[[pre]])
    with torch.no_grad():
        want = model.generate(x, max_new_tokens=8, min_new_tokens=8, do_sample=False, **kw)[0, len(ids):].tolist()
    assert out[0].token_ids == want
    assert eng.last_stats["vision"]["tokens"] == pre.num_tokens


def test_two_images_and_a_text_prompt_in_one_batch(vlm):
    kind, model, eng = vlm
    ims = [make_image(45, 20, seed=1), make_image(20, 45, seed=2)]
    pre = [eng.image_processor()(im) for im in ims]
    ids = expand_placeholders(_prompt(kind, 2), pre, IMAGE_TOKEN[kind])
    text = [0, 50, 51, 52]
    sp = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    out = eng.generate([ids, text], sp, images=[pre, []])
    x, kw = _hf_inputs(kind, ims, ids)
    with torch.no_grad():
        want = model.generate(x, max_new_tokens=6, min_new_tokens=6, do_sample=False, **kw)[0, len(ids):].tolist()
        want_text = model.generate(torch.tensor([text]), max_new_tokens=6, min_new_tokens=6,
                                   do_sample=False)[0, len(text):].tolist()
    assert out[0].token_ids == want
    assert out[1].token_ids == want_text


def test_the_image_changes_the_output(vlm):
    """The features reach the language model: another image gives other prefill logits."""
    kind, _, eng = vlm
    a, b = (eng.image_processor()(make_image(30, 30, seed=s)) for s in (1, 2))
    ids = expand_placeholders(_prompt(kind), [a], IMAGE_TOKEN[kind])
    la, lb = eng.prefill_logits(ids, images=[a]), eng.prefill_logits(ids, images=[b])
    assert (la[-1] - lb[-1]).abs().max().item() > 1e-3


def test_last_only_prefill_is_the_last_row(vlm):
    """prefill(last_only=True) (what the bench times against transformers' logits_to_keep=1) is the last row."""
    kind, _, eng = vlm
    a = eng.image_processor()(make_image(45, 20, seed=3))
    ids = expand_placeholders(_prompt(kind), [a], IMAGE_TOKEN[kind])
    full, last = eng.prefill(ids, images=[a]).logits, eng.prefill(ids, images=[a], last_only=True).logits
    assert last.shape == (1, full.shape[1])
    torch.testing.assert_close(last[0], full[-1], atol=1e-5, rtol=1e-5)


def test_window_index_and_mrope_positions_equal_transformers():
    """The window permutation (its partial windows at the edges) and the M-RoPE streams, against
    transformers' own functions."""
    from types import SimpleNamespace

    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VLModel
    from transformers.vision_utils import get_vision_window_index

    from adapt.runtime.vision.mrope import mrope_positions
    from adapt.runtime.vision.qwen_vit import window_index

    grids = [(1, 10, 6), (1, 4, 14), (1, 2, 2)]
    order, cu = window_index(grids, 2, 112, 14)
    ref_order, ref_cu = get_vision_window_index(torch.tensor(grids), spatial_merge_size=2, window_size=112,
                                                patch_size=14)
    assert torch.equal(order, ref_order) and torch.equal(cu, ref_cu)
    ids = [5, 6, 300] + [301] * 15 + [302, 7] + [300] + [301] * 14 + [302, 8, 9] + [300, 301, 302]
    pos, delta = mrope_positions(ids, 301, grids, 2)
    cfg = SimpleNamespace(vision_config=SimpleNamespace(spatial_merge_size=2, tokens_per_second=2))
    x = torch.tensor([ids])
    ref_pos, ref_delta = Qwen2_5_VLModel.get_rope_index(SimpleNamespace(config=cfg, get_vision_position_ids=
                                                        lambda *a, **k: Qwen2_5_VLModel.get_vision_position_ids(None, *a, **k)),
                                                        x, (x == 301).int(), image_grid_thw=torch.tensor(grids))
    assert pos == ref_pos[:, 0].tolist() and delta == int(ref_delta)
