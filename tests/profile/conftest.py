import functools
import json

import pytest

from adapt.layout import WeightLayout
from adapt.spec import ModelSpec
from tests.fixtures.configs import SHARED_CONFIGS

CONFIGS = SHARED_CONFIGS


@functools.lru_cache(maxsize=None)
def shared(name: str) -> tuple[ModelSpec, WeightLayout]:
    """Spec and layout of one shared config (parsed once per test session: Kimi-K2 takes ~0.6 s)."""
    path = CONFIGS / f"{name}.json"
    if not path.is_file():
        pytest.skip(f"{path} not present")
    spec = ModelSpec.from_hf_config(json.loads(path.read_text()), name=name)
    return spec, WeightLayout.from_spec(spec)


SHARED = ["moonshotai__Kimi-K2-Instruct", "deepseek-ai__DeepSeek-V3", "Qwen__Qwen3-235B-A22B",
          "meta-llama__Llama-3.1-405B", "meta-llama__Llama-3.1-8B", "mistralai__Mixtral-8x7B-v0.1",
          "llava-hf__llava-1.5-7b-hf", "Qwen__Qwen2.5-VL-3B-Instruct"]
