import pytest

from adapt.errors import ConfigError, UnsupportedModelError
from adapt.spec import ModelSpec, dtype_bytes, normalize_dtype
from tests.profile.conftest import shared


def test_deepseek_v3_spec():
    s = shared("deepseek-ai__DeepSeek-V3")[0]
    assert s.family == "deepseek" and s.is_mla and s.attention.kv_lora_rank == 512
    assert s.layer_kinds[:3] == ("dense",) * 3 and s.layer_kinds.count("moe") == 58
    assert s.moe.topk_method == "noaux_tc" and s.moe.scoring == "sigmoid" and s.moe.correction_bias
    assert s.quant.block_size == (128, 128) and s.weight_dtype == "float8_e4m3fn" and s.num_mtp_layers == 1
    assert s.rope.type == "yarn"


def test_kimi_is_deepseek_v3():
    s = shared("moonshotai__Kimi-K2-Instruct")[0]
    assert s.model_type == "kimi_k2" and s.family == "deepseek" and s.moe.num_experts == 384
    assert s.layer_kinds.count("dense") == 1


def test_llama_405b_and_llava_defaults():
    s = shared("meta-llama__Llama-3.1-405B")[0]
    assert s.rope.type == "llama3" and s.attention.num_kv_heads == 8 and s.num_layers == 126
    v = shared("llava-hf__llava-1.5-7b-hf")[0]
    # llava-1.5's text_config omits sizes: LlamaConfig defaults
    assert v.hidden_size == 4096 and v.num_layers == 32 and v.vision.kind == "clip" and v.vision.image_size == 336


def test_qwen_moe_and_vl():
    q = shared("Qwen__Qwen3-235B-A22B")[0]
    assert q.attention.qk_norm and q.moe.num_experts == 128 and q.moe.top_k == 8
    vl = shared("Qwen__Qwen2.5-VL-3B-Instruct")[0]
    assert vl.family == "qwen2_5_vl" and vl.text_model_type == "qwen2" and vl.tie_word_embeddings


def test_errors():
    with pytest.raises(UnsupportedModelError, match="supported: llama"):
        ModelSpec.from_hf_config({"model_type": "bert"})
    with pytest.raises(ConfigError, match="JSON object"):
        ModelSpec.from_hf_config([1, 2])
    with pytest.raises(ConfigError, match="must be an integer"):
        ModelSpec.from_hf_config({"model_type": "llama", "hidden_size": "big"})


def test_dtypes():
    assert dtype_bytes("bf16") == 2 and dtype_bytes("fp8") == 1 and dtype_bytes("int4") == 0.5
    assert normalize_dtype("fp8") == "float8_e4m3fn" and normalize_dtype("half") == "float16"
    with pytest.raises(ConfigError):
        dtype_bytes("fp7")


def test_sliding_window_layers_follow_transformers():
    import transformers

    from tests.fixtures.tiny import tiny_config

    def spec(name, **kw):
        return ModelSpec.from_hf_config(tiny_config(name, **kw)).attention

    def saved(mt, **kw):  # the config.json transformers writes (layer_types included)
        return ModelSpec.from_hf_config(transformers.AutoConfig.for_model(mt, **kw).to_dict()).attention

    a = spec("mistral", sliding_window=8)
    assert a.sliding_window == 8 and a.window_layers is None and a.window_of(1) == 8
    assert spec("qwen2", sliding_window=8).window_of(1) is None  # use_sliding_window is off
    a = spec("qwen2", num_hidden_layers=4, use_sliding_window=True, sliding_window=8, max_window_layers=2)
    assert a.window_layers == (2, 3) and [a.window_of(i) for i in range(4)] == [None, None, 8, 8]
    a = spec("qwen2_moe", num_hidden_layers=4, use_sliding_window=True, sliding_window=8, max_window_layers=3)
    assert a.window_layers == (0, 2)
    assert spec("qwen3_moe", use_sliding_window=True, sliding_window=8).window_layers is None
    # transformers' Mistral windows every layer even when a config lists layer_types
    assert spec("mistral", sliding_window=8, layer_types=["full_attention", "sliding_attention"]).window_layers is None
    for mt, kw in (("qwen2", dict(max_window_layers=1)), ("qwen3", dict(max_window_layers=2)),
                   ("qwen2_moe", dict(max_window_layers=3))):
        a = saved(mt, num_hidden_layers=4, use_sliding_window=True, sliding_window=8, **kw)
        types = transformers.AutoConfig.for_model(mt, num_hidden_layers=4, use_sliding_window=True,
                                                  sliding_window=8, **kw).layer_types
        assert a.window_layers == tuple(i for i, t in enumerate(types) if t == "sliding_attention"), mt
    # published configs: Qwen2.5-VL names a 32K window but leaves it off; Mixtral's and Qwen3's are null
    for name in ("Qwen__Qwen2.5-VL-3B-Instruct", "mistralai__Mixtral-8x7B-v0.1", "Qwen__Qwen3-235B-A22B"):
        assert shared(name)[0].attention.window_of(0) is None, name
    with pytest.raises(ConfigError, match="sliding_window"):
        spec("mistral", sliding_window=-3)
    with pytest.raises(ConfigError, match="layer_types"):
        spec("qwen2", use_sliding_window=True, sliding_window=8, layer_types=["sliding_attention"])
