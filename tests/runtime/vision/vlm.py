"""Tiny llava-1.5 and Qwen2.5-VL checkpoints for the image-path tests: transformers' random model saved with
``save_pretrained`` plus its image processor's ``preprocessor_config.json`` (PIL backend), and images made
with pillow. Odd shapes on purpose: a 3-layer CLIP tower read at layer -2, a 30-pixel llava crop (2x2
patches of 15), Qwen2.5-VL windows smaller than the image so window attention differs from full."""

from __future__ import annotations

from pathlib import Path

from tests.fixtures.tiny import build_model

LLAVA = dict(model_type="llava", image_token_index=300, vision_feature_layer=-2,
             text_config=dict(model_type="llama", hidden_size=48, intermediate_size=80, num_hidden_layers=2,
                              num_attention_heads=4, num_key_value_heads=2, vocab_size=304, head_dim=12,
                              bos_token_id=1, eos_token_id=2),
             vision_config=dict(model_type="clip_vision_model", hidden_size=40, intermediate_size=56,
                                num_hidden_layers=3, num_attention_heads=2, image_size=30, patch_size=15,
                                projection_dim=16))

QWEN = dict(model_type="qwen2_5_vl", image_token_id=301, vision_start_token_id=300, vision_end_token_id=302,
            video_token_id=303,
            text_config=dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                             num_key_value_heads=2, vocab_size=304, bos_token_id=1, eos_token_id=2,
                             rope_scaling={"type": "mrope", "mrope_section": [4, 2, 2]}),
            vision_config=dict(depth=3, hidden_size=32, intermediate_size=48, num_heads=2, out_hidden_size=64,
                               fullatt_block_indexes=[1], window_size=56, patch_size=14, spatial_merge_size=2))

QWEN_PIXELS = dict(min_pixels=28 * 28, max_pixels=28 * 28 * 16)  # up to 4x4 merged tokens


PLACEHOLDER = {"llava": "<image>", "qwen2_5_vl": "<|vision_start|><|image_pad|><|vision_end|>"}
IMAGE_TOKEN = {"llava": 300, "qwen2_5_vl": 301}
# ChatML with content parts: an image part renders as the model's placeholder text
_CHAT = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' }}{% if m['content'] is string %}"
         "{{ m['content'] }}{% else %}{% for p in m['content'] %}{% if p['type'] == 'image' %}PLACEHOLDER"
         "{% elif p['type'] == 'text' %}{{ p['text'] }}{% endif %}{% endfor %}{% endif %}{{ '<|im_end|>\\n' }}"
         "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")


def add_tokenizer(kind: str, out: Path) -> None:
    """The built-in tiny BPE (300 entries) plus the model's image special tokens at ids 300-302, and a
    chat template that renders image content parts as the placeholder text."""
    import json

    from tokenizers import AddedToken, Tokenizer

    from adapt.runtime.tiny_tokenizer import build_tiny_tokenizer

    build_tiny_tokenizer(out, 300)
    tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    extra = ["<image>", "<pad2>", "<pad3>"] if kind == "llava" else ["<|vision_start|>", "<|image_pad|>", "<|vision_end|>"]
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in extra])
    tok.save(str(out / "tokenizer.json"))
    cfg = json.loads((out / "tokenizer_config.json").read_text())
    cfg["chat_template"] = _CHAT.replace("PLACEHOLDER", PLACEHOLDER[kind])
    (out / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2))


def save_vlm(kind: str, out: Path, seed: int = 0, tokenizer: bool = True, **overrides):
    """(transformers model, dir) of a tiny 'llava' or 'qwen2_5_vl' with its preprocessor_config.json
    (and a tokenizer with the image tokens)."""
    import copy

    cfg = copy.deepcopy(LLAVA if kind == "llava" else QWEN)
    cfg.update(overrides)
    model = build_model(cfg, seed)
    out = Path(out)
    model.save_pretrained(out)
    image_processor(kind).save_pretrained(out)
    if tokenizer:
        add_tokenizer(kind, out)
    return model, out


def image_processor(kind: str):
    if kind == "llava":
        from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil
        return CLIPImageProcessorPil(size={"shortest_edge": 30}, crop_size={"height": 30, "width": 30})
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
    return Qwen2VLImageProcessorPil(**QWEN_PIXELS, patch_size=14, merge_size=2, temporal_patch_size=2)


def make_image(w: int, h: int, seed: int = 0):
    """A deterministic RGB test image: smooth gradients plus seeded noise, so resizing matters."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:h, 0:w]
    base = np.stack([(x * 255 // max(1, w - 1)), (y * 255 // max(1, h - 1)), ((x + y) * 127 // max(1, w + h - 2))], -1)
    img = np.clip(base + rng.integers(-40, 40, size=(h, w, 3)), 0, 255).astype("uint8")
    return Image.fromarray(img, "RGB")
