"""Matmul FLOPs of the profile against torch.utils.flop_counter.FlopCounterMode running transformers.

Each tiny model of tests/fixtures/tiny.py runs a prefill of B x P tokens (logits of the last position
only, as generation does) and one decode step from its cache. FlopCounterMode reports FLOPs per module
(mm / addmm / bmm, 2*M*K*N each): every linear layer, the MoE experts as executed, and the attention
matmuls (the self_attn module's FLOPs minus its linear children). Compared within 2%:

- linear rows (gemm, router, expert_gemm, lm_head) by module name. transformers' "eager" experts run a
  loop over the experts that received tokens, each on exactly its routed tokens, so its FLOPs are the
  top-k FLOPs the profile counts (a dense "all experts" implementation would not be);
- attention: transformers' eager attention multiplies the full L x L score matrix and masks it; the
  profile counts the causal L(L+1)/2 pairs a flash kernel computes, so prefill is compared after
  scaling transformers' figure by (P+1)/(2P). Decode attends P+1 keys (the cache plus the new token),
  the profile's context at decode;
- MLA: transformers caches the latent and re-expands all of it with kv_b_proj every decode step, so the
  comparison uses ``mla_absorb=False``; the absorbed form (the profile's default) is checked to have the
  same linear FLOPs per token as kv_b_proj on one token.
"""

from __future__ import annotations

import json
import warnings

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from adapt.hardware import load_hardware
from adapt.profile import profile_model
from adapt.spec import ModelSpec
from tests.fixtures.tiny import MULTIMODAL, TINY, build_model, tiny_config

B, P = 2, 12
MATMUL_OPS = ("gemm", "router", "expert_gemm", "lm_head")


def _norm_name(name: str) -> str:
    if name.endswith("lm_head"):
        return "lm_head"
    i = name.find("layers.")
    return name[i:].replace("block_sparse_moe.", "mlp.") if i >= 0 else name


def _run(name: str):
    cfg = tiny_config(name)
    model = build_model(cfg)
    model.set_attn_implementation("eager")
    try:
        model.set_experts_implementation("eager")
    except (AttributeError, ValueError):
        pass
    ids = torch.randint(3, 200, (B, P), generator=torch.Generator().manual_seed(0))
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pre = FlopCounterMode(display=False)
        with pre:
            out = model(input_ids=ids, use_cache=True, logits_to_keep=1)
        dec = FlopCounterMode(display=False)
        with dec:
            model(input_ids=ids[:, -1:], past_key_values=out.past_key_values, use_cache=True)
    hf_cfg = json.loads(model.config.to_json_string())
    return ModelSpec.from_hf_config(hf_cfg), pre.get_flop_counts(), dec.get_flop_counts()


def _by_module(counts) -> dict[str, int]:
    return {_norm_name(k): sum(v.values()) for k, v in counts.items() if "layers." in k or k.endswith("lm_head")}


def _rows(prof, phase):
    return {_norm_name(r.name): r for r in prof.rows(phase)}


@pytest.fixture(scope="module")
def hw():
    return load_hardware("h100-sxm")


@pytest.mark.parametrize("name", list(TINY) + list(MULTIMODAL))
def test_matmul_flops_match_flop_counter(name, hw):
    spec, pre_counts, dec_counts = _run(name)
    for phase, counts, context in (("prefill", pre_counts, P), ("decode", dec_counts, P + 1)):
        prof = profile_model(spec, hw, phase=phase, batch=B, context=context, act_dtype="float32",
                             mla_absorb=False)
        hf = _by_module(counts)
        rows = _rows(prof, phase)
        checked = 0
        for n, r in rows.items():
            if r.op not in MATMUL_OPS:
                continue
            assert n in hf, f"{name} {phase}: {n} ran no matmul in transformers"
            assert r.flops == pytest.approx(hf[n], rel=0.02), f"{name} {phase} {n}"
            checked += 1
        # every module transformers ran a matmul in is a row of the profile
        linear_hf = {n for n in hf if not n.endswith("self_attn") and n.count(".") > 2 or n == "lm_head"}
        missing = {n for n in linear_hf if n not in rows and not n.endswith(("mlp", "mlp.shared_experts",
                                                                              "mlp.shared_expert"))}
        assert not missing, f"{name} {phase}: profile lacks {sorted(missing)}"
        # attention matmuls: self_attn minus its linear children
        for i in range(spec.num_layers):
            attn = f"layers.{i}.self_attn"
            children = sum(v for k, v in hf.items() if k.startswith(attn + "."))
            hf_attn = hf[attn] - children
            ours = rows[f"{attn}.attn"].flops
            if phase == "prefill":
                hf_attn = hf_attn * (P + 1) / (2 * P)  # causal pairs vs the masked full square
            assert ours == pytest.approx(hf_attn, rel=0.02), f"{name} {phase} {attn}"
        assert checked >= 4 * spec.num_layers


def test_mla_absorbed_decode_keeps_linear_flops(hw):
    spec = ModelSpec.from_hf_config(tiny_config("deepseek_v3"))
    absorbed = _rows(profile_model(spec, hw, phase="decode", batch=3, context=50), "decode")
    a = spec.attention
    kvb_one_token = 2 * 3 * a.kv_lora_rank * a.num_heads * (a.qk_nope_head_dim + a.v_head_dim)
    for i in range(spec.num_layers):
        p = f"layers.{i}.self_attn.kv_b_proj"
        assert absorbed[p + ".k_absorb"].flops + absorbed[p + ".v_absorb"].flops == kvb_one_token
        assert "absorbed" in absorbed[f"layers.{i}.self_attn.attn"].note
        # attention over the latent: scores on r + rope dims, values on r dims, 50 keys
        assert absorbed[f"layers.{i}.self_attn.attn"].flops == 2 * 3 * a.num_heads * 50 * (
            2 * a.kv_lora_rank + a.qk_rope_head_dim)
