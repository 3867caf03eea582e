import pytest

from tests.fixtures.tiny import save_tiny

# Variants beyond tests/fixtures/tiny.py TINY: yarn rope on a llama, rope on-the-side for deepseek_v3,
# sliding-window attention.
VARIANTS = {
    "llama_yarn": ("llama", dict(head_dim=None, rope_scaling=dict(rope_type="yarn", factor=4.0,
                                                                  original_max_position_embeddings=64))),
    "qwen2_tied_gqa4": ("qwen2", dict(num_key_value_heads=1, tie_word_embeddings=True)),
    "deepseek_v3_no_interleave": ("deepseek_v3", dict(rope_interleave=False)),
    # sliding windows shorter than the prompts and generations: every layer (mistral), the layers from
    # max_window_layers on (qwen2), the even layers below it (qwen2_moe)
    "mistral_window5": ("mistral", dict(sliding_window=5)),
    "qwen2_window5_from1": ("qwen2", dict(use_sliding_window=True, sliding_window=5, max_window_layers=1)),
    "qwen2_moe_window3_even": ("qwen2_moe", dict(use_sliding_window=True, sliding_window=3, max_window_layers=3)),
}


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
    """(hf_model, dir) per family name, saved once per session."""
    cache = {}

    def get(name):
        if name not in cache:
            base, over = VARIANTS.get(name, (name, {}))
            over = {k: v for k, v in over.items() if v is not None}
            d = tmp_path_factory.mktemp(name)
            cache[name] = save_tiny(base, d, **over)
        return cache[name]

    return get
