"""A request's images inside the engine: preprocessed inputs, their features (computed once, at the
request's first prefill, kept with the request: a preempted request is prefilled again without running
the tower again; never in the KV cache), Qwen2.5-VL's M-RoPE positions and decode delta; and what a
prefill step feeds the model from them.

The placeholder tokens are ordinary prompt tokens, so the scheduler's token budget counts them.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from adapt.errors import ImageInputError
from adapt.runtime.vision.mrope import mrope_positions
from adapt.runtime.vision.processor import ImageInput
from adapt.spec import ModelSpec


@dataclass(eq=False)
class RequestImages:
    images: list[ImageInput]
    image_token_id: int
    mrope: list[list[int]] | None = None  # [3][prompt length] (Qwen2.5-VL)
    delta: int = 0  # M-RoPE: decode position = sequence index + delta
    features: torch.Tensor | None = None  # [image tokens, H]
    encode_s: float = 0.0
    stats: dict = field(default_factory=dict)


def make_request(spec: ModelSpec, prompt_ids: list[int], images: list[ImageInput]) -> RequestImages | None:
    """The engine's record of a prompt's images (None for a text-only prompt on a text-only model)."""
    v = spec.vision
    if v is None:
        if images:
            raise ImageInputError(f"{spec.model_type} has no vision tower: it takes no images")
        return None
    if not images:  # image token ids without images embed as plain tokens, as in transformers
        return None
    tid = v.image_token_id
    n = sum(1 for t in prompt_ids if t == tid)
    if n != sum(im.num_tokens for im in images):
        raise ImageInputError(f"the prompt holds {n} image tokens (id {tid}) but its {len(images)} image(s) "
                              f"take {sum(im.num_tokens for im in images)}; expand the placeholders first")
    r = RequestImages(list(images), tid)
    if v.kind == "qwen2_5_vl":
        r.mrope, r.delta = mrope_positions(prompt_ids, tid, [im.grid_thw for im in images], v.spatial_merge_size)
    return r


def uses_mrope(spec: ModelSpec) -> bool:
    return spec.vision is not None and spec.vision.kind == "qwen2_5_vl"


def step_inputs(model, kernels, seqs, device) -> tuple[tuple[torch.Tensor, torch.Tensor] | None, torch.Tensor | None]:
    """(mm_embeds, mrope_positions) of a prefill step over ``seqs`` (scheduler Sequences, packed in order)."""
    rows, feats, mpos, off, any_mm = [], [], [[], [], []], 0, False
    mrope = uses_mrope(model.spec)
    for s in seqs:
        r: RequestImages | None = s.mm
        n = s.num_tokens
        if r is not None:
            any_mm = True
            if r.features is None:
                t0 = time.perf_counter()
                r.features = model.encode_images(r.images, kernels)
                r.encode_s = time.perf_counter() - t0
            rows.extend(off + i for i, t in enumerate(s.prompt_ids) if t == r.image_token_id)
            feats.append(r.features)
        if mrope:
            p = len(s.prompt_ids)
            for k in range(3):
                head = r.mrope[k] if r is not None and r.mrope is not None else list(range(p))
                delta = r.delta if r is not None else 0
                mpos[k].extend(head + [p + j + delta for j in range(n - p)])
        off += n
    if not any_mm:
        return None, None
    embeds = (torch.tensor(rows, dtype=torch.long, device=device), torch.cat(feats).to(device))
    positions = torch.tensor(mpos, dtype=torch.long, device=device) if mrope else None
    return embeds, positions


def decode_delta(seq) -> int:
    r = seq.mm
    return r.delta if r is not None else 0
