"""The built-in backends: ``cpu`` (the fused C++ kernels and oneDNN / panel layouts), ``torch`` (the
plain-torch forms, every op, any device) and ``reference`` (the twins, the test oracle). ``triton`` lives
in triton_backend.py.

The functions of adapt/runtime/kernels/*.py are the torch forms; on CPU tensors some of them call the
fused C++ kernel (kernels/fused.py) when it is built. The ``cpu`` backend offers exactly those ops, and
the ops that read a CPU-only packed layout; ``torch`` runs the same functions with the fused module
switched off (``fused.disabled()``), so that ``--kernels torch`` is plain torch on every device.
"""

from __future__ import annotations

import functools

from adapt.runtime.backends.base import OPS, Backend, Impl
from adapt.runtime.kernels import (activation, attention, fused, kv_quant, kv_write, linear_tiled, mla, moe_experts,
                                   moe_routing, moe_tiled, norm, paged_attention, rope)

# op -> module holding it (the twin: the same name with "_ref")
MODULES = {
    "varlen_attention": attention, "paged_decode_attention": paged_attention, "write_kv_cache": kv_write,
    "mla_prefill": mla, "mla_decode": mla, "write_mla_cache": mla, "rms_norm": norm, "fused_add_rms_norm": norm,
    "apply_rope": rope, "softmax_topk": moe_routing, "router_softmax_topk": moe_routing,
    "deepseek_v2_topk": moe_routing, "sigmoid_grouped_topk": moe_routing, "moe_experts": moe_experts,
    "moe_experts_fused": moe_experts, "moe_experts_packed": moe_experts, "moe_experts_tiled": moe_tiled,
    "linear_tiled": linear_tiled, "quantize_int8": kv_quant, "dequantize_int8": kv_quant, "silu_and_mul": activation,
}
assert tuple(MODULES) == OPS

# the ops whose function calls the fused C++ kernel on CPU tensors (itself or through another kernel), or reads a
# layout only the CPU packs
CPU_FORMS = {
    "paged_decode_attention": "C++ fused", "write_kv_cache": "C++ fused", "rms_norm": "C++ fused",
    "fused_add_rms_norm": "C++ fused", "apply_rope": "C++ fused (AVX2 / AVX-512 builds)",
    "silu_and_mul": "C++ fused (AVX2 / AVX-512 builds)", "softmax_topk": "C++ fused top-k",
    "router_softmax_topk": "C++ fused GEMM + top-k on router panels",
    "mla_decode": "absorbed, C++ paged decode over the latent",
    "moe_experts": "stacked experts, C++ gather / combine",
    "moe_experts_fused": "C++ tiled / oneDNN packed / stacked experts (timed at load)",
    "moe_experts_packed": "oneDNN packed experts", "moe_experts_tiled": "C++ tiled GEMM (AMX / AVX512-BF16 / FMA)",
    "linear_tiled": "C++ FMA GEMM on column panels",
}


def _plain(fn):
    """``fn`` with the fused C++ kernels switched off for the call: its torch form."""
    @functools.wraps(fn)
    def run(*args, **kwargs):
        with fused.disabled():
            return fn(*args, **kwargs)
    return run


def _cpu_setup() -> None:
    from adapt.runtime import cpu_kernels

    cpu_kernels.load()  # built once per host (cpu_kernels.py); a failed build leaves the torch forms


def _cpu_prepare(model, device, dtype, ops, prepack: str = "auto") -> None:
    from adapt.runtime.backends.cpu import prepare

    prepare(model, device, dtype, ops, prepack)


CPU = Backend("cpu", {op: Impl(getattr(MODULES[op], op), form=form) for op, form in CPU_FORMS.items()},
              devices=("cpu",), priority=40, setup=_cpu_setup, prepare=_cpu_prepare,
              description="the fused C++ kernels (built for the host) and oneDNN / panel weight layouts")
TORCH = Backend("torch", {op: Impl(_plain(getattr(MODULES[op], op)) if op in CPU_FORMS else getattr(MODULES[op], op),
                                   form="torch") for op in OPS},
                devices=("*",), priority=10, description="the plain-torch forms; every op, any device")
REFERENCE = Backend("reference", {op: Impl(getattr(MODULES[op], op + "_ref"), form="twin") for op in OPS},
                    devices=("*",), priority=0, auto_devices=(),
                    description="the reference twins (the oracle of every kernel test); never picked by auto")
