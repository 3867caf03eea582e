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

import os

import torch
import torch.nn as nn

from adapt.runtime.host_memory import empty_huge
from adapt.runtime.kernels.moe_experts import onednn_packs, pack_expert_weights
from adapt.runtime.kernels.moe_routing import pack_router
from adapt.runtime.kernels.moe_tiled import pack_tiled, tiled_panel, tiles
from adapt.runtime.models.batch import ForwardBatch
from adapt.runtime.models.layers import Linear, _param, linear, slot_loader
from adapt.runtime.models.mlp import DenseMLP
from adapt.runtime.models.names import LayoutNames
from adapt.runtime.parallel import ParallelContext
from adapt.runtime.tactics import STRATEGY_ENV, TACTICS, packing_wins
from adapt.spec import ModelSpec


def experts_form(model: nn.Module) -> str | None:
    """How the model's routed experts run (engine stats): "tiled (amx)", "tiled (avx512_bf16)", "tiled
    (fma)", "oneDNN packed" or "stacked" (the timed paths), joined where layers differ; None without MoE."""
    from adapt.runtime.kernels import fused

    forms = []
    for m in model.modules():
        if isinstance(m, MoE):
            if m.tiled is not None:
                ext = fused.installed()
                how = ext.moe_tiled_bf16_gemm() if m.tiled[0].dtype == torch.bfloat16 and ext is not None else "fma"
                f = f"tiled ({how})"
            elif m.quantized_experts is not None:
                f = f"quantized ({m.quantized_experts.form()})"
            else:
                f = "oneDNN packed" if m.packed is not None else "stacked"
            if f not in forms:
                forms.append(f)
    return ", ".join(forms) or None


def routers_form(model: nn.Module) -> str | None:
    """How the model's routers run (engine stats): "fused" (router_softmax_topk on packed panels) or "torch"
    (the logits' GEMM, then the routing kernel), joined where layers differ; None without MoE."""
    forms = []
    for m in model.modules():
        if isinstance(m, MoE):
            f = "fused" if m.router_panels is not None else "torch"
            if f not in forms:
                forms.append(f)
    return ", ".join(forms) or None


class MoE(nn.Module):
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
        self.gate.packable = False  # router_logits reads the weight itself
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
        self.packed: tuple[nn.ParameterList, nn.ParameterList] | None = None  # set by pack_experts
        self.tiled: nn.ParameterList | None = None  # [gate_up, down] packed by pack_experts
        self._tiled_pair: tuple[torch.Tensor, torch.Tensor] | None = None  # the same two, read by run_experts
        self.router_panels: torch.Tensor | None = None  # the softmax router's weight in panels (pack_experts)
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

    def pack_experts(self, dtypes: tuple[torch.dtype, ...], tiled: bool = False) -> int:
        """On CPU, with ``tiled``: pack the experts for the fused tiled kernel (moe_experts_tiled, float32,
        bfloat16 or float16) where it runs here and a timed trial says it beats the stacked paths. Else float32
        experts in ``dtypes``: repack every expert's gate_up and down once for oneDNN
        (moe_experts_packed), replacing the stacked tensors so memory does not grow, where a timed trial
        says the packed loop beats the stacked paths on this host (``packing_wins``); returns the number
        of packed weights. The winner flips between CPUs: float32 on a 2-core AMD EPYC, 32 experts top-4,
        H 512, I 256, ms for the experts alone, stacked / packed: 4 tokens 2.9 / 2.3, 512 tokens 18.0 /
        13.2; on a 2-core AMX Xeon the stacked loop and grouped_mm beat the packed loop (512 tokens
        8.6 / 8.3 against 10.5 ms). bfloat16 is never packed for oneDNN: its padded batched GEMMs, which
        that form cannot run, won on AMX from ~64 rows per expert (the tiled kernel beats both there)."""
        w = self.w_gate_up
        if self.packed is not None or self.tiled is not None or w is None or w.device.type != "cpu":
            return 0
        n = self._pack_router() if tiled else 0
        if os.environ.get(STRATEGY_ENV, "auto") != "auto":  # a pinned path runs on the stacked experts
            return n
        h, inter = self.hidden_size, self.num_inter
        if (tiled and tiles(2 * inter, h, w.dtype) and tiles(h, inter, w.dtype)
                and packing_wins(self, w.dtype, "tiled")):
            p = tiled_panel(w.dtype)
            self.tiled = nn.ParameterList([nn.Parameter(pack_tiled(t.detach(), p, empty=empty_huge), requires_grad=False)
                                           for t in (self.w_gate_up, self.w_down)])
            # a plain tuple for the forward: unpacking the ParameterList (Module attribute lookups) took 26-37 us
            # a call right after the experts' kernel had swept the caches
            self._tiled_pair = (self.tiled[0], self.tiled[1])
            self.w_gate_up = self.w_down = None
            return n + 2
        if (w.dtype != torch.float32 or w.dtype not in dtypes or not onednn_packs(w.dtype)
                or not packing_wins(self, w.dtype)):
            return n

        def plist(t: torch.Tensor) -> nn.ParameterList:
            return nn.ParameterList([nn.Parameter(p, requires_grad=False) for p in pack_expert_weights(t.detach())])

        self.packed = (plist(self.w_gate_up), plist(self.w_down))
        self._packed_lists = (list(self.packed[0]), list(self.packed[1]))  # what the kernel takes, built once
        self.w_gate_up = self.w_down = None
        return n + 2 * len(self.experts)

    def _pack_router(self) -> int:
        """The softmax router's weight packed for the fused router kernel (router_softmax_topk) where it runs
        here (pack_router); the plain weight stays (the twins and other devices read it)."""
        if self.deepseek or self.router_panels is not None:
            return 0
        self.router_panels = pack_router(self.gate.weight)
        return int(self.router_panels is not None)

    def run_experts(self, k, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """The routed experts this rank holds on x [T, H] (weights [T, K], global ids [T, K])."""
        if self.quantized_experts is not None:  # held as the checkpoint stores them (runtime/quant/experts.py)
            return self.quantized_experts(x, weights, ids)
        if self._tiled_pair is not None:
            gu, dn = self._tiled_pair
            return k.moe_experts_tiled(x, weights, ids, gu, dn, self.expert_offset, TACTICS.run)
        if self.packed is not None:
            return k.moe_experts_packed(x, weights, ids, *self._packed_lists, self.expert_offset, TACTICS.run)
        return k.moe_experts_fused(x, weights, ids, self.w_gate_up, self.w_down, self.expert_offset, TACTICS.run)

    def route(self, x: torch.Tensor, batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights [T, K] float32, global expert ids [T, K])."""
        k, m = batch.kernels, self.moe
        if not self.deepseek:  # softmax top-k: one fused call where the router is packed (pack_experts)
            logits, weights, ids = k.router_softmax_topk(x, self.gate.weight, self.router_panels, m.top_k,
                                                         m.norm_topk_prob)
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
