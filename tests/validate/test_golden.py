"""Golden directories: `adapt validate dump` on the reference machine, compare on the target machine."""

from __future__ import annotations

import json

import pytest
import torch

from adapt.validate.golden import GoldenReference, sample_index
from adapt.validate.reference import HFReference

from .test_validate_cli import models, perturbed, report, run_cli  # noqa: F401  (module fixture)


@pytest.fixture(scope="module")
def golden(models, tmp_path_factory):  # noqa: F811
    out = tmp_path_factory.mktemp("golden")
    assert run_cli("validate", "dump", models["clean"], "--out", out, "--max-new-tokens", "16") == 0
    return out


def test_dump_layout_and_no_pickle(golden, models):  # noqa: F811
    doc = json.loads((golden / "golden.json").read_text())
    assert doc["format"] == "adapt-golden" and len(doc["prompts"]) == 4
    assert {p.name for p in golden.iterdir()} == {"golden.json", "tensors.safetensors"}
    g = GoldenReference(golden)
    h = HFReference(models["clean"])
    assert torch.equal(g.logits(0), h.logits(0))
    assert g.generation(1, 16, 5).tokens == h.generation(1, 16, 5).tokens
    assert g.generation(1, 32, 5) is None  # stored fewer tokens: the check skips, never guesses
    assert set(g.layers(0)) == set(h.layers(0)) and "layers.0.attention" in g.layers(0)
    assert doc["layer_stats"][0]["layers.0"]["absmax"] > 0


def test_target_vs_golden(golden, models, tmp_path):  # noqa: F811
    only = ["--only", "text_inference", "--only", "layer_alignment"]
    assert run_cli("validate", models["clean"], "--reference", golden, "--out", tmp_path / "a", *only) == 0
    assert run_cli("validate", models["oproj"], "--reference", golden, "--out", tmp_path / "b", *only) == 1
    assert report(tmp_path / "b")["first_divergence"]["layer"] == 1


def test_sample_index_is_seeded_and_sorted():
    assert torch.equal(sample_index(64), torch.arange(64))
    a, b = sample_index(7168), sample_index(7168)
    assert torch.equal(a, b) and a.numel() == 256 and bool((a[1:] > a[:-1]).all())


def test_long_rungs_that_would_exhaust_memory_are_skipped_with_the_reason(models, tmp_path):  # noqa: F811
    """The 32K rung of tiny-k2 needs ~52 GB in transformers' CPU attention: `validate dump` was killed by the OOM
    killer on a 24 GB host. A rung over the memory budget is skipped and says why; the ones that fit still run."""
    from adapt.validate.golden import dump_golden
    from adapt.validate.memory import long_prefill_bytes

    ref = HFReference(models["clean"])
    budget = long_prefill_bytes(ref.model.model.config, 64) * 1.5  # 64 fits, 128 (4x) does not
    doc = dump_golden(models["clean"], tmp_path / "g", max_new_tokens=2, long_lengths=(64, 128),
                      memory_budget=budget)
    assert doc["long_context"]["lengths"] == [64]
    (skip,) = doc["long_context"]["skipped"]
    assert skip["length"] == 128 and "attention scores" in skip["reason"]
    assert ref.long_rung_too_big(64, budget) is None and ref.long_rung_too_big(128, budget)
