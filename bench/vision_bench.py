"""adapt's image path against transformers on the same VLM and image: the vision encoder alone and the whole
prefill with the image (encoder + projector + language model), float32 and bfloat16, for a llava-1.5-shaped and
a Qwen2.5-VL-shaped model of a few tens of millions of parameters built here (random weights, save_pretrained).

Prints one JSON document: per model and dtype, median milliseconds of adapt and transformers and the median of
their per-pair ratios (transformers / adapt: above 1 is adapt faster), after a warm-up, the two timed alternately.
The host is whatever runs it: on a shared machine say so next to the figures (``--threads 1`` keeps a
loaded host's descheduled OpenMP threads out of both sides' times; both run in this process with the same
torch thread count). The prompt is the same for both (adapt's placeholder expansion, the image's token count
from the same processor settings); transformers computes the last position's logits only
(``logits_to_keep=1``), as adapt does, and neither side keeps a KV cache.

    python bench/vision_bench.py [--dtypes float32,bfloat16] [--repeats 7] [--threads N]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from adapt.runtime.engine import Engine  # noqa: E402
from adapt.runtime.vision.processor import expand_placeholders  # noqa: E402
from tests.fixtures.tiny import build_model  # noqa: E402

MODELS = {
    "llava": dict(model_type="llava", image_token_index=31999, vision_feature_layer=-2,
                  text_config=dict(model_type="llama", hidden_size=512, intermediate_size=1408, num_hidden_layers=6,
                                   num_attention_heads=8, num_key_value_heads=8, vocab_size=32000),
                  vision_config=dict(model_type="clip_vision_model", hidden_size=384, intermediate_size=1536,
                                     num_hidden_layers=8, num_attention_heads=6, image_size=336, patch_size=14,
                                     projection_dim=384)),
    "qwen2_5_vl": dict(model_type="qwen2_5_vl", image_token_id=31998, vision_start_token_id=31997,
                       vision_end_token_id=31999, video_token_id=31996,
                       text_config=dict(hidden_size=512, intermediate_size=1408, num_hidden_layers=6,
                                        num_attention_heads=8, num_key_value_heads=2, vocab_size=32000,
                                        rope_scaling={"type": "mrope", "mrope_section": [8, 12, 12]}),
                       vision_config=dict(depth=8, hidden_size=384, intermediate_size=1024, num_heads=6,
                                          out_hidden_size=512, fullatt_block_indexes=[3, 7], window_size=112)),
}


def _processor(kind):
    if kind == "llava":
        from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil
        return CLIPImageProcessorPil(size={"shortest_edge": 336}, crop_size={"height": 336, "width": 336})
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
    return Qwen2VLImageProcessorPil(min_pixels=56 * 56, max_pixels=448 * 448)


def _image():
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(0)
    return Image.fromarray(rng.integers(0, 255, size=(360, 480, 3)).astype("uint8"), "RGB")


def _paired_ms(ours, ref, repeats) -> dict:
    """Both warmed up, then timed alternately (ours, ref, ours, ...) so a load that drifts on a shared host
    slows both alike: median ms of each and the median of the per-pair ratios (ref / ours)."""
    for _ in range(2):  # oneDNN compiles its primitives on the first call of a shape
        ours(), ref()
    a, r = [], []
    for _ in range(repeats):
        for fn, ts in ((ours, a), (ref, r)):
            t0 = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t0)
    return {"adapt": round(statistics.median(a) * 1e3, 2), "transformers": round(statistics.median(r) * 1e3, 2),
            "ratio": round(statistics.median(y / x for x, y in zip(a, r)), 3)}


def bench(kind, dtypes, repeats):
    out = {}
    with tempfile.TemporaryDirectory() as d:
        model = build_model(MODELS[kind])
        model.save_pretrained(d)
        _processor(kind).save_pretrained(d)
        im = _image()
        for dt in dtypes:
            tdt = getattr(torch, dt)
            eng = Engine.from_pretrained(d, dtype=dt)
            ref = model.to(tdt)
            pre = eng.image_processor()(im)
            tid = eng.spec.vision.image_token_id
            ids = expand_placeholders([1, 100, 200, tid, 300, 400], [pre], tid)
            hf = _processor(kind)(images=[im], return_tensors="pt")
            x = torch.tensor([ids])
            kw = dict(pixel_values=hf["pixel_values"].to(tdt))
            if kind == "qwen2_5_vl":
                kw.update(image_grid_thw=hf["image_grid_thw"], mm_token_type_ids=(x == tid).int())

            def ref_encoder():
                with torch.inference_mode():
                    if kind == "llava":
                        ref.model.get_image_features(pixel_values=kw["pixel_values"])
                    else:
                        ref.model.visual(kw["pixel_values"], grid_thw=kw["image_grid_thw"])

            def ref_prefill():
                with torch.inference_mode():
                    ref(x, use_cache=False, logits_to_keep=1, **kw)

            def our_encoder():
                with torch.inference_mode():
                    eng.model.encode_images([pre], eng.kernels)

            out[dt] = {"image_tokens": pre.num_tokens, "prompt_tokens": len(ids),
                       "encoder_ms": _paired_ms(our_encoder, ref_encoder, repeats),
                       # last_only: the last position's logits, as transformers' logits_to_keep=1
                       "prefill_ms": _paired_ms(lambda: eng.prefill(ids, images=[pre], last_only=True), ref_prefill,
                                                repeats)}
            model = ref.float()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--models", default="llava,qwen2_5_vl")
    ap.add_argument("--threads", type=int, default=0, help="torch threads for both sides (0: torch's default)")
    a = ap.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    import transformers

    doc = {"host": {"machine": platform.machine(), "processor": platform.processor(), "threads": torch.get_num_threads(),
                    "torch": torch.__version__, "transformers": transformers.__version__,
                    "loadavg_start": [round(x, 2) for x in os.getloadavg()]},
           "models": {k: bench(k, a.dtypes.split(","), a.repeats) for k in a.models.split(",")}}
    doc["host"]["loadavg_end"] = [round(x, 2) for x in os.getloadavg()]
    print(json.dumps(doc, indent=1))


if __name__ == "__main__":
    main()
