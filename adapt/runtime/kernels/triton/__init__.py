"""Triton kernels beside their twins (the plain-torch ``*_ref`` functions of adapt/runtime/kernels/).

Each function takes the twin's signature and returns what it returns. They run on GPUs and Triton-capable
accelerators, and on CPU tensors under Triton's interpreter (``TRITON_INTERPRET=1``, float32: the
interpreter has no bfloat16 arithmetic), which is how CI tests them. Importing this package needs triton
(``pip install 'adapt[triton]'``); adapt/runtime/backends/triton_backend.py imports it only where present.

Files: norm_act.py (RMSNorm, fused add + RMSNorm, SiLU-and-mul, RoPE), cache.py (KV-cache writes, int8
quantize included), attention.py (paged decode, varlen prefill, MLA prefill), mla.py (absorbed MLA decode),
routing.py (softmax top-k, DeepSeek's sigmoid group-limited top-k), moe.py (the fused MoE).
"""

import torch


def precision(dtype: torch.dtype) -> str:
    """tl.dot's input precision: IEEE float32 for float32 operands (a tf32 dot would miss the twin's 1e-5)."""
    return "ieee" if dtype == torch.float32 else "tf32"


def pow2(n: int, floor: int = 16) -> int:
    """The block size covering n: a power of two, at least ``floor`` (tl.dot's minimum on GPUs is 16)."""
    p = floor
    while p < n:
        p *= 2
    return p
