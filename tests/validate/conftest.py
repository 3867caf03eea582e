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


def make_endpoint_report() -> Report:
    """An --endpoint run's ladder (one rung beyond the reference, one whose top-1 differs) and load levels."""
    rungs = []
    for k, length in enumerate((1024, 8192, 32768)):
        lat = {"p50": 0.02 * 4 ** k, "p90": 0.025 * 4 ** k, "p99": 0.03 * 4 ** k, "n": 3}
        r = {"length": length, "seconds": lat["p50"], "compared": length < 32768, "latency_s": lat}
        r.update({"top1_match": float(length != 8192), "logprob_max_abs": 1e-5 * 10 ** k} if r["compared"]
                 else {"why_not_compared": "beyond the reference's max_position_embeddings 8192"})
        rungs.append(r)
    levels = [{"concurrency": c, "completed": 8, "failed": 0,
               "ttft_s": {"mean": 0.01 * c, "p50": 0.01 * c, "p90": 0.015 * c, "p99": 0.02 * c},
               "itl_s": {"mean": 0.005, "p50": 0.005, "p90": 0.006, "p99": 0.008},
               "e2e_s": {"mean": 0.1 * c, "p50": 0.1 * c, "p90": 0.12 * c, "p99": 0.15 * c},
               "request_throughput": 1.0 * c, "output_tokens_per_s": 100.0 * c ** 0.8} for c in (1, 2, 4, 8)]
    items = [
        ItemResult("long_context_ladder", "long_context", "Ladder", "fail", True,
                   {"top1_agreement": 0.5, "logprob_max_abs": 1e-4, "max_length": 32768, "rungs": rungs},
                   {"logprob_max_abs_max": 2e-4, "top1_agreement_min": 1.0}, "top1_agreement = 0.5 < 1"),
        ItemResult("serving_load", "serving", "Load", "pass", False,
                   {"levels": levels, "failed": 0, "max_concurrency": 8}, {"failed_max": 0}, "ok"),
    ]
    env = collect_environment(model="served", device="endpoint", dtype="float32")
    return Report(items, env, None, [], checklist="day0")
