"""Which model class runs which ModelSpec family."""

from __future__ import annotations

from adapt.errors import UnsupportedModelError
from adapt.runtime.models.decoder import CausalLM
from adapt.runtime.models.deepseek import DeepseekForCausalLM
from adapt.runtime.models.llama import LlamaForCausalLM
from adapt.runtime.models.llava import LlavaForConditionalGeneration
from adapt.runtime.models.qwen2_vl import Qwen2_5_VLForConditionalGeneration
from adapt.spec import ModelSpec

MODELS: dict[str, type[CausalLM]] = {
    "llama": LlamaForCausalLM,  # llama, mistral, qwen2, qwen3
    "mixtral": LlamaForCausalLM,
    "qwen_moe": LlamaForCausalLM,  # qwen2_moe, qwen3_moe
    "deepseek": DeepseekForCausalLM,  # deepseek_v2, deepseek_v3, kimi_k2
    "llava": LlavaForConditionalGeneration,  # llava-1.5 (CLIP tower, llama-family text model)
    "qwen2_5_vl": Qwen2_5_VLForConditionalGeneration,
}


def model_class(spec: ModelSpec) -> type[CausalLM]:
    """The runtime model class of a spec, or UnsupportedModelError naming the family."""
    cls = MODELS.get(spec.family)
    if cls is None:
        raise UnsupportedModelError(f"adapt run has no model for family {spec.family!r} ({spec.model_type}); "
                                    f"supported: {', '.join(MODELS)}")
    return cls
