import pytest
import torch

from adapt.runtime.kernels.mla import (
    mla_decode,
    mla_decode_ref,
    mla_prefill,
    mla_prefill_ref,
    mla_softmax_scale,
    write_mla_cache,
    write_mla_cache_ref,
)
from adapt.runtime.kernels.norm import rms_norm
from adapt.runtime.kernels.rope import apply_rope, rope_cos_sin, rope_inv_freq

from ._tol import assert_fp32_close, assert_lowp_close

pytestmark = pytest.mark.usefixtures("kernel_form")

H, R, DN, DR, DV = 4, 16, 16, 8, 12
BS = 4
LENS = [1, BS, BS + 1, 9]


def _cu(lens):
    return torch.tensor([0] + lens).cumsum(0)


def _inputs(lens, seed=0):
    g = torch.Generator().manual_seed(seed)
    t = sum(lens)
    return dict(
        q_nope=torch.randn(t, H, DN, generator=g),
        q_pe=torch.randn(t, H, DR, generator=g),
        c_kv=torch.randn(t, R, generator=g),
        k_pe=torch.randn(t, DR, generator=g),
        kv_b_weight=torch.randn(H * (DN + DV), R, generator=g) * R**-0.5,
    )


def _cache(lens, c_kv, k_pe, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    maxb = max((n + BS - 1) // BS for n in lens)
    nb = len(lens) * maxb + 2
    perm = torch.randperm(nb, generator=g).tolist()
    tables = torch.full((len(lens), maxb), -1, dtype=torch.long)
    slots = []
    for i, n in enumerate(lens):
        for j in range((n + BS - 1) // BS):
            tables[i, j] = perm.pop()
        slots += [int(tables[i, p // BS]) * BS + p % BS for p in range(n)]
    cache = torch.zeros(nb, BS, R + DR, dtype=dtype)
    write_mla_cache(c_kv, k_pe, cache, torch.tensor(slots))
    ref = torch.zeros_like(cache)
    write_mla_cache_ref(c_kv, k_pe, ref, torch.tensor(slots))
    assert torch.equal(cache, ref)
    return cache, tables


def _last_rows(x, lens):
    return x[_cu(lens)[1:] - 1]


def test_mla_prefill_matches_twin():
    x = _inputs(LENS)
    scale = (DN + DR) ** -0.5
    out = mla_prefill(**x, v_head_dim=DV, cu_seqlens=_cu(LENS), scale=scale)
    assert out.shape == (sum(LENS), H, DV)
    assert_fp32_close(out, mla_prefill_ref(**x, v_head_dim=DV, cu_seqlens=_cu(LENS), scale=scale))


def test_mla_absorbed_decode_matches_naive_and_twin():
    x = _inputs(LENS, seed=1)
    scale = (DN + DR) ** -0.5
    cache, tables = _cache(LENS, x["c_kv"], x["k_pe"])
    qn, qp = _last_rows(x["q_nope"], LENS), _last_rows(x["q_pe"], LENS)  # the newest token of each sequence
    lens = torch.tensor(LENS)
    out = mla_decode(qn, qp, cache, tables, lens, x["kv_b_weight"], DV, scale)
    assert out.shape == (len(LENS), H, DV)
    assert_fp32_close(out, mla_decode_ref(qn, qp, cache, tables, lens, x["kv_b_weight"], DV, scale), "vs twin")
    naive = mla_prefill(**x, v_head_dim=DV, cu_seqlens=_cu(LENS), scale=scale)
    assert_fp32_close(out, _last_rows(naive, LENS), "absorbed vs naive")


def test_mla_bf16_within_2x_of_torch():
    x = _inputs(LENS, seed=2)
    xb = {k: v.bfloat16() for k, v in x.items()}
    scale, cu = (DN + DR) ** -0.5, _cu(LENS)
    ref32 = mla_prefill_ref(**x, v_head_dim=DV, cu_seqlens=cu, scale=scale)
    out = mla_prefill(**xb, v_head_dim=DV, cu_seqlens=cu, scale=scale)
    assert_lowp_close(out, mla_prefill_ref(**xb, v_head_dim=DV, cu_seqlens=cu, scale=scale), ref32, "mla prefill")
    lens = torch.tensor(LENS)
    cache, tables = _cache(LENS, x["c_kv"], x["k_pe"])
    cache_b, _ = _cache(LENS, xb["c_kv"], xb["k_pe"], torch.bfloat16)
    qn, qp = _last_rows(x["q_nope"], LENS), _last_rows(x["q_pe"], LENS)
    ref32 = mla_decode_ref(qn, qp, cache, tables, lens, x["kv_b_weight"], DV, scale)
    args_b = (qn.bfloat16(), qp.bfloat16(), cache_b, tables, lens, xb["kv_b_weight"], DV, scale)
    assert_lowp_close(mla_decode(*args_b), mla_decode_ref(*args_b), ref32, "mla decode")


def test_mla_softmax_scale_yarn_mscale():
    yarn = {"rope_type": "yarn", "factor": 40.0, "mscale": 1.0, "mscale_all_dim": 1.0}
    m = 0.1 * 1.0 * torch.log(torch.tensor(40.0, dtype=torch.float64)).item() + 1.0
    assert mla_softmax_scale(192, yarn) == pytest.approx(192**-0.5 * m * m, rel=1e-12)
    assert mla_softmax_scale(192, None) == 192**-0.5
    assert mla_softmax_scale(192, {"rope_type": "yarn", "factor": 40.0}) == 192**-0.5  # no mscale_all_dim


@pytest.mark.parametrize("rope_interleave", [True, False])
def test_mla_matches_transformers_deepseek_v3_attention(rope_interleave):
    """End to end against transformers' DeepseekV3Attention (eager, fp32, yarn): its projections
    feed our norm, rope, naive prefill and absorbed decode; outputs must agree."""
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3Attention, DeepseekV3RotaryEmbedding

    rope_parameters = {
        "rope_type": "yarn", "factor": 40.0, "mscale": 1.0, "mscale_all_dim": 1.0, "rope_theta": 10000.0,
        "original_max_position_embeddings": 64, "beta_fast": 32, "beta_slow": 1,
    }
    cfg = DeepseekV3Config(
        hidden_size=64, num_attention_heads=H, num_key_value_heads=H, q_lora_rank=32, kv_lora_rank=R,
        qk_rope_head_dim=DR, qk_nope_head_dim=DN, v_head_dim=DV, rope_parameters=rope_parameters,
        max_position_embeddings=2560, rope_interleave=rope_interleave, attn_implementation="eager",
    )
    torch.manual_seed(0)
    attn = DeepseekV3Attention(cfg, 0).eval()
    with torch.no_grad():
        attn.kv_a_layernorm.weight.uniform_(0.5, 1.5)
    n = 9
    hidden = torch.randn(1, n, 64)
    pos = torch.arange(n)
    mask = torch.full((n, n), torch.finfo(torch.float32).min).triu(1)[None, None]
    with torch.no_grad():
        expected, _ = attn(hidden, DeepseekV3RotaryEmbedding(cfg)(hidden, pos[None]), mask)

        q = attn.q_b_proj(attn.q_a_layernorm(attn.q_a_proj(hidden[0]))).view(n, H, DN + DR)
        q_nope, q_pe = q.split([DN, DR], dim=-1)
        c_kv, k_pe = attn.kv_a_proj_with_mqa(hidden[0]).split([R, DR], dim=-1)
        c_kv = rms_norm(c_kv, attn.kv_a_layernorm.weight, attn.kv_a_layernorm.variance_epsilon)
        inv_freq, factor = rope_inv_freq(DR, 10000.0, rope_parameters)
        cos, sin = rope_cos_sin(inv_freq, pos, factor)
        layout = "interleave" if rope_interleave else "rotate_half"
        q_pe = apply_rope(q_pe, cos, sin, layout)
        k_pe = apply_rope(k_pe[:, None], cos, sin, layout)[:, 0]
        scale = mla_softmax_scale(DN + DR, rope_parameters)
        assert scale == attn.scaling
        w = attn.kv_b_proj.weight
        out = mla_prefill(q_nope, q_pe, c_kv, k_pe, w, DV, _cu([n]), scale)
        got = attn.o_proj(out.reshape(n, H * DV))
        assert_fp32_close(got, expected[0], "prefill vs transformers")

        cache, tables = _cache([n], c_kv, k_pe)
        dec = mla_decode(q_nope[-1:], q_pe[-1:], cache, tables, torch.tensor([n]), w, DV, scale)
        assert_fp32_close(attn.o_proj(dec.reshape(1, H * DV)), expected[0, -1:], "decode vs transformers")
