"""Individual checks on a tiny model: operators vs twins (fp32 and the bf16 2x rule), the long-context
ladder's rungs and skips, skip reasons when a stage is missing, and first-divergence localisation."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from adapt.validate.checklist import Skip
from adapt.validate.checks.layers import locate_first_divergence
from adapt.validate.checks.loading import manifest_verify, staged_init
from adapt.validate.checks.operators import operator_alignment
from adapt.validate.checks.image import image_path
from adapt.validate.checks.paths import long_context, parallel_consistency
from adapt.validate.context import ValidationContext
from adapt.validate.reference import HFReference, TransformersModel
from adapt.validate.target import Target
from tests.fixtures.tiny import save_tiny


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    _, d = save_tiny("llama", tmp_path_factory.mktemp("m") / "llama", max_position_embeddings=256)
    return d


def _ctx(path: Path, dtype: str = "float32", runner=None) -> ValidationContext:
    ref = HFReference(path)
    run = runner if runner is not None else ref.model
    return ValidationContext(Target(path, "hf", "transformers", run), ref, dtype)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_operator_alignment_every_kernel(tiny, dtype):
    out = operator_alignment({"kernels": "all"}, {}, _ctx(tiny, dtype))
    from dataclasses import fields

    from adapt.runtime.kernels import get_kernels
    from adapt.validate.checks.operators import SHARED

    every = [f.name for f in fields(get_kernels("adapt")) if f.name not in ("impl", "backends") and f.name not in SHARED]
    # the kernels a host may not run: the tiled MoE kernel (bfloat16 needs AMX or AVX512-BF16), the tiled linear
    # (float32 only) and the oneDNN-packed MoE kernel where the CPU cannot pack the dtype (bfloat16 on AMD Zen 3);
    # reported, not passed
    from adapt.runtime.kernels.linear_tiled import linear_tiles
    from adapt.runtime.kernels.moe_experts import onednn_packs
    from adapt.runtime.kernels.moe_tiled import tiles

    skipped = ([] if tiles(64, 64, getattr(torch, dtype)) else ["moe_experts_tiled"]) + \
        ([] if linear_tiles(128, 96, getattr(torch, dtype)) else ["linear_tiled"]) + \
        ([] if onednn_packs(getattr(torch, dtype)) else ["moe_experts_packed"])
    assert out.metrics["kernels"] == len(every) - len(skipped) and out.metrics["kernels_without_case"] == 0
    assert out.metrics["kernels_unsupported_here"] == len(skipped)
    # every MoE expert path the runtime may pick on this host is checked on its own, against the same twin
    paths = ["padded", "loop"] + (["grouped"] if hasattr(torch, "_grouped_mm") else [])
    assert all(f"moe_experts_fused[{p}].max_abs" in out.metrics for p in paths), out.message
    assert out.metrics["moe_paths_checked"] == len(paths) and "not offered" not in out.message
    # where the fused CPU kernels are built, both the fused and the torch form of each are checked
    from adapt.validate.checks.operators import FUSED

    fused_on = out.metrics["fused_cpu_kernels"].startswith("on (")
    forms = [n for n in FUSED if n not in skipped]
    assert out.metrics["torch_forms_checked"] == (len(forms) if fused_on else 0)
    assert all(f"{n}[torch].max_abs" in out.metrics for n in forms) or not fused_on
    if dtype == "float32":
        assert out.metrics["max_abs"] <= 1e-5  # [twin]
    else:
        assert out.metrics["max_abs_vs_torch_ratio"] <= 2.0  # [fa2x]


def test_operator_alignment_float16_reports_what_this_cpu_cannot_pack(tiny):
    # float16 oneDNN packing needs AVX512-FP16 / AVX-NE-CONVERT; without them the packed MoE kernel is
    # reported as not runnable here, and every other kernel is still checked. The tiled MoE kernel and the
    # tiled linear run float16 where the build's vector layer converts it (F16C, AVX-512), the linear only
    # where oneDNN has no native float16 linear: each reported where it does not run.
    from adapt.runtime import cpu_kernels
    from adapt.runtime.kernels.linear_tiled import linear_tiles
    from adapt.runtime.kernels.moe_experts import onednn_packs
    from adapt.runtime.kernels.moe_tiled import tiles

    cpu_kernels.load()
    out = operator_alignment({"kernels": "all"}, {}, _ctx(tiny, "float16"))
    packed = not onednn_packs(torch.float16)
    tiled, linear = not tiles(128, 64, torch.float16), not linear_tiles(128, 96, torch.float16)
    assert out.metrics["kernels_unsupported_here"] == packed + tiled + linear, out.message
    assert ("moe_experts_packed" in out.message) == packed and ("moe_experts_tiled" in out.message) == tiled
    assert ("linear_tiled" in out.message) == linear
    if not linear:
        assert "linear_tiled.max_abs" in out.metrics or "linear_tiled[fused].max_abs" in out.metrics, out.metrics
    assert out.metrics["max_abs_vs_torch_ratio"] <= 2.0


def test_long_context_ladder_runs_what_fits_and_says_why_not(tiny):
    ctx = _ctx(tiny)
    out = long_context({"lengths": [64, 128, 1024]}, {}, ctx)
    assert out.metrics["rungs"] == 2 and out.metrics["max_abs"] == 0.0
    assert "1024: beyond max_position_embeddings 256" in out.message
    with pytest.raises(Skip, match="no rung ran"):
        long_context({"lengths": [1024]}, {}, ctx)


def test_missing_stages_skip_with_reasons(tiny):
    ctx = _ctx(tiny)
    for fn, why in ((manifest_verify, "not an `adapt shard` output"), (staged_init, "adapt's runtime"),
                    (image_path, "text-only"), (parallel_consistency, "distributed runtime")):
        with pytest.raises(Skip, match=why):
            fn({}, {}, ctx)


class _Scaled(TransformersModel):
    """The reference with layer 0's MLP output scaled: the first divergence must be layers.0.mlp."""

    def layer_outputs(self, ids):
        out = super().layer_outputs(ids)
        out["layers.0.mlp"] = out["layers.0.mlp"] * 1.1
        out["layers.1"] = out["layers.1"] + 1e-3
        return out


def test_first_divergence_is_the_earliest_module(tiny):
    run = _Scaled.load(tiny)
    fd = locate_first_divergence(_ctx(tiny, runner=run))
    assert fd["layer"] == 0 and fd["module"] == "mlp" and fd["name"] == "layers.0.mlp"
    assert locate_first_divergence(_ctx(tiny)) is None
