"""Routed MoE experts held quantized: each expert's gate|up and down a QuantizedWeight.

``prepare`` (load.py) gives an MoE layer one where every expert weight it holds is stored quantized; its
stacked float tensors are then never allocated, and MoE.run_experts hands the experts to it. Once the model
is materialized (loader.materialize calls ``materialized``), every expert's quantized values, scales and zero
points become views of one [E, ...] tensor per kind, so that a decode step of up to DECODE_TOKENS tokens runs
all the routed experts in one call of the fused kernel (kernels/quant_linear.py's quant_moe). Otherwise, and
with the twins, the slots are sorted by expert (kernels/moe_experts.py's grouping and combine) and each expert
segment runs two quantized linears.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from adapt.runtime.kernels import fused
from adapt.runtime.kernels.activation import silu_and_mul
from adapt.runtime.kernels.moe_experts import _grouped
from adapt.runtime.kernels.quant_linear import quant_moe, quant_moe_takes
from adapt.runtime.quant.weight import QuantizedWeight
from adapt.runtime.module import Module

# Tokens up to which a call takes the fused decode kernel. It reads each expert's rows QMR at a time from the
# packed bytes and re-reads an expert's weights once per 4 of its rows; past a decode batch the per-expert
# linears' buffered path (a block dequantized once for all its rows) is the better fit.
DECODE_TOKENS = 16


class QuantizedExperts(Module):
    """This rank's experts (global ids ``offset`` ..): gate_up[e] [2I, H] (gate rows, then up rows) and
    down[e] [H, I], each a QuantizedWeight."""

    def __init__(self, gate_up: list[QuantizedWeight], down: list[QuantizedWeight], offset: int):
        super().__init__()
        self.gate_up, self.down, self.offset = nn.ModuleList(gate_up), nn.ModuleList(down), offset
        self._pairs = list(zip(gate_up, down))  # plain tuples for the per-expert loop
        # (gate|up, down) as quant_moe takes them, once ``materialized`` has stacked them; None: per expert
        self._stacked: tuple | None = None
        self._takes: dict = {}  # (kernel module, dtype) -> whether quant_moe runs them (_fused)

    def materialized(self, empty) -> None:
        """Make every expert's tensors views of one [E, ...] tensor per kind (``empty(shape, dtype)``
        allocates it on the model's device), before the weights load into them; where the experts differ in
        form (they do not in any layout adapt builds) they stay apart."""
        ws = (list(self.gate_up), list(self.down))
        if not ws[0] or any(len({(w.kind, w.n, w.k, w.rb, w.bk, w.zero is None) for w in g}) != 1 for g in ws):
            return
        stacked = []
        for group in ws:
            parts = {}
            for attr in ("q", "scale", "zero"):
                first = getattr(group[0], attr)
                if first is None:
                    parts[attr] = None
                    continue
                big = empty((len(group), *first.shape), first.dtype)
                for i, w in enumerate(group):
                    p = nn.Parameter(big[i], requires_grad=False)
                    p.keep_dtype = True
                    w._parameters[attr] = p
                parts[attr] = big
            w0 = group[0]
            stacked.append((parts["q"], parts["scale"], parts["zero"], w0.rb, w0.bk))
        self._stacked = tuple(stacked)

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """x [T, H], routing weights [T, K], global ids [T, K] -> [T, H] (slots routed elsewhere add 0)."""
        if (self._stacked is not None and x.shape[0] <= DECODE_TOKENS and x.is_cpu
                and not (torch.is_grad_enabled() and x.requires_grad) and self._fused(x.dtype)):
            gu = self.gate_up[0]
            return quant_moe(x, weights, ids, gu.kind, *self._stacked, self.offset, gu.act)
        pairs = self._pairs

        def expert(ei: int, xs: torch.Tensor, out: torch.Tensor) -> None:
            gu, dn = pairs[ei]
            out.copy_(dn(silu_and_mul(gu(xs))))

        return _grouped(x, weights, ids, len(pairs), self.offset, expert)

    def _fused(self, dtype: torch.dtype) -> bool:
        """Whether quant_moe runs these experts on ``dtype`` activations here; never for the twins
        (QuantizedWeight.fused False)."""
        key = (fused.module(), dtype)  # the module too: fused.disabled() swaps it
        got = self._takes.get(key)
        if got is None:
            gu, dn = self.gate_up[0], self.down[0]
            got = self._takes[key] = gu.fused and quant_moe_takes(gu.kind, gu.k, dn.k, gu.bk, dn.bk, dtype, gu.act)
        return got

    def form(self) -> str:
        return self.gate_up[0].form() if len(self.gate_up) else "none"
