"""Parallel building blocks: linears, vocab-parallel embedding and lm_head, RMSNorm weights.

Every layer is built for one rank of a ParallelContext (``num_`` / this rank's sizes from the
``total_`` sizes) and declares which checkpoint tensors it holds: ``hf_weights()`` maps each
WeightLayout name to a loader that copies the rank's slice (chosen by adapt.plan.tensor_slice, read by
adapt.runtime.loader) into the right place of its parameter: a fused q|k|v or gate|up matrix takes each
source at its row offset, stacked experts take expert e at index e - first local expert.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

from adapt.errors import CheckpointError
from adapt.runtime.host_memory import empty_huge
from adapt.runtime.kernels.linear_tiled import linear_tiled, panel_rows
from adapt.runtime.kernels.rows import bucket_rows, pad_rows
from adapt.runtime.parallel import ParallelContext

Loader = Callable[[torch.Tensor], None]


def _param(*shape: int, dtype: torch.dtype | None = None) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)


def slot_loader(module: nn.Module, attr: str, name: str, row: int | None = None, index: int | None = None) -> Loader:
    """A loader copying a tensor into ``module.attr`` (rows [row, row + n) of it, or its [index] entry)."""

    def load(t: torch.Tensor) -> None:
        dst = getattr(module, attr)
        if index is not None:
            dst = dst[index]
        if row is not None:
            dst = dst.narrow(0, row, t.shape[0])
        if tuple(dst.shape) != tuple(t.shape):
            raise CheckpointError(f"{name}: checkpoint shape {list(t.shape)} does not fit {list(dst.shape)} "
                                  "(config and weights disagree)")
        with torch.no_grad():
            dst.copy_(t)

    return load


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear; or, on a weight :func:`prepack_linears` has packed, the tiled FMA GEMM (float32 column panels,
    a 3-D weight, float32 or bfloat16) or oneDNN's linear (``weight.is_mkldnn``, its row count rounded up to a bucket,
    ``bucket_rows``, so that new prefill lengths reuse compiled primitives); a weight held quantized
    (runtime/quant/weight.py, a module) runs its own kernel."""
    if isinstance(weight, nn.Module):
        return weight(x, bias)
    if weight.dim() == 3:  # column panels for the FMA GEMM (prepack_linears)
        return linear_tiled(x, weight, bias)
    if weight.is_mkldnn:
        rows = x.reshape(-1, x.shape[-1])
        n = rows.shape[0]
        m = bucket_rows(n)
        y = torch.ops.mkldnn._linear_pointwise(pad_rows(rows, m), weight, bias, "none", [], "")
        return (y[:n] if m != n else y).view(*x.shape[:-1], y.shape[-1])
    return F.linear(x, weight, bias)


# dtypes whose oneDNN-packed linear equals F.linear bitwise on CPU (measured, torch 2.13)
PACK_DTYPES_EXACT = (torch.bfloat16, torch.float16)
# float32 packs too by default: oneDNN's blocked GEMM sums in another order than MKL's (a few ulp, far inside
# the 1e-5 fp32 tolerance; every transformers-equality test holds) and on CPU it is about twice as fast as
# F.linear, which sends a 1-row fp32 GEMM to a slow MKL path: 2-core AMD EPYC, bench dense model (400 MB of
# fp32 weights), batch-1 decode 21-25 -> 35-36 tok/s, batch-16 154-181 -> 359-383 tok/s, 4x256 prefill
# 830-860 -> 1000-1010 tok/s
PACK_DTYPES_ALL = PACK_DTYPES_EXACT + (torch.float32,)


def can_prepack(device: torch.device) -> bool:
    """Whether this torch build can pack linear weights for oneDNN on ``device`` (CPU with mkldnn)."""
    return device.type == "cpu" and torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn,
                                                                                    "_linear_pointwise")


def prepack_linears(model: nn.Module, dtypes: tuple[torch.dtype, ...] = PACK_DTYPES_ALL, tiled: bool = False) -> int:
    """Replace the weight of every packable linear in ``dtypes`` by oneDNN's blocked (AMX / AVX-512)
    layout, reordered once here instead of inside every GEMM call; returns the number packed. On this
    2-core Xeon, bfloat16, 16 rows: 768x4096 0.24 -> 0.16 ms, the 32000-row lm_head 1.8 -> 1.3 ms.
    A head tied to the embedding takes the column panels in the embedding itself, whose lookup then reads
    them (tied heads ran F.linear: a [16, 896] x [896, 151936] head took 113 ms in float32 and 233 ms in
    bfloat16 on a 2-core AMD EPYC, 33 ms on the panels). Layers whose weight is read as a tensor elsewhere
    (routers, MLA's kv_b_proj) set ``packable = False``;
    the packed weight replaces the plain one, so memory does not grow. ``tiled``: MoE experts may take the
    fused CPU kernel's packed layout (not bitwise with F.linear: see MoE.pack_experts), and float32 linears
    whose N is a multiple of its panel take the same column panels (kernels/linear_tiled.py), faster than
    oneDNN for decode; so do bfloat16 ones on a CPU without bf16 dot products (AMD Zen 3), where oneDNN cannot
    pack them."""
    from adapt.runtime.kernels.linear_tiled import linear_tiles, pack_linear
    from adapt.runtime.kernels.moe_experts import onednn_packs
    from adapt.runtime.kernels.moe_tiled import tiled_panel

    onednn = tuple(d for d in dtypes if onednn_packs(d))  # float16 packs only on CPUs with FP16 support
    n = 0
    for m in model.modules():
        if hasattr(m, "pack_experts"):  # stacked MoE experts: the module decides per dtype
            n += m.pack_experts(onednn, tiled)
            continue
        tied = getattr(m, "tied", None)  # a head tied to the embedding: the embedding's weight, read by both
        owner = m if tied is None else tied
        w = getattr(owner, "weight", None)
        if (not getattr(m, "packable", False) or not isinstance(w, torch.Tensor) or w.is_mkldnn
                or w.dim() != 2 or w.dtype not in dtypes or getattr(w, "keep_fp32", False)):
            continue
        if tiled and linear_tiles(w.shape[0], w.shape[1], w.dtype):
            owner.weight = nn.Parameter(pack_linear(w, tiled_panel(w.dtype), empty_huge), requires_grad=False)
        elif tied is not None:
            continue  # the embedding's lookup reads column panels, not oneDNN's layout
        elif w.dtype in onednn:
            m.weight = nn.Parameter(torch.ops.mkldnn._reorder_linear_weight(w.detach(), 16), requires_grad=False)
        else:
            continue
        n += 1
    return n


def linears_form(model: nn.Module) -> dict[str, int]:
    """How the packable linears are held (engine stats): counts of "fma panels" (the tiled FMA GEMM, float32 or
    bfloat16), "oneDNN packed" and "plain" (F.linear)."""
    out: dict[str, int] = {}
    for m in model.modules():
        w = getattr(m, "weight", None) if getattr(m, "tied", None) is None else m.tied.weight
        if getattr(m, "packable", False) and isinstance(w, torch.Tensor):
            k = "fma panels" if w.dim() == 3 else "oneDNN packed" if w.is_mkldnn else "plain"
            out[k] = out.get(k, 0) + 1
    return out


class Linear(nn.Module):
    """A replicated linear (every rank holds all of it): MLA down-projections, routers."""

    packable = True

    def __init__(self, name: str, in_features: int, out_features: int, bias: str | None = None,
                 dtype: torch.dtype | None = None):
        super().__init__()
        self.name, self.bias_name = name, bias
        self.weight = _param(out_features, in_features, dtype=dtype)
        self.bias = _param(out_features, dtype=dtype) if bias else None

    def hf_weights(self) -> dict[str, Loader]:
        out = {self.name: slot_loader(self, "weight", self.name)}
        if self.bias is not None:
            out[self.bias_name] = slot_loader(self, "bias", self.bias_name)
        return out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)


class ColumnParallelLinear(nn.Module):
    """Output features split over tp; several sources (q|k|v, gate|up) may be fused, each given as
    (weight name, bias name or None, this rank's width), and come out in that order. No collective."""

    packable = True

    def __init__(self, sources: list[tuple[str, str | None, int]], in_features: int, ctx: ParallelContext):
        super().__init__()
        self.sources = sources
        self.num_out = [n for _, _, n in sources]
        self.weight = _param(sum(self.num_out), in_features)
        self.bias = _param(sum(self.num_out)) if any(b for _, b, _ in sources) else None

    def hf_weights(self) -> dict[str, Loader]:
        out, row = {}, 0
        for name, bias, n in self.sources:
            out[name] = slot_loader(self, "weight", name, row=row)
            if bias:
                out[bias] = slot_loader(self, "bias", bias, row=row)
            row += n
        return out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)


class RowParallelLinear(nn.Module):
    """Input features split over tp; partial outputs are summed with an all-reduce, then the bias added."""

    packable = True

    def __init__(self, name: str, bias: str | None, num_in: int, out_features: int, ctx: ParallelContext):
        super().__init__()
        self.name, self.bias_name, self.ctx = name, bias, ctx
        self.weight = _param(out_features, num_in)
        self.bias = _param(out_features) if bias else None

    def hf_weights(self) -> dict[str, Loader]:
        out = {self.name: slot_loader(self, "weight", self.name)}
        if self.bias is not None:
            out[self.bias_name] = slot_loader(self, "bias", self.bias_name)
        return out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.ctx.all_reduce(linear(x, self.weight), group="tp")
        return y if self.bias is None else y + self.bias


class VocabParallelEmbedding(nn.Module):
    """Rows [tp_rank * V/tp, (tp_rank + 1) * V/tp) of the embedding; ids outside give 0, summed over tp."""

    def __init__(self, name: str, total_vocab: int, hidden: int, ctx: ParallelContext):
        super().__init__()
        self.name, self.ctx = name, ctx
        self.num_vocab = total_vocab // ctx.tp_size
        self.vocab_start = ctx.tp_rank * self.num_vocab
        self.weight = _param(self.num_vocab, hidden)

    def hf_weights(self) -> dict[str, Loader]:
        return {self.name: slot_loader(self, "weight", self.name)}

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.ctx.tp_size == 1:
            return self.rows(ids)
        local = ids - self.vocab_start
        outside = (local < 0) | (local >= self.num_vocab)
        y = self.rows(local.masked_fill(outside, 0)).masked_fill(outside[:, None], 0)
        return self.ctx.all_reduce(y, group="tp")

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows ``ids`` of the weight: plain, or in the column panels a tied head packed it into (prepack_linears)."""
        w = self.weight
        return F.embedding(ids, w) if w.dim() == 2 else panel_rows(w, ids)


class ParallelLMHead(nn.Module):
    """The vocab slice of lm_head (or of the tied embedding); logits are gathered over tp. A tied head
    reads the embedding's weight, which prepack_linears may pack in column panels for both."""

    packable = True

    def __init__(self, name: str | None, total_vocab: int, hidden: int, ctx: ParallelContext,
                 tied: VocabParallelEmbedding | None = None):
        super().__init__()
        self.name, self.ctx, self.tied = name, ctx, tied
        self.weight = None if tied is not None else _param(total_vocab // ctx.tp_size, hidden)

    def hf_weights(self) -> dict[str, Loader]:
        return {} if self.tied is not None else {self.name: slot_loader(self, "weight", self.name)}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.tied.weight if self.tied is not None else self.weight
        return self.ctx.all_gather(linear(x, w), dim=-1, group="tp")


class RMSNorm(nn.Module):
    """An RMSNorm weight; the computation is the kernel's (``rms_norm`` / ``fused_add_rms_norm``)."""

    def __init__(self, name: str, size: int, eps: float, dtype: torch.dtype | None = None):
        super().__init__()
        self.name, self.eps = name, eps
        self.weight = _param(size, dtype=dtype)

    def hf_weights(self) -> dict[str, Loader]:
        return {self.name: slot_loader(self, "weight", self.name)}


def collect_loaders(model: nn.Module) -> dict[str, Loader]:
    """Every checkpoint name a model's layers hold, with its loader."""
    out: dict[str, Loader] = {}
    for m in model.modules():
        fn = getattr(m, "hf_weights", None)
        if fn is not None:
            out.update(fn())
    return out
