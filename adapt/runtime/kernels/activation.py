"""Gated activations.

# Legend: N rows ("..." any leading dims), I intermediate size.
"""

import torch
import torch.nn.functional as F

from . import fused


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x [..., 2I] = cat(gate, up) -> silu(gate) * up [..., I] (transformers' `chunk(2)` order)."""
    ext = fused.vectorized()
    if ext is not None and x.device.type == "cpu" and x.dtype in (torch.float32, torch.bfloat16) and x.numel() \
            and not x.requires_grad:
        return ext.silu_and_mul(x.contiguous())  # one pass, rounding as the two ops do
    gate, up = x.chunk(2, dim=-1)  # [..., I] each
    return F.silu(gate) * up


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    """Reference twin: silu written out as g * sigmoid(g)."""
    i = x.shape[-1] // 2
    gate, up = x[..., :i], x[..., i:]
    return gate * torch.sigmoid(gate) * up
