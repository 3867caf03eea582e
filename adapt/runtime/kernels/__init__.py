"""Kernels: pure functions, each beside a plain-torch reference twin (the test oracle).

`get_kernels("adapt")` returns the kernels, `get_kernels("reference")` the twins under the same
names and signatures, so the runtime can switch with one flag (`--kernels adapt|reference`).
Configuration math without a twin (rope_inv_freq, rope_cos_sin, mla_softmax_scale,
router_logits) is the same in both.
"""

from dataclasses import dataclass, field
from typing import Callable

from . import (activation, attention, kv_quant, kv_write, linear_tiled, mla, moe_experts, moe_routing, moe_tiled, norm,
               paged_attention, rope)

IMPLS = ("adapt", "reference")

# name -> module holding it; the twin is the same name with "_ref" appended
_TWINNED = {
    "varlen_attention": attention,
    "paged_decode_attention": paged_attention,
    "write_kv_cache": kv_write,
    "mla_prefill": mla,
    "mla_decode": mla,
    "write_mla_cache": mla,
    "rms_norm": norm,
    "fused_add_rms_norm": norm,
    "apply_rope": rope,
    "softmax_topk": moe_routing,
    "router_softmax_topk": moe_routing,
    "deepseek_v2_topk": moe_routing,
    "sigmoid_grouped_topk": moe_routing,
    "moe_experts": moe_experts,
    "moe_experts_fused": moe_experts,
    "moe_experts_packed": moe_experts,
    "moe_experts_tiled": moe_tiled,
    "linear_tiled": linear_tiled,
    "quantize_int8": kv_quant,
    "dequantize_int8": kv_quant,
    "silu_and_mul": activation,
}
_SHARED = {
    "rope_inv_freq": rope,
    "rope_cos_sin": rope,
    "mla_softmax_scale": mla,
    "router_logits": moe_routing,
}


@dataclass(frozen=True)
class Kernels:
    """The kernel set one runtime uses; ``impl`` says which ("adapt" or "reference" here; a ``--kernels``
    value when adapt.runtime.backends.select_kernels built it) and ``backends`` the backend of each op."""

    impl: str
    varlen_attention: Callable
    paged_decode_attention: Callable
    write_kv_cache: Callable
    mla_prefill: Callable
    mla_decode: Callable
    write_mla_cache: Callable
    rms_norm: Callable
    fused_add_rms_norm: Callable
    apply_rope: Callable
    softmax_topk: Callable
    router_softmax_topk: Callable
    deepseek_v2_topk: Callable
    sigmoid_grouped_topk: Callable
    moe_experts: Callable
    moe_experts_fused: Callable
    moe_experts_packed: Callable
    moe_experts_tiled: Callable
    linear_tiled: Callable
    quantize_int8: Callable
    dequantize_int8: Callable
    silu_and_mul: Callable
    rope_inv_freq: Callable
    rope_cos_sin: Callable
    mla_softmax_scale: Callable
    router_logits: Callable
    backends: dict = field(default_factory=dict, compare=False)


def shared_functions() -> dict[str, Callable]:
    """The configuration math every kernel set shares (no twin: one function)."""
    return {name: getattr(mod, name) for name, mod in _SHARED.items()}


def get_kernels(impl: str = "adapt") -> Kernels:
    """The kernel set for impl "adapt" (the kernels) or "reference" (their plain-torch twins)."""
    if impl not in IMPLS:
        raise ValueError(f"unknown kernel implementation {impl!r}; expected one of {', '.join(IMPLS)}")
    suffix = "" if impl == "adapt" else "_ref"
    fns = {name: getattr(mod, name + suffix) for name, mod in _TWINNED.items()}
    fns.update(shared_functions())
    return Kernels(impl=impl, **fns)


__all__ = ["IMPLS", "Kernels", "get_kernels", "shared_functions"]
