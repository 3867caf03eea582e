"""image_path: the vision tower, the projector and end-to-end logits / greedy tokens with an image, against
transformers, over a sweep of image sizes and aspect ratios; plus preprocessing parity.

For each image of the sweep (square, wide, tall, tiny, larger than the processor's max_pixels; deterministic
gradients + checkerboard + seeded noise):
  parity      the image goes through adapt's served path (PNG -> ``data:`` URL -> adapt's decoder -> the
              target's image processor) and through the reference's processor from the PIL image: pixel
              values must be equal (``pixel_max_abs`` 0) and so must the placeholder token counts;
  tower       every tower layer's output (llava: CLIP hidden_states; Qwen2.5-VL: each block, window order)
              and the projector / merger output against the reference's (max_abs, cosine);
  end to end  prefill logits of a prompt holding the image (max_abs, cosine) and ``max_new_tokens`` greedy
              tokens (any differing token fails).
The first tower layer (or the projector) that breaks the bounds is the report's ``first_divergence``.
Needs a transformers reference (a golden directory stores no images yet) and adapt's runtime as target.
"""

from __future__ import annotations

import base64
import io
import math
from collections.abc import Mapping
from typing import Any

import torch

from adapt.validate import compare
from adapt.validate.checklist import Outcome, Skip, apply_thresholds, register_check

SWEEP = (("square", 1.0), ("wide", 2.7), ("tall", 1 / 2.7), ("tiny", None), ("large", 1.33))
_BOUNDS = {"max_abs_max", "cosine_min"}


def sweep_image(kind: str, ratio: float | None, base: int, large: int, seed: int):
    """A deterministic RGB image of the sweep: gradients, an 8-pixel checkerboard and seeded noise."""
    import numpy as np
    from PIL import Image

    if ratio is None:
        w = h = 6
    else:
        side = large if kind == "large" else base
        w, h = max(1, round(side * math.sqrt(ratio))), max(1, round(side / math.sqrt(ratio)))
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:h, 0:w]
    board = ((x // 8 + y // 8) % 2) * 80
    img = np.stack([x * 200 // max(1, w - 1) + board, y * 200 // max(1, h - 1), board + 60], -1)
    img = np.clip(img + rng.integers(-30, 30, size=(h, w, 3)), 0, 255).astype("uint8")
    return Image.fromarray(img, "RGB")


def _png_data_url(im) -> str:
    buf = io.BytesIO()
    im.save(buf, "PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def thumbnail(im, side: int = 48) -> str:
    t = im.copy()
    t.thumbnail((side, side))
    return _png_data_url(t)


def _sizes(hf_proc, vision) -> tuple[int, int]:
    """(base side, large side) of the sweep for this processor."""
    if vision.kind == "clip":
        crop = getattr(hf_proc, "crop_size", None) or {}
        s = int(crop.get("height", vision.image_size) if isinstance(crop, Mapping) else vision.image_size)
        return max(s, 16), 2 * max(s, 16)
    size = getattr(hf_proc, "size", None) or {}
    most = int(size.get("longest_edge") or getattr(hf_proc, "max_pixels", 0) or 1 << 20)
    base = int(math.sqrt(most) * 0.6)
    return max(base, 28), min(int(math.sqrt(most) * 1.3) + 28, 1600)


def _reference_pixels(hf_proc, vision, im):
    out = hf_proc(images=[im], return_tensors="pt")
    grid = out.get("image_grid_thw")
    if vision.kind == "clip":
        from adapt.runtime.vision.clip import image_tokens
        return out["pixel_values"], None, image_tokens(vision)
    return out["pixel_values"], grid, int(grid[0].prod()) // vision.spatial_merge_size ** 2


@torch.inference_mode()
def _reference_tower(hf, vision, pixels, grid) -> tuple[list[torch.Tensor], torch.Tensor]:
    """(each tower layer's output, the projector's output [tokens, H]) of transformers."""
    inner = hf.model
    if vision.kind == "clip":
        out = inner.vision_tower(pixels, output_hidden_states=True)
        layers = [h[0] for h in out.hidden_states[1:]]
        feats = inner.get_image_features(pixel_values=pixels).pooler_output
        return layers, torch.cat(list(feats))
    got: list[torch.Tensor] = []
    hooks = [b.register_forward_hook(lambda _m, _i, o: got.append(o[0] if isinstance(o, tuple) else o))
             for b in inner.visual.blocks]
    try:
        feats = inner.visual(pixels, grid_thw=grid).pooler_output
    finally:
        for h in hooks:
            h.remove()
    return got, feats


def _prompt(spec, n_tokens: int) -> list[int]:
    v = spec.vision
    words = [(7 * i + 11) % max(2, min(spec.vocab_size, 1000)) for i in range(6)]
    words = [w for w in words if w not in (v.image_token_id, v.vision_start_token_id)]
    return words[:3] + [v.image_token_id] * n_tokens + words[3:]


@torch.inference_mode()
def _reference_run(hf, vision, ids, pixels, grid, n_new: int):
    x = torch.tensor([ids])
    kw: dict[str, Any] = {"pixel_values": pixels}
    if grid is not None:
        kw.update(image_grid_thw=grid, mm_token_type_ids=(x == vision.image_token_id).int())
    logits = hf(x, use_cache=False, **kw).logits[0].float()
    tokens = hf.generate(x, max_new_tokens=n_new, min_new_tokens=n_new, do_sample=False, **kw)[0, len(ids):]
    return logits, tokens.tolist()


def _pair_metrics(t: torch.Tensor, r: torch.Tensor) -> dict[str, float]:
    t, r = t.float().reshape(-1), r.float().reshape(-1)
    return {"max_abs": compare.max_abs(t, r), "cosine": compare.cosine(t, r)}


@register_check("image_path")
def image_path(params: Mapping[str, Any], thresholds: Mapping[str, float], ctx) -> Outcome:
    eng = ctx.target.engine
    spec = getattr(eng, "spec", None)
    ref_cfg = getattr(getattr(getattr(ctx.reference, "model", None), "model", None), "config", None)
    has_vision = (spec.vision is not None if spec is not None else
                  getattr(ref_cfg, "vision_config", None) is not None or bool(
                      (getattr(ctx.reference, "doc", None) or {}).get("config", {}).get("vision_config")))
    if not has_vision:
        raise Skip("text-only model: no vision tower")
    if spec is None:
        raise Skip(ctx.target.reason or "the image path runs on adapt's runtime, which did not run this target")
    hf = getattr(getattr(ctx.reference, "model", None), "model", None)
    if hf is None or not hasattr(ctx.reference, "path"):
        raise Skip("a golden directory stores no image references yet: validate the image path with "
                   "--reference HF_DIR (transformers)")
    try:
        import PIL  # noqa: F401  (transformers' PIL image processors need it)
        from transformers import AutoImageProcessor
    except ImportError:
        raise Skip("the image path needs pillow: pip install 'adapt[vision]'") from None
    from adapt.runtime.vision.inputs import load_image

    v = spec.vision
    ref_proc = AutoImageProcessor.from_pretrained(str(ctx.reference.path), backend="pil")
    base, large = _sizes(ref_proc, v)
    n_new = int(params.get("max_new_tokens", 4))
    bounds = {k: v_ for k, v_ in thresholds.items() if k in _BOUNDS}
    rows, images, failures, divergence = [], [], [], None
    for i, (name, ratio) in enumerate(SWEEP):
        im = sweep_image(name, ratio, base, large, seed=i)
        images.append({"name": name, "size": list(im.size), "thumbnail": thumbnail(im)})
        pre = eng.image_processor()(load_image(_png_data_url(im)))  # the served path
        r_pix, r_grid, r_tokens = _reference_pixels(ref_proc, v, im)
        pix = compare.max_abs(pre.pixel_values.reshape(r_pix.shape).float(), r_pix.float())
        row: dict[str, Any] = {"image": name, "size": list(im.size), "pixel_max_abs": pix,
                               "tokens": pre.num_tokens, "reference_tokens": r_tokens}
        if pix != 0 or pre.num_tokens != r_tokens:
            failures.append(f"{name} {im.size[0]}x{im.size[1]}: preprocessing differs (pixel max_abs {pix:.3g}, "
                            f"tokens {pre.num_tokens} vs {r_tokens})")
            rows.append(row)
            continue
        capture: dict[str, torch.Tensor] = {}
        feats = eng.model.encode_images([pre], eng.kernels, capture)
        r_layers, r_feats = _reference_tower(hf, v, r_pix, r_grid)
        prefix = "vision.layers." if v.kind == "clip" else "vision.blocks."
        for j, r_out in enumerate(r_layers):
            if f"{prefix}{j}" not in capture:
                break  # llava reads an earlier layer: the later ones are not built
            m = _pair_metrics(capture[f"{prefix}{j}"], r_out)
            broken = apply_thresholds(m, bounds)
            if broken and divergence is None:
                divergence = {"layer": j, "module": "vision_tower", "name": f"{prefix}{j}", "image": name,
                              "why": "; ".join(broken)}
        fm = _pair_metrics(feats, r_feats)
        row.update({f"projector_{k}": x for k, x in fm.items()})
        broken = apply_thresholds(fm, bounds)
        if broken and divergence is None:
            divergence = {"layer": v.num_layers, "module": "projector", "name": "projector", "image": name,
                          "why": "; ".join(broken)}
        ids = _prompt(spec, pre.num_tokens)
        r_logits, r_tokens_out = _reference_run(hf, v, ids, r_pix, r_grid, n_new)
        t_logits = eng.prefill_logits(ids, images=[pre]).float().cpu()
        lm = _pair_metrics(t_logits, r_logits)
        row.update(lm)
        from adapt.runtime.sampling import SamplingParams

        got = eng.generate([ids], SamplingParams(temperature=0, max_tokens=n_new, ignore_eos=True),
                           images=[[pre]])[0].token_ids
        row["tokens_match"] = got == r_tokens_out
        if not row["tokens_match"]:
            failures.append(f"{name}: greedy tokens {got} vs reference {r_tokens_out}")
        rows.append(row)
    done = [r for r in rows if "max_abs" in r]
    metrics: dict[str, Any] = {
        "images": len(rows), "per_image": rows, "thumbnails": images,
        "pixel_max_abs": max(r["pixel_max_abs"] for r in rows),
        "max_abs": max((r["max_abs"] for r in done), default=float("nan")),
        "cosine": min((r["cosine"] for r in done), default=float("nan")),
        "projector_max_abs": max((r["projector_max_abs"] for r in done), default=float("nan")),
    }
    if divergence is not None:
        if ctx.first_divergence is None:
            ctx.first_divergence = divergence
        failures.append(f"first divergence: {divergence['name']} on the {divergence['image']} image "
                        f"({divergence['why']})")
    broken = apply_thresholds({k: metrics[k] for k in ("max_abs", "cosine")}, bounds) if done else []
    if failures or broken:
        return Outcome(metrics, status="fail", message="; ".join(broken + failures))
    sizes = ", ".join(f"{r['image']} {r['size'][0]}x{r['size'][1]}" for r in rows)
    return Outcome(metrics, message=f"{len(rows)} images ({sizes}): pixels equal, tower / projector / logits in "
                                    f"tolerance, greedy tokens equal")
