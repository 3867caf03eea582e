"""Routed MoE experts held quantized: each expert's gate|up and down a QuantizedWeight, run over the slots
sorted by expert (kernels/moe_experts.py's grouping and combine), two quantized linears per expert segment.

``prepare`` (load.py) gives an MoE layer one where every expert weight it holds is stored quantized; its
stacked float tensors are then never allocated, and MoE.run_experts hands the experts to it.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from adapt.runtime.kernels.activation import silu_and_mul
from adapt.runtime.kernels.moe_experts import _grouped
from adapt.runtime.quant.weight import QuantizedWeight


class QuantizedExperts(nn.Module):
    """This rank's experts (global ids ``offset`` ..): gate_up[e] [2I, H] (gate rows, then up rows) and
    down[e] [H, I], each a QuantizedWeight."""

    def __init__(self, gate_up: list[QuantizedWeight], down: list[QuantizedWeight], offset: int):
        super().__init__()
        self.gate_up, self.down, self.offset = nn.ModuleList(gate_up), nn.ModuleList(down), offset
        self._pairs = list(zip(gate_up, down))  # plain tuples for the per-expert loop

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """x [T, H], routing weights [T, K], global ids [T, K] -> [T, H] (slots routed elsewhere add 0)."""
        pairs = self._pairs

        def expert(ei: int, xs: torch.Tensor, out: torch.Tensor) -> None:
            gu, dn = pairs[ei]
            out.copy_(dn(silu_and_mul(gu(xs))))

        return _grouped(x, weights, ids, len(pairs), self.offset, expert)

    def form(self) -> str:
        return self.gate_up[0].form() if len(self.gate_up) else "none"
