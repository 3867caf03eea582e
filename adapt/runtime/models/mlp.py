"""The dense SiLU-gated MLP (also the shared experts of MoE layers): gate|up column-parallel, down row."""

from __future__ import annotations

import torch
import torch.nn as nn

from adapt.runtime.models.batch import ForwardBatch
from adapt.runtime.models.layers import ColumnParallelLinear, RowParallelLinear
from adapt.runtime.models.names import LayoutNames
from adapt.runtime.parallel import ParallelContext
from adapt.runtime.module import Module


class DenseMLP(Module):
    """down(silu(gate x) * up x); ``kind`` is the layout role prefix: "mlp" or "shared"."""

    def __init__(self, n: LayoutNames, i: int, hidden: int, total_intermediate: int, ctx: ParallelContext,
                 kind: str = "mlp"):
        super().__init__()
        self.num_inter = total_intermediate // ctx.tp_size
        self.gate_up = ColumnParallelLinear(
            [(n(i, f"{kind}_gate"), n.get(i, f"{kind}_gate_bias"), self.num_inter),
             (n(i, f"{kind}_up"), n.get(i, f"{kind}_up_bias"), self.num_inter)], hidden, ctx)
        self.down = RowParallelLinear(n(i, f"{kind}_down"), n.get(i, f"{kind}_down_bias"), self.num_inter, hidden, ctx)

    def forward(self, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        return self.down(batch.kernels.silu_and_mul(self.gate_up(x)))
