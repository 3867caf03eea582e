"""RoPE against transformers' own functions and classes, bit for bit in float32."""

import pytest
import torch
from transformers import DeepseekV2Config, DeepseekV3Config, LlamaConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2RotaryEmbedding, apply_rotary_emb
from transformers.models.deepseek_v3.modeling_deepseek_v3 import (
    DeepseekV3RotaryEmbedding,
    apply_rotary_pos_emb_interleave,
)
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

from adapt.runtime.kernels.rope import apply_rope, apply_rope_ref, rope_cos_sin, rope_inv_freq

from ._tol import assert_fp32_close

pytestmark = pytest.mark.usefixtures("kernel_form")

THETA = 500000.0
SCALINGS = {
    "default": {"rope_type": "default"},
    "linear": {"rope_type": "linear", "factor": 4.0},
    "llama3": {
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 256,
    },
    "yarn": {"rope_type": "yarn", "factor": 16.0, "original_max_position_embeddings": 256},
    "yarn_betas": {
        "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 512, "beta_fast": 16, "beta_slow": 2,
    },
    "yarn_deepseek_mscale": {
        "rope_type": "yarn", "factor": 40.0, "original_max_position_embeddings": 4096,
        "mscale": 1.0, "mscale_all_dim": 0.707,
    },
}
POSITIONS = torch.tensor([0, 1, 2, 255, 256, 4095, 4096, 70000])


def _llama(scaling, head_dim=64):
    return LlamaConfig(
        hidden_size=head_dim * 4, num_attention_heads=4, head_dim=head_dim, max_position_embeddings=8192,
        rope_parameters={**scaling, "rope_theta": THETA},
    )


@pytest.mark.parametrize("name", list(SCALINGS))
def test_inv_freq_and_cos_sin_bit_exact_vs_llama_rotary(name):
    rotary = LlamaRotaryEmbedding(_llama(SCALINGS[name]))
    inv_freq, factor = rope_inv_freq(64, THETA, SCALINGS[name], max_position_embeddings=8192)
    assert torch.equal(inv_freq, rotary.inv_freq)
    assert factor == rotary.attention_scaling
    x = torch.zeros(1, len(POSITIONS), 8)
    cos_t, sin_t = rotary(x, POSITIONS[None])
    cos, sin = rope_cos_sin(inv_freq, POSITIONS, factor)
    assert torch.equal(cos, cos_t[0]) and torch.equal(sin, sin_t[0])


@pytest.mark.parametrize("name", ["linear", "llama3", "yarn", "yarn_deepseek_mscale"])
def test_partial_rotary_factor_vs_transformers_init(name):
    cfg = _llama({**SCALINGS[name], "partial_rotary_factor": 0.5})
    inv_t, factor_t = ROPE_INIT_FUNCTIONS[SCALINGS[name]["rope_type"]](cfg)
    inv_freq, factor = rope_inv_freq(32, THETA, SCALINGS[name])
    assert inv_freq.shape == (16,)
    assert torch.equal(inv_freq, inv_t) and factor == factor_t


def test_apply_rotate_half_bit_exact_and_partial():
    g = torch.Generator().manual_seed(0)
    q = torch.randn(len(POSITIONS), 4, 64, generator=g)
    cos, sin = rope_cos_sin(rope_inv_freq(64, THETA, SCALINGS["llama3"])[0], POSITIONS)
    expected, _ = apply_rotary_pos_emb(q.transpose(0, 1)[None], q.transpose(0, 1)[None], cos[None], sin[None])
    assert torch.equal(apply_rope(q, cos, sin), expected[0].transpose(0, 1))
    assert_fp32_close(apply_rope_ref(q, cos, sin), expected[0].transpose(0, 1))
    # partial: rotate the first 32 dims, pass the rest
    cos32, sin32 = rope_cos_sin(rope_inv_freq(32, THETA)[0], POSITIONS)
    q32 = q[..., :32].transpose(0, 1)[None]
    part, _ = apply_rotary_pos_emb(q32, q32, cos32[None], sin32[None])
    got = apply_rope(q, cos32, sin32)
    assert torch.equal(got[..., :32], part[0].transpose(0, 1)) and torch.equal(got[..., 32:], q[..., 32:])
    assert torch.equal(apply_rope_ref(q, cos32, sin32)[..., 32:], q[..., 32:])


def _deepseek_v3(rope_parameters):
    return DeepseekV3Config(
        hidden_size=256, num_attention_heads=4, num_key_value_heads=4, qk_rope_head_dim=64, qk_nope_head_dim=128,
        v_head_dim=128, kv_lora_rank=32, q_lora_rank=64, max_position_embeddings=163840,
        rope_parameters=rope_parameters,
    )


def test_deepseek_v3_yarn_interleave_on_64_of_192_dims():
    params = {
        "rope_type": "yarn", "factor": 40.0, "mscale": 1.0, "mscale_all_dim": 1.0, "rope_theta": 10000.0,
        "original_max_position_embeddings": 4096, "beta_fast": 32, "beta_slow": 1,
    }
    rotary = DeepseekV3RotaryEmbedding(_deepseek_v3(params))
    inv_freq, factor = rope_inv_freq(64, 10000.0, params)
    assert inv_freq.shape == (32,) and torch.equal(inv_freq, rotary.inv_freq) and factor == rotary.attention_scaling
    x = torch.zeros(1, len(POSITIONS), 8)
    cos_t, sin_t = rotary(x, POSITIONS[None])
    cos, sin = rope_cos_sin(inv_freq, POSITIONS, factor)
    assert torch.equal(cos, cos_t[0]) and torch.equal(sin, sin_t[0])

    g = torch.Generator().manual_seed(1)
    q = torch.randn(len(POSITIONS), 4, 192, generator=g)  # [nope 128 | rope 64]
    k_pe = torch.randn(len(POSITIONS), 1, 64, generator=g)
    q_t, k_t = apply_rotary_pos_emb_interleave(
        q[..., 128:].transpose(0, 1)[None], k_pe.transpose(0, 1)[None], cos_t, sin_t
    )
    assert torch.equal(apply_rope(q[..., 128:], cos, sin, "interleave"), q_t[0].transpose(0, 1))
    assert torch.equal(apply_rope(k_pe, cos, sin, "interleave"), k_t[0].transpose(0, 1))
    assert_fp32_close(apply_rope_ref(q[..., 128:], cos, sin, "interleave"), q_t[0].transpose(0, 1))


def test_deepseek_v2_complex_pairs_layout():
    params = {
        "rope_type": "yarn", "factor": 40.0, "mscale": 0.707, "mscale_all_dim": 0.707, "rope_theta": 10000.0,
        "original_max_position_embeddings": 4096,
    }
    cfg = DeepseekV2Config(
        hidden_size=256, num_attention_heads=4, qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128,
        kv_lora_rank=32, q_lora_rank=64, max_position_embeddings=163840, rope_parameters=params,
    )
    freqs_cis = DeepseekV2RotaryEmbedding(cfg)(torch.zeros(1), POSITIONS[None])
    inv_freq, factor = rope_inv_freq(64, 10000.0, params)
    cos, sin = rope_cos_sin(inv_freq, POSITIONS, factor)
    g = torch.Generator().manual_seed(2)
    q = torch.randn(len(POSITIONS), 4, 64, generator=g)
    q_t, _ = apply_rotary_emb(q.transpose(0, 1)[None], q.transpose(0, 1)[None], freqs_cis)
    # complex multiply vs real arithmetic: equal up to rounding, not bit for bit
    assert_fp32_close(apply_rope(q, cos, sin, "interleave_pairs"), q_t[0].transpose(0, 1))
    assert_fp32_close(apply_rope_ref(q, cos, sin, "interleave_pairs"), q_t[0].transpose(0, 1))


def test_bf16_cos_sin_and_unknown_inputs():
    inv_freq, _ = rope_inv_freq(16, 10000.0)
    cos, _ = rope_cos_sin(inv_freq, POSITIONS, dtype=torch.bfloat16)
    assert cos.dtype == torch.bfloat16
    with pytest.raises(ValueError, match="rope_type"):
        rope_inv_freq(16, 10000.0, {"rope_type": "longrope"})
    with pytest.raises(ValueError, match="layout"):
        apply_rope(torch.zeros(1, 1, 16), *rope_cos_sin(inv_freq, POSITIONS[:1]), layout="gptj")
