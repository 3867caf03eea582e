"""Loading quantized checkpoints: which linears stay quantized, and the loaders of their stored tensors.

``prepare`` runs on the model built on the meta device, before ``materialize``: every linear whose matrices
(all the sources fused into it) the layout says are stored quantized gets a :class:`QuantizedWeight` in place
of its ``weight`` parameter, so that the float weight is never allocated. ``QuantLoaders`` then maps every
stored tensor name (the weight, its scales, zero points and shape: ``WeightLayout``'s companions) to a
loader; an MoE layer whose experts are all stored quantized gets QuantizedExperts (experts.py). Weights that a
layer reads as a plain tensor (MLA's kv_b_proj, routers) and every
weight under ``--weights-dtype bf16|fp16|fp32`` are dequantized at load instead: the parts of one weight are
gathered as they arrive, then the layer's own loader takes the float32 result.

A companion's loader takes the tensor whole and the slice of the weight this rank holds (None when the file
holds this rank's slice already, ``adapt shard`` output) and cuts what covers that slice: fp8 block-scale rows
and columns, group-scale columns, per-channel rows.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn as nn

from adapt.errors import CheckpointError
from adapt.layout import TensorSpec, WeightLayout, part_rule
from adapt.plan import TensorSlice
from adapt.runtime.kernels.quant_linear import dequantize
from adapt.runtime.quant.weight import QuantizedWeight
from adapt.spec import ModelSpec, ceil_div

WEIGHTS_DTYPES = ("auto", "bf16", "fp16", "fp32")

SliceOf = Callable[[TensorSpec], "TensorSlice | None"]


def quantized_weights(layout: WeightLayout) -> dict[str, tuple[TensorSpec, list[TensorSpec]]]:
    """stored weight name (the name the model's layers hold: ``weight``, int4's ``weight_packed``) -> (its
    TensorSpec, its companions), for every quantized weight."""
    comps: dict[str, list[TensorSpec]] = {}
    for t in layout:
        if t.scale_of is not None:
            comps.setdefault(t.scale_of, []).append(t)
    return {m: (layout[m], c) for m, c in comps.items()}


def kind_of(spec: ModelSpec) -> str:
    q = spec.quant
    return "fp8" if q.method == "fp8" else f"int{q.bits}"


def _blocks(spec: ModelSpec, k: int) -> tuple[int, int]:
    """(rows, columns) per scale of the checkpoint's format."""
    q = spec.quant
    if q.method == "fp8":
        return q.block_size
    return 1, (q.group_size or k) if q.bits == 4 else k


def _sources(m: nn.Module) -> list[tuple[str, int, int]] | None:
    """(weight name, first row, rows) of each matrix a linear holds: ColumnParallelLinear's fused sources, or
    the one weight of Linear / RowParallelLinear."""
    srcs = getattr(m, "sources", None)
    if srcs is not None:
        out, row = [], 0
        for name, _bias, n in srcs:
            out.append((name, row, n))
            row += n
        return out
    name = getattr(m, "name", None)
    return [(name, 0, m.weight.shape[0])] if isinstance(name, str) else None


def prepare(model: nn.Module, spec: ModelSpec, layout: WeightLayout, slice_of: SliceOf, fused: bool) -> int:
    """Give every linear whose matrices are all stored quantized a QuantizedWeight (on the meta device, before
    ``materialize``); returns how many. ``slice_of(t)``: the slice of t this rank reads (None: whole)."""
    quant = quantized_weights(layout)
    n_done = 0
    for m in list(model.modules()):
        if _experts(m, spec, quant, slice_of, fused):
            n_done += 1
            continue
        w = m._parameters.get("weight") if isinstance(m, nn.Module) else None
        if (not getattr(m, "any_layout", False) or getattr(m, "tied", None) is not None or w is None
                or w.dim() != 2):
            continue
        srcs = _sources(m)
        if not srcs or not all(name in quant for name, _, _ in srcs):
            continue
        n, k = w.shape
        del m._parameters["weight"]
        m.weight = _held(spec, quant, srcs, n, k, slice_of, fused)
        n_done += 1
    return n_done


def _held(spec: ModelSpec, quant: dict, srcs: list[tuple[str, int, int]], n: int, k: int, slice_of: SliceOf,
          fused: bool) -> QuantizedWeight:
    """The QuantizedWeight of an [n, k] weight fused from ``srcs`` (name, first row, rows)."""
    rb, bk = _blocks(spec, k)
    zero = any(c.name.endswith("weight_zero_point") for name, _, _ in srcs for c in quant[name][1])
    if rb > 1:  # block rows must start on a block edge in the fused weight and in the checkpoint
        starts = [(row, slice_of(quant[name][0])) for name, row, _ in srcs]
        if any(row % rb or (sl is not None and sl.dim == 0 and sl.start % rb) for row, sl in starts):
            rb = 1
    return QuantizedWeight(kind_of(spec), n, k, rb, bk, zero, srcs, fused, act=spec.quant.activations)


def _experts(m: nn.Module, spec: ModelSpec, quant: dict, slice_of: SliceOf, fused: bool) -> bool:
    """An MoE layer's stacked experts -> QuantizedExperts, where every expert weight it holds is quantized."""
    names = getattr(m, "_names", None)
    gu = m._parameters.get("w_gate_up") if hasattr(m, "quantized_experts") else None
    if names is None or gu is None or not all(x in quant for trio in names for x in trio):
        return False
    from adapt.runtime.quant.experts import QuantizedExperts

    _, i2, h = gu.shape
    inter = i2 // 2
    gate_up = [_held(spec, quant, [(g, 0, inter), (u, inter, inter)], i2, h, slice_of, fused) for g, u, _ in names]
    down = [_held(spec, quant, [(d, 0, h)], h, inter, slice_of, fused) for _, _, d in names]
    del m._parameters["w_gate_up"], m._parameters["w_down"]
    m.w_gate_up = m.w_down = None
    m.quantized_experts = QuantizedExperts(gate_up, down, m.expert_offset)
    return True


def _cut(s: torch.Tensor, sl: TensorSlice | None, rows: int, block: tuple[int, int], rb: int, name: str,
         weight: str) -> torch.Tensor:
    """The part of scale (or zero point) tensor ``s`` [R, G] covering this rank's slice of the weight (``rows``
    rows), as the QuantizedWeight holds it: block rows (rb = block rows) or one row per weight row (rb = 1)."""
    bm, bn = block
    start = sl.start if sl is not None and sl.dim == 0 else 0
    if sl is not None and sl.dim == 1 and s.shape[1] > 1:
        if sl.start % bn:
            raise CheckpointError(f"{weight}: the slice [{sl.start}, {sl.stop}) of dim 1 starts inside a "
                                  f"{bn}-column scale block of {name} ({sl.start} % {bn} = {sl.start % bn}); "
                                  "choose a tp degree that splits K on block edges")
        s = s[:, sl.start // bn: ceil_div(sl.stop, bn)]
    if bm == 1 or rb == 1:
        s = s.repeat_interleave(bm, dim=0) if bm > 1 else s
        return s[start:start + rows]
    return s[start // bm: start // bm + ceil_div(rows, bm)]


class QuantLoaders:
    """The loaders of every stored tensor of the quantized weights (module docstring); ``loaders`` replaces
    the model's own for those names. ``dequantized`` counts the weights dequantized at load."""

    def __init__(self, model: nn.Module, spec: ModelSpec, layout: WeightLayout, loaders: dict,
                 held: SliceOf | None = None):
        self.spec, self.kind = spec, kind_of(spec)
        self.held = held or (lambda t: None)  # the slice of a weight a presliced file holds (shard output)
        self.loaders = dict(loaders)
        self.dequantized = 0
        quant = quantized_weights(layout)
        held = set()
        for qw in (m for m in model.modules() if isinstance(m, QuantizedWeight)):
            for name, row, n in qw.sources:
                main, comps = quant[name]
                self.loaders.pop(name, None)
                self.loaders[main.name] = self._weight_loader(qw, main, row, n)
                for c in comps:
                    self.loaders[c.name] = self._part_loader(qw, main, c, row, n)
                held.add(name)
        for name, (main, comps) in quant.items():
            if name in held or name not in loaders:
                continue
            pending = _Pending(self, main, comps, self.loaders.pop(name))
            self.loaders[main.name] = pending.weight
            for c in comps:
                self.loaders[c.name] = pending.part(c)

    def _weight_loader(self, qw: QuantizedWeight, main: TensorSpec, row: int, n: int):
        def load(t: torch.Tensor) -> None:
            v = t.view(torch.uint8) if self.kind == "int4" else t
            dst = qw.q.narrow(0, row, n)
            if v.dtype != dst.dtype or tuple(v.shape) != tuple(dst.shape):
                raise CheckpointError(f"{main.name}: checkpoint holds {str(t.dtype).replace('torch.', '')} "
                                      f"{list(t.shape)}; the {self.kind} layout wants {main.stored_dtype} "
                                      f"{list(main.stored_shape)} (this rank: {n} rows)")
            with torch.no_grad():
                dst.copy_(v)
        return load

    def _part_loader(self, qw: QuantizedWeight, main: TensorSpec, c: TensorSpec, row: int, n: int):
        def load(t: torch.Tensor, sl: TensorSlice | None) -> None:
            check_part(c, t, part_shape(c, main, self.held(main), self.spec))
            if c.name.endswith("weight_shape"):
                return
            part = _cut(self._as_rows(c, t), sl, n, _blocks(self.spec, main.shape[1]), qw.rb, c.name, main.name)
            dst = (qw.zero if c.name.endswith("weight_zero_point") else qw.scale)
            r0, rows = (row // qw.rb, part.shape[0]) if qw.rb > 1 else (row, n)
            dst = dst.narrow(0, r0, rows)
            if tuple(part.shape) != tuple(dst.shape):
                raise CheckpointError(f"{c.name}: {list(t.shape)} does not cover {main.name}'s {n} rows here "
                                      f"(wants {list(dst.shape)} of it)")
            with torch.no_grad():
                dst.copy_(part)
        return load

    @staticmethod
    def _as_rows(c: TensorSpec, t: torch.Tensor) -> torch.Tensor:
        """A scale as float32, a zero point unpacked to int8 [N, G]."""
        if c.name.endswith("weight_zero_point"):
            from adapt.runtime.kernels.quant_linear import unpack_int4

            cols = t.shape[1]
            by_col = t.t().contiguous().view(torch.uint8).view(cols, -1)  # [G, 4 * ceil(N / 8)]: N packed
            return unpack_int4(by_col, c.shape[0]).t().contiguous()
        return t.to(torch.float32)


def part_shape(c: TensorSpec, main: TensorSpec, sl: TensorSlice | None, spec: ModelSpec) -> tuple[int, ...]:
    """The stored shape of companion c in a file holding slice ``sl`` of its weight (None: the whole weight):
    along the split dim, the blocks / groups / channels that cover the slice (``adapt shard`` writes those)."""
    if sl is None or sl.whole or c.tp_dim is None or c.tp_dim != sl.dim or len(c.shape) != 2:
        return c.stored_shape
    d = sl.dim
    q = spec.quant
    unit = q.block_size[d] if q.method == "fp8" else (1 if d == 0 else (q.group_size or main.shape[1]))
    shape = list(c.shape)
    shape[d] = ceil_div(sl.stop, unit) - sl.start // unit
    if c.packed_dim == d:
        shape[d] = ceil_div(shape[d], 8)
    elif c.packed_dim is not None:
        shape[c.packed_dim] = ceil_div(shape[c.packed_dim], 8)
    return tuple(shape)


def check_part(c: TensorSpec, t: torch.Tensor, want: tuple[int, ...] | None = None) -> None:
    """A companion tensor must have the layout's stored shape, or ``want`` (a presliced file's: part_shape);
    a scale: any float dtype."""
    want = c.stored_shape if want is None else want
    ok = tuple(t.shape) == tuple(want)
    if c.name.endswith("weight_shape"):
        ok = t.numel() == 2
    if not ok:
        raise CheckpointError(f"{c.name}: shape {list(t.shape)}, expected {list(want)} ({part_rule(c.name)})")


class _Pending:
    """The parts of one quantized weight that a layer holds in float: gathered, then dequantized into the
    layer's own loader."""

    def __init__(self, owner: QuantLoaders, main: TensorSpec, comps: list[TensorSpec], target):
        self.owner, self.main, self.target = owner, main, target
        self.want = {c.name for c in comps}
        self.parts: dict[str, tuple[torch.Tensor, TensorSlice | None]] = {}
        self.q: torch.Tensor | None = None

    def weight(self, t: torch.Tensor) -> None:
        self.q = t
        self._maybe_done()

    def part(self, c: TensorSpec):
        def load(t: torch.Tensor, sl: TensorSlice | None) -> None:
            o = self.owner
            check_part(c, t, part_shape(c, self.main, o.held(self.main), o.spec))
            self.parts[c.name] = (QuantLoaders._as_rows(c, t), sl)
            self._maybe_done()
        return load

    def _maybe_done(self) -> None:
        if self.q is None or set(self.parts) != self.want:
            return
        o = self.owner
        q = self.q.view(torch.uint8) if o.kind == "int4" else self.q
        n, k = q.shape[0], q.shape[1]
        scale = zero = None
        for name, (t, sl) in self.parts.items():
            if o.kind == "int4":  # the packed words' values, or this rank's columns of them
                k = sl.stop - sl.start if sl is not None and sl.dim == 1 else min(self.main.shape[1], 2 * q.shape[1])
            if name.endswith("weight_shape"):
                continue
            part = _cut(t, sl, n, _blocks(o.spec, self.main.shape[1]), 1, name, self.main.name)
            if name.endswith("weight_zero_point"):
                zero = part
            else:
                scale = part
        bk = _blocks(o.spec, k)[1] if scale.shape[1] > 1 else k
        self.target(dequantize(o.kind, q, scale, zero, 1, bk, k))
        o.dequantized += 1
        self.q, self.parts = None, {}


def weights_summary(model: nn.Module) -> tuple[int, dict]:
    """(bytes of every weight the model holds, how each group is held): {"quantized": {form: {"tensors",
    "bytes"}}, "dense": {dtype: {"tensors", "bytes"}}}; a weight shared by two layers counts once."""
    quant: dict[str, dict] = {}
    dense: dict[str, dict] = {}
    seen = set()
    total = 0
    for m in model.modules():
        if isinstance(m, QuantizedWeight):
            b = m.nbytes()
            g = quant.setdefault(m.form(), {"tensors": 0, "bytes": 0})
            g["tensors"] += 1
            g["bytes"] += b
            total += b
            seen.update(id(p) for p in m.parameters())
            continue
    for p in model.parameters():
        if id(p) in seen:
            continue
        seen.add(id(p))
        b = p.numel() * p.element_size()
        key = str(p.dtype).replace("torch.", "") + (" (oneDNN packed)" if p.is_mkldnn else "")
        g = dense.setdefault(key, {"tensors": 0, "bytes": 0})
        g["tensors"] += 1
        g["bytes"] += b
        total += b
    return total, {"quantized": quant, "dense": dense}
