"""image_path through an OpenAI-compatible endpoint: each image of the sweep (checks/image.py) sent as an
``image_url`` data URL in a chat message, against transformers with the same image.

Per image: the reference renders the same chat (the checkpoint's template, the image part as its
placeholder), expands the placeholder to its own processor's token count and generates greedily with the
processor's pixel values. The served ``prompt_token_ids`` (or ``usage.prompt_tokens`` where the server sends
no ids) must equal the reference's prompt, which checks the served preprocessing's placeholder count; the
served greedy tokens (``token_ids``, else the text) must equal the reference's, and the served logprobs of
those tokens the reference's: ``max_abs`` here is over the chosen tokens' logprobs (the API returns no
logits), so the item's ``max_abs_max`` applies to it. A black box returns no tower outputs: those are the
in-process item's (checks/image.py).
"""

from __future__ import annotations

from collections.abc import Mapping
from types import SimpleNamespace
from typing import Any

import torch

from adapt.validate.checklist import Outcome, Skip
from adapt.validate.checks.image import SWEEP, _png_data_url, _reference_pixels, _reference_run, _sizes, \
    sweep_image, thumbnail
from adapt.validate.openai_client import EndpointError

QUESTION = "Describe the image."


def endpoint_image(params: Mapping[str, Any], thresholds: Mapping[str, float], ctx, run, judged) -> Outcome:
    """``run``: the EndpointRunner; ``judged``: checks/endpoint.py's threshold rule for endpoint metrics."""
    from adapt.runtime.vision.processor import expand_placeholders
    from adapt.spec import ModelSpec

    hf = getattr(getattr(ctx.reference, "model", None), "model", None)
    if hf is None or not hasattr(ctx.reference, "path"):
        raise Skip("a golden directory stores no image references yet: validate the image path with "
                   "--reference HF_DIR (transformers)")
    tok = ctx.notes.get("tokenizer")
    if tok is None or not tok.chat_template:
        raise Skip("the reference has no tokenizer with a chat template: image parts go through the chat")
    try:
        import PIL  # noqa: F401
        from transformers import AutoImageProcessor
    except ImportError:
        raise Skip("the image path needs pillow: pip install 'adapt[vision]'") from None
    v = ModelSpec.from_hf_config(hf.config.to_dict()).vision
    proc = AutoImageProcessor.from_pretrained(str(ctx.reference.path), backend="pil")
    base, large = _sizes(proc, v)
    n = int(params.get("max_new_tokens", 4))
    ext = {"return_token_ids": True, "ignore_eos": True}
    rows, images, failures = [], [], []
    for i, (name, ratio) in enumerate(SWEEP):
        im = sweep_image(name, ratio, base, large, seed=i)
        images.append({"name": name, "size": list(im.size), "thumbnail": thumbnail(im)})
        parts = [{"type": "image_url", "image_url": {"url": _png_data_url(im)}}, {"type": "text", "text": QUESTION}]
        doc = run.client.post_negotiated("/v1/chat/completions", run._body(
            messages=[{"role": "user", "content": parts}], max_tokens=n, temperature=0.0, logprobs=True,
            top_logprobs=1), ext)
        ch = (doc.get("choices") or [{}])[0]
        text = (ch.get("message") or {}).get("content") if isinstance(ch, dict) else None
        if not isinstance(text, str):
            raise EndpointError("malformed", f"/v1/chat/completions: no choices[0].message.content: {str(doc)[:200]}")
        pixels, grid, count = _reference_pixels(proc, v, im)
        ids = tok.encode_chat([{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": QUESTION}]}])
        ids = expand_placeholders(ids, [SimpleNamespace(num_tokens=count)], v.image_token_id)
        want = _reference_run(hf, v, ids, pixels, grid, n)[1]
        served_prompt = ch.get("prompt_token_ids") or doc.get("prompt_token_ids")  # adapt: the choice; vLLM: top
        served = ch.get("token_ids")
        row: dict[str, Any] = {"image": name, "size": list(im.size), "reference_tokens": count}
        lps = [e.get("logprob") for e in ((ch.get("logprobs") or {}).get("content") or []) if isinstance(e, dict)]
        same = next((j for j, (a, b) in enumerate(zip(served or [], want)) if a != b), min(len(served or []), n))
        if lps and isinstance(served, list) and same:
            ref_lp = _reference_logprobs(hf, v, ids, want[:same], pixels, grid)
            row["max_abs"] = max(abs(float(a) - b) for a, b in zip(lps[:same], ref_lp))
        if isinstance(served_prompt, list):
            row["prompt_match"] = served_prompt == ids
        else:
            row["prompt_match"] = (doc.get("usage") or {}).get("prompt_tokens") == len(ids)
        if isinstance(served, list):
            short = ch.get("finish_reason") == "stop" and len(served) < n  # a server that ignores ignore_eos
            row["tokens_match"] = served == (want[:len(served)] if short else want)
        else:
            row["tokens_match"] = text == tok.decode(want)
        if not row["prompt_match"]:
            failures.append(f"{name} {im.size[0]}x{im.size[1]}: the served prompt differs from the reference's "
                            f"({count} image tokens there)")
        elif not row["tokens_match"]:
            failures.append(f"{name}: served greedy tokens {served if served is not None else repr(text)} vs "
                            f"reference {want}")
        rows.append(row)
    m = {"images": len(rows), "per_image": rows, "thumbnails": images,
         "prompt_match": sum(r["prompt_match"] for r in rows) / len(rows),
         "token_match": sum(r["tokens_match"] for r in rows) / len(rows)}
    if any("max_abs" in r for r in rows):
        m["max_abs"] = max(r["max_abs"] for r in rows if "max_abs" in r)
    out = judged(m, thresholds, f"{len(rows)} images as image_url data URLs: served prompts and greedy tokens "
                                f"equal the reference's" if not failures else "; ".join(failures))
    if failures and out.status == "pass":
        out = Outcome(m, status="fail", message=out.message)
    return out


@torch.inference_mode()
def _reference_logprobs(hf, vision, ids: list[int], tokens: list[int], pixels, grid) -> list[float]:
    """The reference's logprob of each of ``tokens`` after ``ids`` (one teacher-forced forward with the image)."""
    x = torch.tensor([ids + tokens])
    kw: dict[str, Any] = {"pixel_values": pixels}
    if grid is not None:
        kw.update(image_grid_thw=grid, mm_token_type_ids=(x == vision.image_token_id).int())
    logits = hf(x, use_cache=False, **kw).logits[0, len(ids) - 1: len(ids) - 1 + len(tokens)].float()
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(tokens)[:, None])[:, 0].tolist()
