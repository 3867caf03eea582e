"""Parse an HF ``config.json`` dict into a ModelSpec.

Missing keys take the family's defaults as transformers defines them (``_DEFAULTS``, read off
transformers 5.x configuration classes). Both spellings transformers has written over the years are
read: ``rope_theta`` + ``rope_scaling`` and ``rope_parameters``; ``torch_dtype`` and ``dtype``;
``num_experts`` and ``num_local_experts``; a nested ``text_config`` or a flat wrapper config.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Mapping

from adapt.errors import ConfigError, UnsupportedModelError
from adapt.spec import (FAMILIES, _DTYPES, AttentionSpec, ModelSpec, MoESpec, QuantSpec, RopeSpec, VisionSpec)

_COMMON = dict(hidden_act="silu", tie_word_embeddings=False, attention_bias=False, rope_theta=10000.0,
               rms_norm_eps=1e-6, mlp_bias=False)
# transformers 5.x configuration defaults, per model_type (only the keys that change shapes or numerics).
_DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": dict(_COMMON, vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                  num_attention_heads=32, max_position_embeddings=2048),
    "mistral": dict(_COMMON, vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                    num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=131072),
    "qwen2": dict(_COMMON, vocab_size=151936, hidden_size=4096, intermediate_size=22016, num_hidden_layers=32,
                  num_attention_heads=32, max_position_embeddings=32768),
    "qwen3": dict(_COMMON, vocab_size=151936, hidden_size=4096, intermediate_size=22016, num_hidden_layers=32,
                  num_attention_heads=32, head_dim=128, max_position_embeddings=32768),
    "mixtral": dict(_COMMON, vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                    num_attention_heads=32, num_key_value_heads=8, rms_norm_eps=1e-5, rope_theta=1e6,
                    num_local_experts=8, num_experts_per_tok=2, max_position_embeddings=131072),
    "qwen2_moe": dict(_COMMON, vocab_size=151936, hidden_size=2048, intermediate_size=5632, num_hidden_layers=24,
                      num_attention_heads=16, num_experts=60, num_experts_per_tok=4, moe_intermediate_size=1408,
                      shared_expert_intermediate_size=5632, decoder_sparse_step=1, mlp_only_layers=[],
                      norm_topk_prob=False, qkv_bias=True, max_position_embeddings=32768),
    "qwen3_moe": dict(_COMMON, vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_hidden_layers=24,
                      num_attention_heads=32, num_key_value_heads=4, num_experts=128, num_experts_per_tok=8,
                      moe_intermediate_size=768, decoder_sparse_step=1, mlp_only_layers=[], norm_topk_prob=False,
                      max_position_embeddings=32768),
    "deepseek_v2": dict(_COMMON, vocab_size=102400, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                        num_attention_heads=32, n_routed_experts=64, n_shared_experts=2, moe_intermediate_size=1407,
                        num_experts_per_tok=None, routed_scaling_factor=1.0, kv_lora_rank=512, q_lora_rank=1536,
                        qk_rope_head_dim=64, v_head_dim=128, qk_nope_head_dim=128, topk_method="greedy",
                        n_group=None, topk_group=None, first_k_dense_replace=0, moe_layer_freq=1,
                        norm_topk_prob=False, scoring_func="softmax", rope_interleave=True,
                        max_position_embeddings=2048),
    "deepseek_v3": dict(_COMMON, vocab_size=129280, hidden_size=7168, intermediate_size=18432, num_hidden_layers=61,
                        num_attention_heads=128, n_routed_experts=256, n_shared_experts=1, moe_intermediate_size=2048,
                        num_experts_per_tok=8, routed_scaling_factor=2.5, kv_lora_rank=512, q_lora_rank=1536,
                        qk_rope_head_dim=64, v_head_dim=128, qk_nope_head_dim=128, topk_method="noaux_tc",
                        n_group=8, topk_group=4, first_k_dense_replace=3, moe_layer_freq=1, norm_topk_prob=True,
                        scoring_func="sigmoid", num_nextn_predict_layers=1, rope_interleave=True,
                        max_position_embeddings=4096),
}
_DEFAULTS["kimi_k2"] = _DEFAULTS["deepseek_v3"]
_VISION_DEFAULTS = {
    # CLIPVisionConfig defaults (transformers); llava-1.5 overrides most of them.
    "clip_vision_model": dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12,
                              image_size=224, patch_size=32, num_channels=3),
    # Qwen2_5_VLVisionConfig defaults.
    "qwen2_5_vl": dict(depth=32, hidden_size=3584, intermediate_size=3420, num_heads=16, in_channels=3,
                       patch_size=14, spatial_merge_size=2, temporal_patch_size=2, out_hidden_size=3584),
}


def _get(cfg: Mapping[str, Any], defaults: Mapping[str, Any], key: str, required: bool = True) -> Any:
    value = cfg.get(key)
    if value is None:
        value = defaults.get(key)
    if value is None and required:
        raise ConfigError(f"config is missing required key {key!r}")
    return value


def _int(cfg, defaults, key, required=True, minimum=1) -> int | None:
    v = _get(cfg, defaults, key, required)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)) or int(v) != v:
        raise ConfigError(f"config key {key!r} must be an integer, got {v!r}")
    if v < minimum:
        raise ConfigError(f"config key {key!r} must be >= {minimum}, got {v}")
    return int(v)


def _rope(cfg: Mapping[str, Any], defaults: Mapping[str, Any], rotary_dim: int, interleave: bool) -> RopeSpec:
    # transformers 5 writes rope_parameters {rope_theta, rope_type, ...}; older configs rope_theta + rope_scaling.
    params = dict(cfg.get("rope_parameters") or {})
    scaling = cfg.get("rope_scaling") or {}
    if not isinstance(scaling, Mapping) or not isinstance(params, Mapping):
        raise ConfigError("rope_scaling / rope_parameters must be an object")
    merged = {**scaling, **params}
    theta = merged.pop("rope_theta", None) or cfg.get("rope_theta") or defaults.get("rope_theta", 10000.0)
    rtype = merged.pop("rope_type", None) or merged.pop("type", None) or "default"
    merged.pop("type", None)
    if rtype == "mrope":  # Qwen2-VL multimodal rope: sections over (t, h, w), base rope otherwise
        rtype = "mrope"
    known = ("default", "linear", "dynamic", "llama3", "yarn", "mrope")
    if rtype not in known:
        raise ConfigError(f"unsupported rope type {rtype!r}; supported: {', '.join(known)}")
    factor = float(merged.pop("factor", 1.0) or 1.0)
    if rtype == "llama3":
        for k in ("low_freq_factor", "high_freq_factor", "original_max_position_embeddings"):
            if k not in merged:
                raise ConfigError(f"rope_scaling llama3 is missing {k!r}")
    clean = tuple(sorted((k, tuple(v) if isinstance(v, list) else v) for k, v in merged.items()))
    return RopeSpec(theta=float(theta), type=rtype, factor=factor, rotary_dim=rotary_dim, interleave=interleave,
                    params=clean)


def _dtype_of(cfg: Mapping[str, Any]) -> str:
    d = cfg.get("torch_dtype") or cfg.get("dtype") or "bfloat16"
    return _DTYPES.get(str(d).replace("torch.", ""), "bfloat16")


def _quant(cfg: Mapping[str, Any]) -> QuantSpec | None:
    q = cfg.get("quantization_config")
    if not q:
        return None
    if not isinstance(q, Mapping):
        raise ConfigError("quantization_config must be a JSON object")
    method = q.get("quant_method")
    if method == "fp8":
        fmt = q.get("fmt", "e4m3")
        block = q.get("weight_block_size") or [128, 128]
        if fmt != "e4m3" or not isinstance(block, (list, tuple)) or len(block) != 2 or min(int(b) for b in block) < 1:
            raise ConfigError(f"quantization_config fp8: fmt must be e4m3 and weight_block_size two positive ints; "
                              f"got fmt={fmt!r} weight_block_size={block!r}")
        return QuantSpec(method="fp8", fmt=fmt, block_size=(int(block[0]), int(block[1])),
                         ignore=tuple(str(m) for m in q.get("modules_to_not_convert") or ()))
    if method == "compressed-tensors":
        return _compressed_tensors(q)
    raise ConfigError(f"unsupported quantization_config.quant_method {method!r}; supported: fp8, compressed-tensors")


_CT_FORMATS = {"int-quantized": 8, "pack-quantized": 4}


def _compressed_tensors(q: Mapping[str, Any]) -> QuantSpec:
    """compressed-tensors' weight-only int8 (int-quantized, per channel) and int4 (pack-quantized, per group or
    channel) schemes: one config group targeting Linear, activations unquantized."""
    groups = q.get("config_groups") or {}
    if not isinstance(groups, Mapping) or len(groups) != 1:
        raise ConfigError(f"quantization_config compressed-tensors: exactly one config group is supported; "
                          f"got {len(groups) if isinstance(groups, Mapping) else groups!r}")
    name, g = next(iter(groups.items()))
    fmt = g.get("format") or q.get("format")
    if fmt not in _CT_FORMATS:
        raise ConfigError(f"unsupported compressed-tensors format {fmt!r}; supported: {', '.join(_CT_FORMATS)}")
    if "Linear" not in (g.get("targets") or ()):
        raise ConfigError(f"compressed-tensors config group {name!r}: targets must include 'Linear'; "
                          f"got {g.get('targets')!r}")
    if g.get("output_activations"):
        raise ConfigError(f"compressed-tensors config group {name!r}: quantized output activations are not "
                          "supported")
    act = _ct_activations(name, g.get("input_activations"))
    w = g.get("weights") or {}
    bits, strategy, group = w.get("num_bits"), w.get("strategy"), w.get("group_size")
    if w.get("type", "int") != "int" or bits != _CT_FORMATS[fmt]:
        raise ConfigError(f"compressed-tensors {fmt}: weights must be type int with num_bits "
                          f"{_CT_FORMATS[fmt]}; got type={w.get('type')!r} num_bits={bits!r}")
    if w.get("actorder") or w.get("dynamic"):
        raise ConfigError(f"compressed-tensors {fmt}: actorder and dynamic weights are not supported")
    if strategy == "channel" or (strategy == "group" and group == -1):
        group = None
    elif strategy == "group" and bits == 4:
        if not isinstance(group, int) or group < 1:
            raise ConfigError(f"compressed-tensors {fmt}: group strategy needs a positive group_size; got {group!r}")
    else:
        raise ConfigError(f"compressed-tensors {fmt}: weight strategy {strategy!r} is not supported "
                          f"(int8: channel; int4: group or channel)")
    symmetric = bool(w.get("symmetric", True))
    if bits == 8 and not symmetric:
        raise ConfigError("compressed-tensors int-quantized: only symmetric int8 weights are supported")
    return QuantSpec(method="compressed-tensors", fmt=fmt, bits=bits, group_size=group, symmetric=symmetric,
                     ignore=tuple(str(m) for m in q.get("ignore") or ()), activations=act)


def _ct_activations(name: str, a: Any) -> str | None:
    """compressed-tensors' input_activations: none (weight-only: W8A16, W4A16) or dynamic symmetric int8 per token
    (W8A8, W4A8) -> "int8"."""
    if not a:
        return None
    if not isinstance(a, Mapping):
        raise ConfigError(f"compressed-tensors config group {name!r}: input_activations must be an object")
    got = {k: a.get(k) for k in ("num_bits", "type", "strategy", "dynamic", "symmetric")}
    if got != {"num_bits": 8, "type": "int", "strategy": "token", "dynamic": True, "symmetric": True}:
        raise ConfigError(f"compressed-tensors config group {name!r}: input activations must be dynamic symmetric "
                          f"int8 per token (num_bits 8, type int, strategy token, dynamic true, symmetric true); "
                          f"got {', '.join(f'{k}={v!r}' for k, v in got.items())}")
    return "int8"


def _eos(cfg: Mapping[str, Any]) -> tuple[int, ...]:
    e = cfg.get("eos_token_id")
    if e is None:
        return ()
    return tuple(int(x) for x in (e if isinstance(e, list) else [e]))


def _sliding_window(cfg: Mapping[str, Any], mt: str, layers: int) -> tuple[int | None, tuple[int, ...] | None]:
    """(window, layers using it; None = all), as transformers 5 applies them: mistral / mixtral window every
    layer, qwen3_moe every layer when ``use_sliding_window``; qwen2 / qwen3 / qwen2_moe follow ``layer_types``
    when the config lists them (transformers writes it on save), else the layers from ``max_window_layers``
    on (qwen2, qwen3) or the even-indexed layers below it (qwen2_moe)."""
    w = cfg.get("sliding_window")
    if mt not in ("mistral", "mixtral") and not cfg.get("use_sliding_window"):
        w = None
    if not w:
        return None, None
    if not isinstance(w, int) or isinstance(w, bool) or w < 1:
        raise ConfigError(f"sliding_window must be a positive integer; got {w!r}")
    if mt in ("mistral", "mixtral", "qwen3_moe"):  # their modeling code windows every layer, layer_types or not
        return w, None
    types = cfg.get("layer_types")
    if types is not None:
        if not isinstance(types, list) or len(types) != layers:
            raise ConfigError(f"layer_types must list one type per layer ({layers}); got {types!r}")
        on = tuple(i for i, t in enumerate(types) if t == "sliding_attention")
    else:
        mwl = int(cfg.get("max_window_layers", 28))
        on = tuple(i for i in range(layers) if (i % 2 == 0 and i < mwl if mt == "qwen2_moe" else i >= mwl))
    return (w, on) if on else (None, None)


def parse_text(cfg: dict[str, Any], mt: str) -> ModelSpec:
    d = _DEFAULTS[mt]
    family = FAMILIES[mt]
    hidden = _int(cfg, d, "hidden_size")
    heads = _int(cfg, d, "num_attention_heads")
    layers = _int(cfg, d, "num_hidden_layers")
    vocab = _int(cfg, d, "vocab_size")
    inter = _int(cfg, d, "intermediate_size")
    kv_heads = _int(cfg, {**d, "num_key_value_heads": d.get("num_key_value_heads", heads)}, "num_key_value_heads")
    if heads % kv_heads:
        raise ConfigError(f"num_attention_heads ({heads}) is not divisible by num_key_value_heads ({kv_heads})")
    bias = bool(_get(cfg, d, "attention_bias", False))
    moe: MoESpec | None = None
    kinds = ["dense"] * layers
    if family == "deepseek":
        q_lora = cfg.get("q_lora_rank", d["q_lora_rank"]) if "q_lora_rank" in cfg else d["q_lora_rank"]
        nope = _int(cfg, d, "qk_nope_head_dim")
        rope_dim = _int(cfg, d, "qk_rope_head_dim")
        attn = AttentionSpec(kind="mla", num_heads=heads, num_kv_heads=heads, head_dim=nope + rope_dim,
                             v_head_dim=_int(cfg, d, "v_head_dim"), qkv_bias=False, o_bias=bias,
                             q_lora_rank=int(q_lora) if q_lora else None, kv_lora_rank=_int(cfg, d, "kv_lora_rank"),
                             qk_nope_head_dim=nope, qk_rope_head_dim=rope_dim)
        rope = _rope(cfg, d, rope_dim, bool(_get(cfg, d, "rope_interleave", False)))
        n_exp = _int(cfg, d, "n_routed_experts", required=False, minimum=0) or 0
        if n_exp:
            top_k = _int(cfg, d, "num_experts_per_tok")
            first_dense = _int(cfg, d, "first_k_dense_replace", minimum=0)
            freq = _int(cfg, d, "moe_layer_freq")
            kinds = ["moe" if (i >= first_dense and i % freq == 0) else "dense" for i in range(layers)]
            method = _get(cfg, d, "topk_method")
            scoring = _get(cfg, d, "scoring_func")
            if mt != "deepseek_v2" and "topk_method" not in cfg:
                method, scoring = "noaux_tc", "sigmoid"
            if method not in ("greedy", "group_limited_greedy", "noaux_tc"):
                raise ConfigError(f"unsupported topk_method {method!r}")
            if scoring not in ("softmax", "sigmoid"):
                raise ConfigError(f"unsupported scoring_func {scoring!r}")
            n_shared = _int(cfg, d, "n_shared_experts", required=False, minimum=0) or 0
            moe_inter = _int(cfg, d, "moe_intermediate_size")
            n_group = _int(cfg, d, "n_group", required=False) or 1
            topk_group = _int(cfg, d, "topk_group", required=False) or 1
            if n_exp % n_group:
                raise ConfigError(f"n_routed_experts ({n_exp}) is not divisible by n_group ({n_group})")
            moe = MoESpec(num_experts=n_exp, top_k=top_k, intermediate_size=moe_inter, num_shared_experts=n_shared,
                          shared_intermediate_size=moe_inter * n_shared, scoring=scoring, topk_method=method,
                          n_group=n_group, topk_group=topk_group,
                          norm_topk_prob=bool(_get(cfg, d, "norm_topk_prob", False)),
                          routed_scaling_factor=float(_get(cfg, d, "routed_scaling_factor")),
                          correction_bias=(method == "noaux_tc"))
        mtp = _int(cfg, d, "num_nextn_predict_layers", required=False, minimum=0) or 0
    else:
        if hidden % heads and cfg.get("head_dim") is None and d.get("head_dim") is None:
            raise ConfigError(f"hidden_size ({hidden}) is not divisible by num_attention_heads ({heads})")
        head_dim = cfg.get("head_dim") or (d.get("head_dim") if mt in ("qwen3",) else None) or hidden // heads
        qkv_bias = True if mt == "qwen2" else bool(cfg.get("qkv_bias", d.get("qkv_bias", bias)))
        o_bias = bias if mt in ("llama", "qwen3", "qwen3_moe", "mistral") else False
        if mt == "mistral":
            o_bias = qkv_bias = False
        window, window_layers = _sliding_window(cfg, mt, layers)
        attn = AttentionSpec(kind="gqa", num_heads=heads, num_kv_heads=kv_heads, head_dim=int(head_dim),
                             v_head_dim=int(head_dim), qkv_bias=qkv_bias, o_bias=o_bias,
                             qk_norm=mt in ("qwen3", "qwen3_moe"), sliding_window=window,
                             window_layers=window_layers)
        rope = _rope(cfg, d, int(head_dim * float(cfg.get("partial_rotary_factor", 1.0))), False)
        if family == "mixtral":
            if "num_local_experts" not in cfg and "num_experts" in cfg:
                cfg["num_local_experts"] = cfg["num_experts"]
            n_exp = _int(cfg, d, "num_local_experts")
            moe = MoESpec(num_experts=n_exp, top_k=_int(cfg, d, "num_experts_per_tok"), intermediate_size=inter,
                          norm_topk_prob=True)
            kinds = ["moe"] * layers
        elif family == "qwen_moe":
            if "num_experts" not in cfg and "num_local_experts" in cfg:  # transformers 5 writes this alias
                cfg["num_experts"] = cfg["num_local_experts"]
            n_exp = _int(cfg, d, "num_experts", minimum=0)
            step = _int(cfg, d, "decoder_sparse_step")
            only = set(cfg.get("mlp_only_layers") or [])
            kinds = ["moe" if (i not in only and n_exp > 0 and (i + 1) % step == 0) else "dense" for i in range(layers)]
            shared = _int(cfg, d, "shared_expert_intermediate_size", required=False, minimum=0) or 0
            if n_exp:
                moe = MoESpec(num_experts=n_exp, top_k=_int(cfg, d, "num_experts_per_tok"),
                              intermediate_size=_int(cfg, d, "moe_intermediate_size"),
                              num_shared_experts=1 if shared else 0, shared_intermediate_size=shared,
                              shared_expert_gate=bool(shared), norm_topk_prob=bool(_get(cfg, d, "norm_topk_prob")))
        mtp = 0
    if moe is not None and moe.top_k > moe.num_experts:
        raise ConfigError(f"num_experts_per_tok ({moe.top_k}) exceeds the number of experts ({moe.num_experts})")
    quant = _quant(cfg)
    dtype = _dtype_of(cfg)
    return ModelSpec(
        model_type=mt, family=family, hidden_size=hidden, vocab_size=vocab, num_layers=layers,
        intermediate_size=inter, attention=attn, rope=rope, layer_kinds=tuple(kinds), moe=moe,
        hidden_act=str(_get(cfg, d, "hidden_act")), rms_norm_eps=float(_get(cfg, d, "rms_norm_eps")),
        mlp_bias=bool(cfg.get("mlp_bias", False)) if family == "llama" else False,
        tie_word_embeddings=bool(_get(cfg, d, "tie_word_embeddings", False)),
        max_position_embeddings=int(_get(cfg, d, "max_position_embeddings")), num_mtp_layers=mtp,
        weight_dtype=quant.weight_dtype if quant else dtype, dtype=dtype, quant=quant,
        bos_token_id=cfg.get("bos_token_id"), eos_token_ids=_eos(cfg), text_model_type=mt)


def _feature_layer(v: Any) -> int:
    if isinstance(v, (list, tuple)):  # several layers concatenated (llava-next style): not in adapt's runtime
        raise UnsupportedModelError(f"vision_feature_layer {list(v)}: several feature layers are not supported")
    return int(v)


def parse_multimodal(cfg: dict[str, Any], mt: str) -> ModelSpec:
    vcfg = dict(cfg.get("vision_config") or {})
    if mt == "llava":
        tcfg = dict(cfg.get("text_config") or {"model_type": "llama"})
        tmt = tcfg.get("model_type", "llama")
        if tmt not in FAMILIES or FAMILIES[tmt] != "llama":
            raise UnsupportedModelError(f"llava text_config.model_type {tmt!r} is not supported (llama, mistral, qwen2)")
        tcfg.setdefault("tie_word_embeddings", cfg.get("tie_word_embeddings", False))
        tcfg.setdefault("torch_dtype", cfg.get("torch_dtype") or cfg.get("dtype"))
        text = parse_text(tcfg, tmt)
        vd = _VISION_DEFAULTS["clip_vision_model"]
        vision = VisionSpec(kind="clip", hidden_size=_int(vcfg, vd, "hidden_size"),
                            num_layers=_int(vcfg, vd, "num_hidden_layers"),
                            num_heads=_int(vcfg, vd, "num_attention_heads"),
                            intermediate_size=_int(vcfg, vd, "intermediate_size"),
                            patch_size=_int(vcfg, vd, "patch_size"), image_size=_int(vcfg, vd, "image_size"),
                            in_channels=_int(vcfg, vd, "num_channels"), out_hidden_size=text.hidden_size,
                            projector_bias=bool(cfg.get("multimodal_projector_bias", True)),
                            feature_layer=_feature_layer(cfg.get("vision_feature_layer", -2)),
                            image_token_id=cfg.get("image_token_index", cfg.get("image_token_id")),
                            hidden_act=str(vcfg.get("hidden_act", "quick_gelu")),
                            projector_act=str(cfg.get("projector_hidden_act", "gelu")),
                            select_strategy=str(cfg.get("vision_feature_select_strategy", "default")),
                            norm_eps=float(vcfg.get("layer_norm_eps", 1e-5)))
    else:
        # qwen2_5_vl: older configs hold the text model at the top level; transformers 5 nests text_config.
        tcfg = dict(cfg.get("text_config") or {k: v for k, v in cfg.items() if k != "vision_config"})
        tcfg["model_type"] = "qwen2"
        for k in ("tie_word_embeddings", "torch_dtype", "dtype", "rope_scaling", "rope_theta", "eos_token_id"):
            if k in cfg and k not in tcfg:
                tcfg[k] = cfg[k]
        text = parse_text(tcfg, "qwen2")
        vd = _VISION_DEFAULTS["qwen2_5_vl"]
        vision = VisionSpec(kind="qwen2_5_vl", hidden_size=_int(vcfg, vd, "hidden_size"),
                            num_layers=_int(vcfg, vd, "depth"), num_heads=_int(vcfg, vd, "num_heads"),
                            intermediate_size=_int(vcfg, vd, "intermediate_size"),
                            patch_size=_int(vcfg, vd, "patch_size"),
                            in_channels=int(vcfg.get("in_channels", vcfg.get("in_chans", 3))),
                            temporal_patch_size=_int(vcfg, vd, "temporal_patch_size"),
                            spatial_merge_size=_int(vcfg, vd, "spatial_merge_size"),
                            out_hidden_size=_int(vcfg, vd, "out_hidden_size"),
                            image_token_id=cfg.get("image_token_id"), hidden_act=str(vcfg.get("hidden_act", "silu")),
                            norm_eps=1e-6, window_size=int(vcfg.get("window_size", 112)),
                            fullatt_blocks=tuple(int(i) for i in vcfg.get("fullatt_block_indexes", (7, 15, 23, 31))),
                            rope_theta=float((vcfg.get("rope_parameters") or {}).get("rope_theta", 10000.0)),
                            vision_start_token_id=cfg.get("vision_start_token_id"))
    if vision.hidden_size % vision.num_heads:
        raise ConfigError(f"vision hidden_size ({vision.hidden_size}) is not divisible by its heads ({vision.num_heads})")
    return replace(text, model_type=mt, family=FAMILIES[mt], vision=vision, text_model_type=text.model_type)
