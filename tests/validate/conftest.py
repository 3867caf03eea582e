from __future__ import annotations

import math

import pytest

from adapt.validate.records import ItemResult, Report, collect_environment

XSS = "<script>alert(1)</script>"


def make_report(model: str = "tiny-kimi") -> Report:
    items = [
        ItemResult("prefill_logits", "text_inference", "Prefill logits", "pass", True,
                   {"cosine": 0.999995, "max_abs": 2e-5, "kl_mean": 1e-9, "top1_agreement": 1.0},
                   {"cosine_min": 0.99999, "max_abs_max": 1e-4}, "", 0.5),
        ItemResult("hidden_states", "layer_alignment", "Hidden states", "pass", True,
                   {"cosine": 0.99999, "max_abs": 5e-5}, {"cosine_min": 0.99}, "", 0.2),
        ItemResult("image_path", "image_inference", "Image path", "skip", False, {}, {}, "no vision tower"),
        ItemResult("parallel_tp2", "multi_device", "TP2", "skip", True, {}, {}, "no distributed runtime"),
        ItemResult("kv_int8_impact", "kv_cache_quant", "KV int8", "fail", False,
                   {"top1_agreement": 0.97, "ppl_delta": math.nan}, {"top1_agreement_min": 0.99},
                   "top1_agreement = 0.97 < 0.99"),
    ]
    curve = [{"layer": i, "name": f"model.layers.{i}", "max_abs": 1e-6 * 3 ** i, "max_rel": 1e-5,
              "cosine": 1 - 1e-9 * 3 ** i, "growth": 3.0} for i in range(4)]
    env = collect_environment(model=model, device="cpu", dtype="float32", checkpoint_hash="sha256:ab12",
                              manifest_hash="sha256:cd34", plan={"tp": 1})
    return Report(items, env, {"layer": 2, "module": "model.layers.2"}, curve, checklist="day0")


@pytest.fixture
def report() -> Report:
    return make_report()
