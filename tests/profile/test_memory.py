import pytest

from adapt.profile import (activation_peak_bytes, expected_experts, kv_bytes_by_context, kv_bytes_per_token,
                           kv_bytes_per_token_per_layer)
from adapt.spec import ModelSpec
from tests.fixtures.tiny import tiny_config
from tests.profile.conftest import shared


def test_kv_acceptance_values():
    # MLA: 61 layers x (kv_lora_rank 512 + qk_rope_head_dim 64) x 2 bytes, not heads x head_dim
    assert kv_bytes_per_token(shared("deepseek-ai__DeepSeek-V3")[0], "bfloat16") == 70_272
    # GQA: 126 layers x 2 (K, V) x 8 KV heads x 128 x 2 bytes
    assert kv_bytes_per_token(shared("meta-llama__Llama-3.1-405B")[0], "bfloat16") == 516_096
    assert kv_bytes_per_token(shared("moonshotai__Kimi-K2-Instruct")[0]) == 70_272
    assert kv_bytes_per_token(shared("meta-llama__Llama-3.1-8B")[0]) == 32 * 2 * 8 * 128 * 2


def test_kv_dtypes_and_contexts():
    ds = shared("deepseek-ai__DeepSeek-V3")[0]
    assert kv_bytes_per_token(ds, "fp8") == 61 * 576
    assert kv_bytes_per_token(ds, "int8") == 61 * (576 + 4)  # one float32 scale per token (runtime kv_pool)
    llama = shared("meta-llama__Llama-3.1-8B")[0]
    assert kv_bytes_per_token_per_layer(llama, "int8") == 2 * 8 * 128 + 2 * 8 * 4
    by = kv_bytes_by_context(ds)
    assert list(by) == ["1K", "8K", "32K", "128K", "1M"]
    assert by["1K"] == 1024 * 70_272 and by["1M"] == (1 << 20) * 70_272


def test_sliding_window_caps_kv():
    spec = ModelSpec.from_hf_config(tiny_config("mistral", sliding_window=256))
    by = kv_bytes_by_context(spec)
    assert by["1K"] == by["1M"] == 256 * kv_bytes_per_token(spec)


def test_sliding_window_on_some_layers_caps_only_those():
    # qwen2, 4 layers, the window on layers 2 and 3: half the layers hold 256 tokens, half hold them all
    spec = ModelSpec.from_hf_config(tiny_config("qwen2", num_hidden_layers=4, use_sliding_window=True,
                                                sliding_window=256, max_window_layers=2))
    per_layer = kv_bytes_per_token(spec) // 4
    assert kv_bytes_by_context(spec)["8K"] == 2 * per_layer * 256 + 2 * per_layer * 8192


def test_expected_experts():
    assert expected_experts(256, 8, 1) == pytest.approx(8)
    assert expected_experts(256, 8, 10_000) == pytest.approx(256)
    # B = 2 tokens: 256 * (1 - (248/256)^2)
    assert expected_experts(256, 8, 2) == pytest.approx(256 * (1 - (248 / 256) ** 2))


def test_activation_peak_grows_linearly_with_tokens():
    spec = shared("deepseek-ai__DeepSeek-V3")[0]
    a1 = activation_peak_bytes(spec, 1, 4096)
    a2 = activation_peak_bytes(spec, 2, 4096)
    logits = spec.vocab_size * 4
    assert a2 - logits * 2 == pytest.approx(2 * (a1 - logits))
    # the MoE sublayer dominates: 8 routed copies of each token
    h, m = spec.hidden_size, spec.moe
    t = 4096
    moe = (2 * t * m.top_k * h + 3 * t * m.top_k * m.intermediate_size + 3 * t * m.shared_intermediate_size) * 2
    assert a1 == 2 * t * h * 2 + moe + t * m.num_experts * 4 + logits
