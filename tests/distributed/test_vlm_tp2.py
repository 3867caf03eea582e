"""`adapt run --nproc 2` of a VLM's tp2 shard gives one rank's greedy tokens with an image: the language model
is tp-split, the vision tower and projector replicated (a few percent of a VLM's weights, and their attention
has few heads to split), so every rank computes the same image features."""

from __future__ import annotations

import json

import pytest
from safetensors import safe_open

from tests.distributed.test_launch import _adapt

PROMPTS = {"tiny-qwen2.5-vl": "a <|vision_start|><|image_pad|><|vision_end|> b", "tiny-llava": "USER: <image>\nwhat?"}


@pytest.mark.parametrize("name", sorted(PROMPTS))
def test_vlm_tp2_matches_one_rank(name, tmp_path):
    from PIL import Image

    from adapt.runtime.init_model import init_model
    from adapt.shard.run import shard

    ckpt = init_model(name, tmp_path / "m")
    shard(ckpt, tmp_path / "tp2", tp=2)
    img = tmp_path / "wide.png"
    Image.new("RGB", (60, 40), (200, 30, 90)).save(img)
    args = ["--image", str(img), "--prompt", PROMPTS[name], "--max-tokens", "8", "--ignore-eos", "--format", "json"]
    one, _ = _adapt("run", str(ckpt), *args)
    two, _ = _adapt("run", str(tmp_path / "tp2"), *args, "--nproc", "2", timeout=240)
    assert one.returncode == 0 and two.returncode == 0, (one.stderr[-1500:], two.stderr[-1500:])
    a, b = json.loads(one.stdout)["outputs"][0], json.loads(two.stdout)["outputs"][0]
    assert a["prompt_token_ids"] == b["prompt_token_ids"] and a["token_ids"] == b["token_ids"]
    shapes = []
    for r in (0, 1):
        f = next((tmp_path / "tp2" / f"rank-{r:05d}").glob("*.safetensors"))
        with safe_open(f, "pt") as g:
            shapes.append({k: g.get_slice(k).get_shape() for k in g.keys()
                           if k.startswith(("visual.", "model.visual.", "vision_tower.", "model.vision_tower.",
                                            "multi_modal_projector.", "model.multi_modal_projector."))})
    full = {}
    for f in ckpt.glob("*.safetensors"):
        with safe_open(f, "pt") as g:
            full |= {k: g.get_slice(k).get_shape() for k in g.keys() if k in shapes[0]}
    assert shapes[0] and shapes[0] == shapes[1] == full  # replicated: the whole tensors on both ranks
