"""Mixture-of-experts feed-forward: router, the routed experts this rank holds, shared experts.

# Legend: T tokens, H hidden, E this rank's routed experts, I this rank's expert width, K top-k.

Routers by family (adapt.spec.MoESpec): Mixtral and Qwen-MoE take softmax top-k (renormalized for
Mixtral, by ``norm_topk_prob`` for Qwen); DeepSeek-V2 softmax greedy / group-limited greedy;
DeepSeek-V3 / Kimi-K2 sigmoid scores with the correction bias and group-limited top-k. Routers of the
DeepSeek family run in float32 with a float32 gate weight, as transformers keeps them. The routed
experts run as one grouped kernel; under expert parallelism each rank computes only ``ctx.experts``
(contiguous ids) and the partial outputs are summed over the stage group.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from adapt.runtime.models.batch import ForwardBatch
from adapt.runtime.models.layers import Linear, _param, linear, slot_loader
from adapt.runtime.models.mlp import DenseMLP
from adapt.runtime.models.names import LayoutNames
from adapt.runtime.parallel import ParallelContext
from adapt.runtime.tactics import TACTICS
from adapt.spec import ModelSpec
from adapt.runtime.module import Module


class MoE(Module):
    def __init__(self, spec: ModelSpec, n: LayoutNames, i: int, ctx: ParallelContext):
        super().__init__()
        m, h = spec.moe, spec.hidden_size
        self.moe, self.ctx, self.layer = m, ctx, i
        self.deepseek = spec.family == "deepseek"
        self.experts = tuple(ctx.experts) if ctx.experts is not None else tuple(range(m.num_experts))
        assert self.experts == tuple(range(self.experts[0], self.experts[0] + len(self.experts))), \
            "a rank's routed experts must be contiguous ids"
        self.expert_offset = self.experts[0]
        moe_tp = ctx.plan.moe_tp if ctx.plan is not None else 1
        self.split = moe_tp > 1 or len(self.experts) < m.num_experts  # partial outputs to sum
        num_inter = m.intermediate_size // moe_tp
        e = len(self.experts)
        self.gate = Linear(n(i, "router"), h, m.num_experts)
        self.gate.any_layout = False  # router_logits reads the weight itself
        if self.deepseek:
            self.gate.weight.keep_fp32 = True
        self.bias_name = n.get(i, "router_bias")
        self.e_score_correction_bias = _param(m.num_experts) if self.bias_name else None
        if self.e_score_correction_bias is not None:
            self.e_score_correction_bias.keep_fp32 = True
        self.num_inter = num_inter
        self.w_gate_up = _param(e, 2 * num_inter, h)  # [E, 2I, H]: gate rows then up rows, loaded in place
        self.w_down = _param(e, h, num_inter)  # [E, H, I]
        # both held transposed in memory ([E, H, 2I] and [E, I, H] storage): the batched expert GEMMs
        # then read contiguous right-hand sides, and a single expert's F.linear is unaffected
        self.w_gate_up.store_transposed = self.w_down.store_transposed = True
        self.hidden_size = h
        # the backend's slots (backends/cpu_layouts.py): the experts held in its own layout, a module called as
        # (kernels, x, weights, ids), which then replaces w_gate_up / w_down; the softmax router's weight as the
        # router kernel reads it (router_softmax_topk's third argument)
        self.prepared_experts: nn.Module | None = None
        self.prepared_router: torch.Tensor | None = None
        self.quantized_experts = None  # runtime/quant/experts.py, set by quant.load.prepare
        self._names = [(n(i, "expert_gate", x), n(i, "expert_up", x), n(i, "expert_down", x)) for x in self.experts]
        self.shared = (DenseMLP(n, i, h, m.shared_intermediate_size, ctx, kind="shared")
                       if m.num_shared_experts and m.shared_intermediate_size else None)
        self.shared_gate = Linear(n(i, "shared_expert_gate"), h, 1) if m.shared_expert_gate else None

    @property
    def w_gate(self) -> torch.Tensor:
        """[E, I, H] view of the gate rows of w_gate_up (the loaders and expert-parallel paths use it)."""
        return self.w_gate_up[:, : self.num_inter]

    @property
    def w_up(self) -> torch.Tensor:
        """[E, I, H] view of the up rows of w_gate_up."""
        return self.w_gate_up[:, self.num_inter:]

    def hf_weights(self):
        out = {}
        for j, (g, u, d) in enumerate(self._names):
            out[g] = slot_loader(self, "w_gate", g, index=j)
            out[u] = slot_loader(self, "w_up", u, index=j)
            out[d] = slot_loader(self, "w_down", d, index=j)
        if self.bias_name:
            out[self.bias_name] = slot_loader(self, "e_score_correction_bias", self.bias_name)
        return out

    def run_experts(self, k, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """The routed experts this rank holds on x [T, H] (weights [T, K], global ids [T, K])."""
        if self.quantized_experts is not None:  # held as the checkpoint stores them (runtime/quant/experts.py)
            return self.quantized_experts(x, weights, ids)
        if self.prepared_experts is not None:  # held in a backend's layout
            return self.prepared_experts(k, x, weights, ids)
        return k.moe_experts_fused(x, weights, ids, self.w_gate_up, self.w_down, self.expert_offset, TACTICS.run)

    def route(self, x: torch.Tensor, batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights [T, K] float32, global expert ids [T, K])."""
        k, m = batch.kernels, self.moe
        if not self.deepseek:  # softmax top-k: one fused call where the backend prepared the router
            logits, weights, ids = k.router_softmax_topk(x, self.gate.weight, self.prepared_router, m.top_k,
                                                         m.norm_topk_prob)
            if batch.capture is not None:
                batch.record(f"layers.{self.layer}.router_logits", logits)
            return weights, ids
        logits = k.router_logits(x, self.gate.weight, True)  # [T, E_total]
        batch.record(f"layers.{self.layer}.router_logits", logits)
        if m.scoring == "sigmoid":
            return k.sigmoid_grouped_topk(logits, m.top_k, self.e_score_correction_bias, m.n_group, m.topk_group,
                                          m.norm_topk_prob, m.routed_scaling_factor)
        return k.deepseek_v2_topk(logits, m.top_k, m.topk_method, m.n_group, m.topk_group, m.routed_scaling_factor)

    def forward(self, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        weights, ids = self.route(x, batch)
        if not self.deepseek and weights.dtype != x.dtype:
            weights = weights.to(x.dtype)  # transformers casts the routing weights to the model dtype
        y = self.run_experts(batch.kernels, x, weights, ids)
        if self.split:
            y = self.ctx.all_reduce(y, group="stage")
        if self.shared is not None:
            s = self.shared(x, batch)
            if self.shared_gate is not None:
                s = torch.sigmoid(linear(x, self.shared_gate.weight)) * s
            y = y + s
        return y
