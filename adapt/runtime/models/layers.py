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
from adapt.runtime.parallel import ParallelContext
from adapt.runtime.module import Module

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


def linear(x: torch.Tensor, weight: torch.Tensor | nn.Module, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear; a weight the backend or a quantized format holds as a module (runtime/quant/weight.py,
    backends/cpu_layouts.py) runs its own GEMM as ``weight(x, bias)``."""
    if isinstance(weight, nn.Module):
        return weight(x, bias)
    return F.linear(x, weight, bias)


class Linear(Module):
    """A replicated linear (every rank holds all of it): MLA down-projections, routers."""

    any_layout = True  # the backend may hold the weight in its own layout (read only through linear())

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


class ColumnParallelLinear(Module):
    """Output features split over tp; several sources (q|k|v, gate|up) may be fused, each given as
    (weight name, bias name or None, this rank's width), and come out in that order. No collective."""

    any_layout = True  # the backend may hold the weight in its own layout (read only through linear())

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


class RowParallelLinear(Module):
    """Input features split over tp; partial outputs are summed with an all-reduce, then the bias added."""

    any_layout = True  # the backend may hold the weight in its own layout (read only through linear())

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


class VocabParallelEmbedding(Module):
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
        """Rows ``ids`` of the weight: plain, or through ``rows`` of the module a backend gave a tied head's
        weight (backends/cpu_layouts.py)."""
        w = self.weight
        return w.rows(ids) if isinstance(w, nn.Module) else F.embedding(ids, w)


class ParallelLMHead(Module):
    """The vocab slice of lm_head (or of the tied embedding); logits are gathered over tp. A tied head
    reads the embedding's weight, which a backend may hold in its own layout for both."""

    any_layout = True  # the backend may hold the weight in its own layout (read only through linear())

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


class RMSNorm(Module):
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
