import json

import pytest

from adapt.hardware import load_hardware
from adapt.profile import profile_model
from adapt.spec import ModelSpec
from tests.fixtures.tiny import tiny_config
from tests.profile.conftest import SHARED, shared


@pytest.fixture(scope="module")
def h100():
    return load_hardware("h100-sxm")


@pytest.mark.parametrize("name", SHARED)
def test_decode_flops_are_two_per_active_param(name, h100):
    """Decode FLOPs per token at a short context ~ 2 x the parameters a token multiplies by.

    That is ``active`` minus the input embedding (a gather, no FLOPs; a tied table is still multiplied by
    as lm_head) minus the vision tower (not run for text tokens). For every shared config this is within
    1%; against the literal 2 x ``active`` the gap is the embedding share (Llama-3.1-8B: 6.5%).
    """
    spec, layout = shared(name)
    prof = profile_model(spec, h100, phase="decode", batch=1, context=16, layout=layout)
    p = prof.params
    matmul_params = p["active"] - p["vision"] - (0 if spec.tie_word_embeddings else p["embedding"])
    assert prof.totals["decode"]["flops_per_token"] == pytest.approx(2 * matmul_params, rel=0.05)
    assert prof.totals["decode"]["flops_per_token"] == pytest.approx(2 * matmul_params, rel=0.01)


def test_json_contract_kimi(h100):
    spec, layout = shared("moonshotai__Kimi-K2-Instruct")
    d = profile_model(spec, h100, batch=4, context=2048, layout=layout).to_dict()
    json.dumps(d)
    assert d["model"]["model_type"] == "kimi_k2" and d["model"]["family"] == "deepseek" and "name" in d["model"]
    assert d["params"]["total"] == 1_026_408_232_448
    assert set(d["params"]) >= {"total", "active", "embedding", "lm_head", "mtp", "active_non_embedding", "vision"}
    m = d["memory"]
    assert m["kv_bytes_per_token"] == 70_272 and set(m["kv_bytes_by_context"]) == {"1K", "8K", "32K", "128K", "1M"}
    assert m["weights_bytes"] == layout.weight_bytes() and m["activation_peak_bytes"] > 0
    names = {r["name"] for r in d["modules"]}
    assert "layers.3.mlp.experts" in names and "layers.0.mlp.gate_proj" in names and "lm_head" in names
    row = next(r for r in d["modules"] if r["name"] == "layers.3.mlp.experts" and r["phase"] == "decode")
    for k in ("op", "flops", "bytes", "weight_bytes", "act_read_bytes", "act_write_bytes", "kv_read_bytes",
              "kv_write_bytes", "intensity", "bound", "time_s", "input_shape", "output_shape"):
        assert k in row
    assert row["op"] == "expert_gemm" and row["bound"] == "memory"
    assert d["totals"]["prefill"]["ttft_s"] > 0 and d["totals"]["decode"]["tpot_s"] > 0
    # the roofline time is the max of the two limits
    r = d["modules"][5]
    peak = h100.peak_flops(r["compute_dtype"])
    assert r["time_s"] == pytest.approx(max(r["flops"] / peak, r["bytes"] / h100.memory_bandwidth))


def test_moe_weight_bytes_use_expected_experts(h100):
    spec, layout = shared("deepseek-ai__DeepSeek-V3")
    expert = 3 * 7168 * 2048 + 3 * 16 * 56 * 4  # fp8 bytes of gate, up, down plus their 128x128 scales
    for batch in (1, 4, 64):
        rows = profile_model(spec, h100, phase="decode", batch=batch, context=64, layout=layout).rows("decode")
        ex = next(r for r in rows if r.name == "layers.3.mlp.experts")
        assert ex.weight_bytes == pytest.approx(256 * (1 - (1 - 8 / 256) ** batch) * expert)
        assert ex.flops == 2 * batch * 8 * 3 * 7168 * 2048


def test_prefill_rows_read_every_weight_once(h100):
    """A long prefill touches every expert: summed row weight bytes = the layout's weight bytes, less
    the embedding table (a prefill gathers only its rows) and the MTP layer (not profiled)."""
    for name, dtype in (("deepseek-ai__DeepSeek-V3", None), ("Qwen__Qwen3-235B-A22B", "fp8"),
                        ("meta-llama__Llama-3.1-8B", "bfloat16")):
        spec, layout = shared(name)
        prof = profile_model(spec, h100, phase="prefill", batch=8, context=4096, weights_dtype=dtype, layout=layout)
        rows = prof.rows("prefill")
        emb = next(r for r in rows if r.op == "embedding")
        table = layout.weight_bytes(dtype and "float8_e4m3fn" if dtype == "fp8" else dtype)
        got = sum(r.weight_bytes for r in rows) - emb.weight_bytes
        emb_bytes = spec.vocab_size * spec.hidden_size * 2
        assert got == pytest.approx(table - emb_bytes, rel=1e-6), name


def test_identical_layers_costed_once_but_emitted_per_layer(h100):
    spec, layout = shared("moonshotai__Kimi-K2-Instruct")
    prof = profile_model(spec, h100, phase="decode", layout=layout)
    rows = [r for r in prof.rows("decode") if r.module == "mlp.experts"]
    assert [r.layer for r in rows] == list(range(1, 61))
    assert len({(r.flops, r.weight_bytes) for r in rows}) == 1


def test_multimodal_profiles_language_model_and_vision(h100):
    for name in ("llava-hf__llava-1.5-7b-hf", "Qwen__Qwen2.5-VL-3B-Instruct"):
        spec, layout = shared(name)
        prof = profile_model(spec, h100, phase="both", layout=layout)
        vision = prof.rows("vision")
        assert vision and prof.totals["vision"]["time_per_image_s"] > 0
        vision_params = sum(r.flops for r in vision if r.op == "gemm")
        assert vision_params > 0 and prof.params["vision"] > 0
    llava = profile_model(shared("llava-hf__llava-1.5-7b-hf")[0], h100, phase="prefill")
    q = next(r for r in llava.rows("vision") if r.name == "vision_tower.encoder.layers.0.self_attn.q_proj")
    assert q.input_shape == (577, 1024)  # 24 x 24 patches + class token at 336 px


def test_gqa_prefill_attention_is_causal(h100):
    spec = ModelSpec.from_hf_config(tiny_config("llama"))
    prof = profile_model(spec, h100, phase="prefill", batch=3, context=100)
    a = spec.attention
    attn = next(r for r in prof.rows("prefill") if r.name == "layers.0.self_attn.attn")
    assert attn.flops == 2 * 3 * a.num_heads * (100 * 101 // 2) * (a.head_dim + a.v_head_dim)
    assert attn.kv_write_bytes == 3 * 100 * 2 * a.num_kv_heads * a.head_dim * 2


def test_bounds_follow_the_ridge_point(h100):
    spec, layout = shared("meta-llama__Llama-3.1-8B")
    prof = profile_model(spec, h100, batch=1, context=4096, layout=layout)
    q_pre = next(r for r in prof.rows("prefill") if r.name == "layers.0.self_attn.q_proj")
    q_dec = next(r for r in prof.rows("decode") if r.name == "layers.0.self_attn.q_proj")
    assert q_pre.bound == "compute" and q_dec.bound == "memory"
    assert q_dec.intensity < h100.ridge_point("bfloat16") < q_pre.intensity


def test_bad_arguments(h100):
    from adapt.errors import AdaptError

    spec = ModelSpec.from_hf_config(tiny_config("llama"))
    with pytest.raises(AdaptError, match="phase"):
        profile_model(spec, h100, phase="train")
    with pytest.raises(AdaptError, match="dtype"):
        profile_model(spec, h100, weights_dtype="float7")
