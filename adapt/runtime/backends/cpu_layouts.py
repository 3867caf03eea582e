"""The cpu backend's weight layouts: oneDNN's blocked linears, the tiled FMA GEMM's column panels, the MoE
experts packed for the fused tiled kernel or for oneDNN, and the softmax routers' panels.

The model modules stay device-neutral: a packed linear weight is replaced by a small module that runs its
GEMM (``models.layers.linear`` calls a module weight as ``weight(x, bias)``, the protocol QuantizedWeight
follows; a tied embedding's lookup calls its ``rows(ids)``), and a MoE block's ``prepared_experts`` /
``prepared_router`` slots take the packed experts (called as ``(kernels, x, weights, ids)``) and the router
weight handed to ``router_softmax_topk``. The ``*_form`` functions report how weights are held (engine stats).
"""

from __future__ import annotations

import os

import torch
import torch.nn as nn

from adapt.runtime.host_memory import empty_huge
from adapt.runtime.kernels.linear_tiled import linear_tiled, linear_tiles, pack_linear, panel_rows
from adapt.runtime.kernels.moe_experts import onednn_packs, pack_expert_weights
from adapt.runtime.kernels.moe_routing import pack_router
from adapt.runtime.kernels.moe_tiled import pack_tiled, tiled_panel, tiles
from adapt.runtime.kernels.rows import bucket_rows, pad_rows
from adapt.runtime.models.moe import MoE
from adapt.runtime.tactics import STRATEGY_ENV, TACTICS, packing_wins
from adapt.runtime.module import Module

# dtypes whose oneDNN-packed linear equals F.linear bitwise on CPU (measured, torch 2.13)
PACK_DTYPES_EXACT = (torch.bfloat16, torch.float16)
# float32 packs too by default: oneDNN's blocked GEMM sums in another order than MKL's (a few ulp, far inside
# the 1e-5 fp32 tolerance; every transformers-equality test holds) and on CPU it is about twice as fast as
# F.linear, which sends a 1-row fp32 GEMM to a slow MKL path: 2-core AMD EPYC, bench dense model (400 MB of
# fp32 weights), batch-1 decode 21-25 -> 35-36 tok/s, batch-16 154-181 -> 359-383 tok/s, 4x256 prefill
# 830-860 -> 1000-1010 tok/s
PACK_DTYPES_ALL = PACK_DTYPES_EXACT + (torch.float32,)


class OneDNNWeight(Module):
    """A linear weight in oneDNN's blocked layout; its GEMM pads the row count up to a bucket (``bucket_rows``)
    so that new prefill lengths reuse compiled primitives."""

    form = "oneDNN packed"

    def __init__(self, w: torch.Tensor):
        super().__init__()
        self.weight = nn.Parameter(torch.ops.mkldnn._reorder_linear_weight(w.detach(), 16), requires_grad=False)
        object.__setattr__(self, "_w", self.weight)  # a plain attribute: Module lookups cost per call

    def forward(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])
        n = rows.shape[0]
        m = bucket_rows(n)
        y = torch.ops.mkldnn._linear_pointwise(pad_rows(rows, m), self._w, bias, "none", [], "")
        return (y[:n] if m != n else y).view(*x.shape[:-1], y.shape[-1])


class PanelWeight(Module):
    """A linear weight [N, K] in the tiled FMA GEMM's column panels [N / P, K, P] (kernels/linear_tiled.py);
    ``rows(ids)`` reads embedding rows back from them (a head tied to the embedding)."""

    form = "fma panels"

    def __init__(self, w: torch.Tensor):
        super().__init__()
        self.weight = nn.Parameter(pack_linear(w, tiled_panel(w.dtype), empty_huge), requires_grad=False)
        object.__setattr__(self, "_w", self.weight)

    def forward(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return linear_tiled(x, self._w, bias)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        return panel_rows(self._w, ids)


def can_prepack(device: torch.device) -> bool:
    """Whether this torch build can pack linear weights for oneDNN on ``device`` (CPU with mkldnn)."""
    return device.type == "cpu" and torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn,
                                                                                    "_linear_pointwise")


def _set_weight(owner: nn.Module, w: nn.Module) -> None:
    owner._parameters.pop("weight", None)
    owner.weight = w


def prepack_linears(model: nn.Module, dtypes: tuple[torch.dtype, ...] = PACK_DTYPES_ALL, tiled: bool = False) -> int:
    """Replace the weight of every linear that allows any layout (``any_layout``), in ``dtypes``, by oneDNN's
    blocked (AMX / AVX-512) layout, reordered once here instead of inside every GEMM call; returns the number
    packed. On this 2-core Xeon, bfloat16, 16 rows: 768x4096 0.24 -> 0.16 ms, the 32000-row lm_head
    1.8 -> 1.3 ms. A head tied to the embedding takes the column panels in the embedding itself, whose lookup
    then reads them (tied heads ran F.linear: a [16, 896] x [896, 151936] head took 113 ms in float32 and 233 ms
    in bfloat16 on a 2-core AMD EPYC, 33 ms on the panels). Layers whose weight is read as a tensor elsewhere
    (routers, MLA's kv_b_proj) set ``any_layout = False``; the packed weight replaces the plain one, so memory
    does not grow. ``tiled``: MoE experts may take the fused CPU kernel's packed layout (not bitwise with
    F.linear: see pack_experts), and float32 linears whose N is a multiple of its panel take the same column
    panels (kernels/linear_tiled.py), faster than oneDNN for decode; so do bfloat16 ones on a CPU without bf16
    dot products (AMD Zen 3), where oneDNN cannot pack them."""
    onednn = tuple(d for d in dtypes if onednn_packs(d))  # float16 packs only on CPUs with FP16 support
    n = 0
    for m in list(model.modules()):
        if isinstance(m, MoE):  # stacked MoE experts: decided per dtype
            # the router packs whatever form the experts take (stacked, packed, held quantized)
            n += (prepare_router(m) if tiled else 0) + pack_experts(m, onednn, tiled)
            continue
        tied = getattr(m, "tied", None)  # a head tied to the embedding: the embedding's weight, read by both
        owner = m if tied is None else tied
        w = getattr(owner, "weight", None)
        if (not getattr(m, "any_layout", False) or not isinstance(w, torch.Tensor) or w.is_mkldnn
                or w.dim() != 2 or w.dtype not in dtypes or getattr(w, "keep_fp32", False)):
            continue
        if tiled and linear_tiles(w.shape[0], w.shape[1], w.dtype):
            _set_weight(owner, PanelWeight(w))
        elif tied is not None:
            continue  # the embedding's lookup reads column panels, not oneDNN's layout
        elif w.dtype in onednn:
            _set_weight(m, OneDNNWeight(w))
        else:
            continue
        n += 1
    return n


class TiledExperts(Module):
    """A MoE block's experts packed for the fused tiled kernel (moe_experts_tiled, kernels/moe_tiled.py)."""

    def __init__(self, gate_up: torch.Tensor, down: torch.Tensor, offset: int):
        super().__init__()
        p = tiled_panel(gate_up.dtype)
        self.gate_up = nn.Parameter(pack_tiled(gate_up.detach(), p, empty=empty_huge), requires_grad=False)
        self.down = nn.Parameter(pack_tiled(down.detach(), p, empty=empty_huge), requires_grad=False)
        # a plain tuple for the forward: Module attribute lookups took 26-37 us a call right after the
        # experts' kernel had swept the caches
        self._pair, self.offset = (self.gate_up, self.down), offset

    def forward(self, k, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        gu, dn = self._pair
        return k.moe_experts_tiled(x, weights, ids, gu, dn, self.offset, TACTICS.run)

    def form(self) -> str:
        from adapt.runtime.kernels import fused

        ext = fused.installed()
        how = ext.moe_tiled_bf16_gemm() if self._pair[0].dtype == torch.bfloat16 and ext is not None else "fma"
        return f"tiled ({how})"


class OneDNNExperts(Module):
    """A MoE block's experts, each gate_up and down repacked for oneDNN (moe_experts_packed)."""

    def __init__(self, gate_up: torch.Tensor, down: torch.Tensor, offset: int):
        super().__init__()
        self.gate_up, self.down = (nn.ParameterList([nn.Parameter(p, requires_grad=False)
                                                     for p in pack_expert_weights(t.detach())]) for t in (gate_up, down))
        self._lists, self.offset = (list(self.gate_up), list(self.down)), offset  # what the kernel takes

    def forward(self, k, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        return k.moe_experts_packed(x, weights, ids, *self._lists, self.offset, TACTICS.run)

    def form(self) -> str:
        return "oneDNN packed"


def pack_experts(block: MoE, dtypes: tuple[torch.dtype, ...], tiled: bool = False) -> int:
    """On CPU, with ``tiled``: pack ``block``'s experts for the fused tiled kernel (moe_experts_tiled, float32,
    bfloat16 or float16) where it runs here and a timed trial says it beats the stacked paths. Else float32
    experts in ``dtypes``: repack every expert's gate_up and down once for oneDNN (moe_experts_packed),
    replacing the stacked tensors so memory does not grow, where a timed trial says the packed loop beats the
    stacked paths on this host (``packing_wins``); returns the number of packed weights. The winner flips
    between CPUs: float32 on a 2-core AMD EPYC, 32 experts top-4, H 512, I 256, ms for the experts alone,
    stacked / packed: 4 tokens 2.9 / 2.3, 512 tokens 18.0 / 13.2; on a 2-core AMX Xeon the stacked loop and
    grouped_mm beat the packed loop (512 tokens 8.6 / 8.3 against 10.5 ms). bfloat16 is never packed for
    oneDNN: its padded batched GEMMs, which that form cannot run, won on AMX from ~64 rows per expert (the
    tiled kernel beats both there)."""
    w = block.w_gate_up
    if (block.prepared_experts is not None or w is None or w.device.type != "cpu"
            or os.environ.get(STRATEGY_ENV, "auto") != "auto"):  # a pinned path runs on the stacked experts
        return 0
    h, inter = block.hidden_size, block.num_inter
    if (tiled and tiles(2 * inter, h, w.dtype) and tiles(h, inter, w.dtype)
            and packing_wins(block, w.dtype, "tiled")):
        block.prepared_experts = TiledExperts(block.w_gate_up, block.w_down, block.expert_offset)
        block.w_gate_up = block.w_down = None
        return 2
    if (w.dtype != torch.float32 or w.dtype not in dtypes or not onednn_packs(w.dtype)
            or not packing_wins(block, w.dtype)):
        return 0
    block.prepared_experts = OneDNNExperts(block.w_gate_up, block.w_down, block.expert_offset)
    block.w_gate_up = block.w_down = None
    return 2 * len(block.experts)


def prepare_router(block: MoE) -> int:
    """The softmax router's weight packed for the fused router kernel (router_softmax_topk) where it runs
    here (pack_router), into ``block.prepared_router``; the plain weight stays (the twins and other devices
    read it); on the CPU only."""
    if block.deepseek or block.prepared_router is not None or block.gate.weight.device.type != "cpu":
        return 0
    block.prepared_router = pack_router(block.gate.weight)
    return int(block.prepared_router is not None)


def linears_form(model: nn.Module) -> dict[str, int]:
    """How the linears that allow any layout are held (engine stats): counts of "fma panels" (the tiled FMA
    GEMM, float32 or bfloat16), "oneDNN packed" and "plain" (F.linear); quantized ones are not counted."""
    out: dict[str, int] = {}
    for m in model.modules():
        if not getattr(m, "any_layout", False):
            continue
        w = getattr(m, "weight", None) if getattr(m, "tied", None) is None else m.tied.weight
        k = w.form if isinstance(w, (OneDNNWeight, PanelWeight)) else "plain" if isinstance(w, torch.Tensor) else None
        if k is not None:
            out[k] = out.get(k, 0) + 1
    return out


def experts_form(model: nn.Module) -> str | None:
    """How the model's routed experts run (engine stats): "tiled (amx)", "tiled (avx512_bf16)", "tiled
    (fma)", "oneDNN packed", "quantized (...)" or "stacked", joined where layers differ; None without MoE."""
    forms = []
    for m in model.modules():
        if isinstance(m, MoE):
            if m.prepared_experts is not None:
                f = m.prepared_experts.form()
            elif m.quantized_experts is not None:
                f = f"quantized ({m.quantized_experts.form()})"
            else:
                f = "stacked"
            if f not in forms:
                forms.append(f)
    return ", ".join(forms) or None


def routers_form(model: nn.Module) -> str | None:
    """How the model's routers run (engine stats): "fused" (router_softmax_topk on the prepared router weight)
    or "torch" (the logits' GEMM, then the routing kernel), joined where layers differ; None without MoE."""
    forms = []
    for m in model.modules():
        if isinstance(m, MoE):
            f = "fused" if m.prepared_router is not None else "torch"
            if f not in forms:
                forms.append(f)
    return ", ".join(forms) or None
