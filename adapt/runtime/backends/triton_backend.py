"""The ``triton`` backend: the Triton kernels of adapt/runtime/kernels/triton/ for GPUs and Triton-capable
accelerators; on CPU only under Triton's interpreter (``TRITON_INTERPRET=1``, float32), which is how the
kernels are tested and never what ``auto`` picks. Without triton installed it reports itself unavailable.
"""

from __future__ import annotations

import importlib.util
import os
import sys

import torch

from adapt.runtime.backends.base import FLOATS, Backend, Impl

DEVICES = ("cuda", "xpu", "cpu")  # torch's "cuda" is also ROCm's HIP devices


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def missing() -> str | None:
    """Why triton cannot be imported here (None when it can)."""
    if importlib.util.find_spec("triton") is None:
        return "triton is not installed (pip install 'adapt[triton]')"
    return None


def _probe(device_type: str, dtype: torch.dtype) -> str | None:
    why = missing()
    if why is not None:
        return why
    if device_type == "cpu":
        if not interpreting():
            return "Triton runs on CPU tensors only under its interpreter (TRITON_INTERPRET=1)"
        if _imported_compiled():
            return ("triton was imported before TRITON_INTERPRET=1 was set in this process: set it before "
                    "the process starts")
        if dtype != torch.float32:
            return "Triton's interpreter has no bfloat16 / float16 arithmetic here; use --dtype float32"
    return None


def _imported_compiled() -> bool:
    """Triton fixes at its first import whether its language functions run interpreted; a process that imported
    it before turning the interpreter on cannot run the kernels on CPU."""
    tl = sys.modules.get("triton.language")
    if tl is None:
        return False
    from triton.runtime.interpreter import InterpretedFunction
    return not isinstance(getattr(tl, "sum", None), InterpretedFunction)


# op -> (module under adapt.runtime.kernels.triton, what it is)
OPS = {
    "rms_norm": ("norm_act", "one pass per row"), "fused_add_rms_norm": ("norm_act", "add + RMSNorm, one pass"),
    "silu_and_mul": ("norm_act", "one pass"), "apply_rope": ("norm_act", "per token and head"),
    "write_kv_cache": ("cache", "slot scatter, int8 quantize"), "write_mla_cache": ("cache", "slot scatter"),
    "paged_decode_attention": ("attention", "paged, GQA heads per program, window, int8"),
    "varlen_attention": ("attention", "tiled online softmax, cached prefix"),
    "mla_prefill": ("attention", "kv_b GEMM + varlen kernel"),
    "mla_decode": ("mla", "absorbed, all heads per program, latent read once"),
    "softmax_topk": ("routing", "per token"), "router_softmax_topk": ("routing", "GEMM + softmax top-k"),
    "sigmoid_grouped_topk": ("routing", "group-limited, per token"),
    "moe_experts_fused": ("moe", "sort by expert, grouped GEMM, combine"),
}


class _Lazy:
    """An op's function, imported from the Triton module on first call (importing triton costs ~1 s)."""

    def __init__(self, module: str, name: str):
        self.module, self.name, self.fn = module, name, None
        self.__name__ = name

    def __call__(self, *args, **kwargs):
        if self.fn is None:
            mod = importlib.import_module(f"adapt.runtime.kernels.triton.{self.module}")
            self.fn = getattr(mod, self.name)
        return self.fn(*args, **kwargs)


TRITON = Backend("triton", {op: Impl(_Lazy(mod, op), FLOATS, f"triton: {what}") for op, (mod, what) in OPS.items()},
                 devices=DEVICES, priority=50, auto_devices=("cuda", "xpu"), probe=_probe,
                 description="Triton kernels (GPUs, Triton-capable accelerators; CPU under TRITON_INTERPRET=1)")
