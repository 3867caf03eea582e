"""Preprocessing with the checkpoint's own image processor, and the prompt's placeholder expansion.

The processor is transformers' (``preprocessor_config.json`` in the checkpoint), on its PIL backend:
the one the field's reference runs (a torchvision build matching the CPU torch wheel may not be
installable), so resize / crop / rescale / normalize and Qwen2.5-VL's ``smart_resize`` are the
reference's own code, not a re-derivation. An image becomes an :class:`ImageInput`: llava
[C, S, S] pixels, Qwen2.5-VL [patches, C * Tp * p * p] and its (t, h, w) grid in patches.

Placeholders are expanded at the token level: each image token id in a prompt (``<image>`` for llava,
``<|image_pad|>`` for Qwen2.5-VL) becomes that image's token count, images taken in order. This is
what the processors do to the text before tokenizing, for placeholders that are single added tokens.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from adapt.errors import CheckpointError, ImageInputError
from adapt.runtime.vision.clip import image_tokens
from adapt.runtime.vision.inputs import ImageLimits, load_image
from adapt.spec import VisionSpec


@dataclass
class ImageInput:
    pixel_values: torch.Tensor
    grid_thw: tuple[int, int, int] | None
    num_tokens: int
    size: tuple[int, int]  # the decoded image's (width, height)


class ImageProcessor:
    def __init__(self, path: Path, vision: VisionSpec):
        if not (Path(path) / "preprocessor_config.json").is_file():
            raise CheckpointError(f"{path} has no preprocessor_config.json (the image processor): images need it")
        try:
            from transformers import AutoImageProcessor
            self.hf = AutoImageProcessor.from_pretrained(str(path), backend="pil")
        except ImportError as e:
            raise ImageInputError(f"images need pillow: pip install 'adapt[vision]' ({e})") from None
        except (OSError, ValueError, KeyError) as e:
            raise CheckpointError(f"{path}/preprocessor_config.json: {e}") from None
        self.vision = vision

    def __call__(self, image) -> ImageInput:
        v = self.vision
        try:
            out = self.hf(images=[image], return_tensors="pt")
        except (ValueError, OSError) as e:
            raise ImageInputError(f"the image processor refused the image ({e})") from None
        pv = out["pixel_values"]
        if v.kind == "clip":
            return ImageInput(pv[0], None, image_tokens(v), image.size)
        t, h, w = (int(x) for x in out["image_grid_thw"][0])
        return ImageInput(pv, (t, h, w), t * h * w // v.spatial_merge_size ** 2, image.size)


def preprocess(proc: ImageProcessor, src: str, limits: ImageLimits = ImageLimits()) -> ImageInput:
    """One image source (path, data: URL, http(s) URL) decoded under ``limits`` (inputs.py) and run through
    the checkpoint's processor: the one path of ``adapt run --image`` and ``adapt serve``'s image parts."""
    return proc(load_image(src, limits))


def expand_placeholders(ids: list[int], images: list[ImageInput], image_token_id: int) -> list[int]:
    """Each image token in ids repeated to its image's token count, images in order."""
    n = sum(1 for t in ids if t == image_token_id)
    if n != len(images):
        raise ImageInputError(f"the prompt holds {n} image placeholder(s) (token {image_token_id}) for "
                              f"{len(images)} image(s)")
    out, k = [], 0
    for t in ids:
        if t == image_token_id:
            out.extend([t] * images[k].num_tokens)
            k += 1
        else:
            out.append(t)
    return out


def split_images(prompts: list[list[int]], images: list[ImageInput], image_token_id: int) -> list[list[ImageInput]]:
    """The images of each prompt: taken in order by the prompts' placeholders."""
    out, k = [], 0
    for ids in prompts:
        n = sum(1 for t in ids if t == image_token_id)
        out.append(images[k:k + n])
        k += n
    if k != len(images):
        raise ImageInputError(f"the prompts hold {k} image placeholder(s) for {len(images)} image(s)")
    return out
