import pytest

from tests.fixtures.tiny import save_tiny

# Variants beyond tests/fixtures/tiny.py TINY: yarn rope on a llama, rope on-the-side for deepseek_v3.
VARIANTS = {
    "llama_yarn": ("llama", dict(head_dim=None, rope_scaling=dict(rope_type="yarn", factor=4.0,
                                                                  original_max_position_embeddings=64))),
    "qwen2_tied_gqa4": ("qwen2", dict(num_key_value_heads=1, tie_word_embeddings=True)),
    "deepseek_v3_no_interleave": ("deepseek_v3", dict(rope_interleave=False)),
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
