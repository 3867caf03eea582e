"""Gated activations.

# Legend: N rows ("..." any leading dims), I intermediate size.
"""

import torch
import torch.nn.functional as F


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x [..., 2I] = cat(gate, up) -> silu(gate) * up [..., I] (transformers' `chunk(2)` order)."""
    gate, up = x.chunk(2, dim=-1)  # [..., I] each
    return F.silu(gate) * up


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    """Reference twin: silu written out as g * sigmoid(g)."""
    i = x.shape[-1] // 2
    gate, up = x[..., :i], x[..., i:]
    return gate * torch.sigmoid(gate) * up
