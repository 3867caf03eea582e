"""The closed-form per-rank weight bytes equal the literal sum over rank_tensors, rank by rank."""

import pytest

from adapt.builtin import BUILTIN_CONFIGS
from adapt.plan import ParallelPlan, check_divisibility, layout_of
from adapt.quantize import quantization_config
from adapt.errors import PlanError
from adapt.profile.planner.search import layouts
from adapt.profile.planner.weights import per_layer, reference_rank_bytes, stage_weights
from adapt.spec import ModelSpec
from tests.fixtures.tiny import MULTIMODAL, TINY, tiny_config

CASES = {**{k: tiny_config(k) for k in list(TINY) + list(MULTIMODAL)},
         **{k: dict(v) for k, v in BUILTIN_CONFIGS.items()},
         "deepseek_v3_fp8": tiny_config("deepseek_v3", num_nextn_predict_layers=1, quantization_config=dict(
             quant_method="fp8", fmt="e4m3", weight_block_size=[8, 8])),
         "llama_int4": tiny_config("llama", quantization_config=quantization_config("int4", group=8, symmetric=False)),
         "deepseek_v3_int8": tiny_config("deepseek_v3", quantization_config=quantization_config("int8"))}


@pytest.mark.parametrize("name", sorted(CASES))
@pytest.mark.parametrize("weights_dtype", [None, "float8_e4m3fn"])
def test_closed_form_equals_rank_tensors(name, weights_dtype):
    spec = ModelSpec.from_hf_config(CASES[name], name=name)
    layout = layout_of(spec)
    tried = 0
    for world in (1, 2, 4, 8):
        for tp, pp, ep, dp in layouts(spec, world):
            try:
                check_divisibility(spec, tp, pp, ep, dp)
            except PlanError:
                continue
            plan = ParallelPlan.build(spec, tp, pp, ep, dp, devices_per_node=4)
            places = per_layer(spec, tp, ep, dp, weights_dtype)
            for rank in range(plan.world_size):
                info = plan.rank_info(rank)
                w = stage_weights(spec, places, info.layers, info.pp == 0, info.pp == pp - 1, include_mtp=True)
                ref = reference_rank_bytes(layout, plan, rank, weights_dtype)
                assert w.bytes == pytest.approx(ref, rel=1e-12), (plan.label(), rank)
            tried += 1
    assert tried >= 3
