"""ModelSpec: the normalized architecture of a model, parsed once from an HF ``config.json``.

Every stage reads this one frozen object. Parsing lives in ``adapt.hf_config``: missing keys take the
family's defaults as transformers defines them, so a sparse config such as llava-1.5's ``text_config``
means what it means to transformers.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from typing import Any, Mapping

from adapt.errors import ConfigError, UnsupportedModelError

# family: which runtime model class and which weight-name scheme a model_type uses.
FAMILIES: dict[str, str] = {
    "llama": "llama",
    "mistral": "llama",
    "qwen2": "llama",
    "qwen3": "llama",
    "mixtral": "mixtral",
    "qwen2_moe": "qwen_moe",
    "qwen3_moe": "qwen_moe",
    "deepseek_v2": "deepseek",
    "deepseek_v3": "deepseek",
    "kimi_k2": "deepseek",
    "llava": "llava",
    "qwen2_5_vl": "qwen2_5_vl",
}
SUPPORTED_MODEL_TYPES = tuple(FAMILIES)

_DTYPES = {"float32": "float32", "float": "float32", "bfloat16": "bfloat16", "float16": "float16",
           "half": "float16", "fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


@dataclass(frozen=True)
class RopeSpec:
    """Rotary embedding: type is default | linear | dynamic | llama3 | yarn | mrope."""

    theta: float
    type: str = "default"
    factor: float = 1.0
    rotary_dim: int = 0  # dims of each head that rotate (MLA: qk_rope_head_dim)
    interleave: bool = False  # DeepSeek layout: pairs (2i, 2i+1) rotate together
    params: tuple[tuple[str, Any], ...] = ()  # the remaining scaling parameters, sorted

    def param(self, key: str, default: Any = None) -> Any:
        return dict(self.params).get(key, default)


@dataclass(frozen=True)
class AttentionSpec:
    """Attention of every layer. kind 'gqa' (MHA/GQA/MQA) or 'mla' (DeepSeek multi-head latent)."""

    kind: str
    num_heads: int
    num_kv_heads: int
    head_dim: int  # q/k head dim (MLA: qk_nope + qk_rope)
    v_head_dim: int
    qkv_bias: bool = False
    o_bias: bool = False
    qk_norm: bool = False
    q_lora_rank: int | None = None
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    sliding_window: int | None = None
    window_layers: tuple[int, ...] | None = None  # layers that use the sliding window; None: all of them

    def window_of(self, layer: int) -> int | None:
        """The sliding window of decoder layer ``layer`` (None: it attends to every earlier token)."""
        if not self.sliding_window or (self.window_layers is not None and layer not in self.window_layers):
            return None
        return self.sliding_window


@dataclass(frozen=True)
class MoESpec:
    """Routed experts (and shared experts) of the MoE layers."""

    num_experts: int
    top_k: int
    intermediate_size: int
    num_shared_experts: int = 0
    shared_intermediate_size: int = 0  # total width of the shared expert MLP
    shared_expert_gate: bool = False  # Qwen2-MoE: sigmoid gate on the shared expert
    scoring: str = "softmax"  # softmax | sigmoid
    topk_method: str = "greedy"  # greedy | group_limited_greedy | noaux_tc
    n_group: int = 1
    topk_group: int = 1
    norm_topk_prob: bool = False
    routed_scaling_factor: float = 1.0
    correction_bias: bool = False  # DeepSeek-V3 e_score_correction_bias


@dataclass(frozen=True)
class VisionSpec:
    """Vision tower and projector of a multimodal wrapper. kind 'clip' (llava) or 'qwen2_5_vl'."""

    kind: str
    hidden_size: int
    num_layers: int
    num_heads: int
    intermediate_size: int
    patch_size: int
    image_size: int = 0
    in_channels: int = 3
    temporal_patch_size: int = 1
    spatial_merge_size: int = 1
    out_hidden_size: int = 0
    projector_bias: bool = True
    feature_layer: int = -1
    image_token_id: int | None = None
    hidden_act: str = "quick_gelu"  # the tower's MLP activation (clip: quick_gelu; qwen2_5_vl: silu)
    projector_act: str = "gelu"  # llava's projector activation
    select_strategy: str = "default"  # llava: 'default' drops the class token, 'full' keeps it
    norm_eps: float = 1e-5  # clip LayerNorm eps (qwen2_5_vl's RMSNorms use 1e-6)
    window_size: int = 0  # qwen2_5_vl window attention, in pixels
    fullatt_blocks: tuple[int, ...] = ()  # qwen2_5_vl blocks with full attention
    rope_theta: float = 10000.0  # qwen2_5_vl 2-D vision rope
    vision_start_token_id: int | None = None


@dataclass(frozen=True)
class QuantSpec:
    """Checkpoint weight quantization, as ``quantization_config`` says (parsed in adapt.hf_config):

    - method ``fp8``, fmt ``e4m3`` (DeepSeek-V3 / Kimi-K2): float8_e4m3fn weights with a float32
      ``weight_scale_inv`` per ``block_size`` block;
    - method ``compressed-tensors``, fmt ``int-quantized`` (int8 ``weight`` + ``weight_scale`` [N, 1], one per
      output channel) or ``pack-quantized`` (int4, eight to an int32 ``weight_packed`` [N, K/8], ``weight_scale``
      [N, K/group_size] or [N, 1], ``weight_shape``, and with ``symmetric=False`` a ``weight_zero_point``
      packed along the output dim).

    ``ignore``: module names (or ``re:`` patterns) kept unquantized (``modules_to_not_convert`` / ``ignore``).
    ``activations``: ``int8`` where compressed-tensors quantizes the quantized linears' inputs dynamically per token
    (W8A8, W4A8: symmetric int8, one scale a row); None: weight-only.
    """

    method: str  # fp8 | compressed-tensors
    fmt: str  # e4m3 | int-quantized | pack-quantized
    block_size: tuple[int, int] = (128, 128)  # fp8: the scale block (rows, cols)
    bits: int = 8
    group_size: int | None = None  # int4: columns per scale; None: one scale per output channel
    symmetric: bool = True
    ignore: tuple[str, ...] = ()
    activations: str | None = None

    @property
    def weight_dtype(self) -> str:
        """The dtype name of the quantized matrices: float8_e4m3fn, int8 or int4."""
        return "float8_e4m3fn" if self.method == "fp8" else f"int{self.bits}"

    def quantizes(self, weight_name: str) -> bool:
        """Whether the checkpoint stores this linear weight (``model.layers.0.mlp.up_proj.weight``) quantized."""
        import re

        module = weight_name[: -len(".weight")] if weight_name.endswith(".weight") else weight_name
        for pat in self.ignore:
            if pat.startswith("re:"):
                if re.match(pat[3:], module):
                    return False
            elif module == pat or module.endswith("." + pat) or module.startswith(pat + "."):
                return False
        return True


@dataclass(frozen=True)
class ModelSpec:
    """The normalized architecture. Build it with :meth:`from_hf_config`; never mutate it per rank."""

    model_type: str
    family: str
    hidden_size: int
    vocab_size: int
    num_layers: int
    intermediate_size: int
    attention: AttentionSpec
    rope: RopeSpec
    layer_kinds: tuple[str, ...]  # 'dense' | 'moe' per decoder layer
    moe: MoESpec | None = None
    hidden_act: str = "silu"
    rms_norm_eps: float = 1e-6
    mlp_bias: bool = False
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 2048
    num_mtp_layers: int = 0
    vision: VisionSpec | None = None
    weight_dtype: str = "bfloat16"  # native dtype of the big matrices in the checkpoint
    dtype: str = "bfloat16"  # torch_dtype of the config (norms, embeddings, ...)
    quant: QuantSpec | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    name: str = ""
    text_model_type: str = ""  # for wrappers: the model_type of the language model
    raw_config: str = field(default="{}", repr=False, compare=False)  # the config as read, JSON

    @property
    def is_moe(self) -> bool:
        return self.moe is not None

    @property
    def is_mla(self) -> bool:
        return self.attention.kind == "mla"

    @property
    def moe_layers(self) -> tuple[int, ...]:
        return tuple(i for i, k in enumerate(self.layer_kinds) if k == "moe")

    def config(self) -> dict[str, Any]:
        """The config dict this spec was parsed from."""
        return json.loads(self.raw_config)

    @classmethod
    def from_hf_config(cls, config: Mapping[str, Any], name: str = "") -> "ModelSpec":
        """Parse an HF ``config.json`` dict. Raises ConfigError / UnsupportedModelError with one line."""
        if not isinstance(config, Mapping):
            raise ConfigError("config must be a JSON object")
        mt = config.get("model_type")
        if not mt:
            raise ConfigError("config has no 'model_type'")
        if mt not in FAMILIES:
            raise UnsupportedModelError(
                f"unsupported model_type {mt!r}; supported: {', '.join(SUPPORTED_MODEL_TYPES)}")
        raw = json.dumps(config, sort_keys=True, default=str)
        from adapt.hf_config import parse_multimodal, parse_text

        try:
            if mt in ("llava", "qwen2_5_vl"):
                spec = parse_multimodal(dict(config), mt)
            else:
                spec = parse_text(dict(config), mt)
        except (TypeError, ValueError, KeyError) as e:
            raise ConfigError(f"{mt} config: {e}") from e
        return replace(spec, name=name or str(config.get("_name_or_path", "")), raw_config=raw)


def dtype_bytes(dtype: str) -> float:
    """Bytes per element of a dtype name (fp8 = 1, int4 = 0.5)."""
    table = {"float32": 4, "bfloat16": 2, "float16": 2, "float8_e4m3fn": 1, "fp8": 1, "int8": 1, "int4": 0.5,
             "int32": 4, "int64": 8}
    key = _DTYPES.get(dtype, dtype)
    if key not in table:
        raise ConfigError(f"unknown dtype {dtype!r}; known: {', '.join(sorted(table))}")
    return table[key]


def normalize_dtype(dtype: str) -> str:
    """Canonical dtype name: bf16 -> bfloat16, fp8 -> float8_e4m3fn, ..."""
    if dtype in ("fp8", "float8", "float8_e4m3fn", "e4m3"):
        return "float8_e4m3fn"
    out = _DTYPES.get(dtype, dtype)
    dtype_bytes(out)
    return out


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


__all__ = ["ModelSpec", "AttentionSpec", "MoESpec", "RopeSpec", "VisionSpec", "QuantSpec", "FAMILIES",
           "SUPPORTED_MODEL_TYPES", "dtype_bytes", "normalize_dtype", "ceil_div"]
