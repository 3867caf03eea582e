"""Load a model's weights tensor by tensor: HF checkpoint directories and single-rank `adapt shard` output.

The model is built on the meta device, materialized empty on the target device, then every tensor of
the WeightLayout that this rank holds is read (only its slice, chosen by ``adapt.plan.tensor_slice``)
and handed to the loader of the layer that declared it. A checkpoint missing a tensor the rank needs,
or holding one of the wrong shape, is a CheckpointError naming it.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn as nn
from safetensors import safe_open

from adapt.errors import CheckpointError
from adapt.layout import WeightLayout
from adapt.plan import TensorSlice, tensor_slice
from adapt.runtime.host_memory import empty_huge
from adapt.runtime.models.layers import collect_loaders
from adapt.runtime.parallel import ParallelContext
from adapt.spec import ModelSpec


class SafetensorsReader:
    """Tensors by name over a set of safetensors files (single file, index.json-sharded, or a rank dir)."""

    def __init__(self, files: list[Path]):
        if not files:
            raise CheckpointError("no .safetensors files found")
        self._handles = {}
        self.where: dict[str, Path] = {}
        for f in files:
            try:
                h = safe_open(str(f), framework="pt")
            except Exception as e:  # safetensors raises its own error types
                raise CheckpointError(f"cannot read {f}: {e}") from None
            self._handles[f] = h
            for k in h.keys():
                self.where[k] = f

    @classmethod
    def from_dir(cls, path: Path) -> "SafetensorsReader":
        index = path / "model.safetensors.index.json"
        if index.is_file():
            try:
                wm = json.loads(index.read_text())["weight_map"]
            except (ValueError, KeyError) as e:
                raise CheckpointError(f"{index}: malformed index ({e})") from None
            files = sorted({path / f for f in wm.values()})
            missing = [f for f in files if not f.is_file()]
            if missing:
                raise CheckpointError(f"{index} names {missing[0].name}, which is missing")
            return cls(files)
        return cls(sorted(path.glob("*.safetensors")))

    def __contains__(self, name: str) -> bool:
        return name in self.where

    def read(self, name: str, sl: TensorSlice | None = None) -> torch.Tensor:
        """The tensor, or only [start, stop) along ``sl.dim``."""
        if name not in self.where:
            raise CheckpointError(f"checkpoint has no tensor {name!r}")
        h = self._handles[self.where[name]]
        if sl is None or sl.whole:
            return h.get_tensor(name)
        part = h.get_slice(name)
        index = [slice(None)] * len(part.get_shape())
        index[sl.dim] = slice(sl.start, sl.stop)
        return part[tuple(index)]


def materialize(model: nn.Module, device: torch.device, dtype: torch.dtype) -> None:
    """Replace the meta parameters by empty ones on ``device`` (float32 where a layer asks: routers); then a
    module with a ``materialized(empty)`` method is handed the allocator (``empty(shape, dtype)``), before any
    weight loads (runtime/quant/experts.py stacks its experts' tensors there)."""

    def empty(shape, dt):
        # on the CPU in transparent huge pages where large (host_memory.empty_huge: fewer TLB misses as a
        # decode step streams them)
        return empty_huge(shape, dt) if device.type == "cpu" else torch.empty(shape, dtype=dt, device=device)

    for module in model.modules():
        for name, p in list(module._parameters.items()):
            if p is None:
                continue
            keep = getattr(p, "keep_fp32", False)
            held = getattr(p, "keep_dtype", False)  # quantized values and scales (runtime/quant/weight.py)
            dt = p.dtype if held else torch.float32 if keep else dtype
            transposed = getattr(p, "store_transposed", False)  # [..., M, N] held as a view of [..., N, M]
            shape = (*p.shape[:-2], p.shape[-1], p.shape[-2]) if transposed else tuple(p.shape)
            data = empty(shape, dt)
            if transposed:
                data = data.transpose(-1, -2)
            new = nn.Parameter(data, requires_grad=False)
            new.store_transposed = getattr(p, "store_transposed", False)
            new.keep_fp32 = keep
            new.keep_dtype = held
            module._parameters[name] = new
    for module in list(model.modules()):
        hook = getattr(module, "materialized", None)
        if callable(hook):
            hook(empty)


def load_weights(model: nn.Module, spec: ModelSpec, layout: WeightLayout, ctx: ParallelContext,
                 reader: SafetensorsReader, presliced: bool = False) -> int:
    """Copy every tensor this rank holds into the model; returns the number of tensors loaded.

    presliced: the files already hold this rank's slices (``adapt shard`` output), so read them whole.
    """
    loaders = collect_loaders(model)
    quant = None
    if spec.quant is not None:  # quantized weights: their stored tensors' loaders (runtime/quant/load.py)
        from adapt.runtime.quant.load import QuantLoaders

        held = None
        if ctx.plan is not None and presliced:  # the companions in the files cover this rank's slices
            def held(t):
                return tensor_slice(t, ctx.plan, ctx.rank, spec)
        quant = QuantLoaders(model, spec, layout, loaders, held)
        loaders = quant.loaders
    done = set()
    for t in layout.main():
        if t.name not in loaders:
            continue
        sl = None
        if ctx.plan is not None and not presliced:
            # a quantized weight's companion is read whole and cut by its weight's slice
            sl = tensor_slice(layout[t.scale_of] if t.scale_of else t, ctx.plan, ctx.rank, spec)
            if sl is None:
                continue
        if t.name not in reader:
            raise CheckpointError(f"checkpoint is missing tensor {t.name!r} (layout of {spec.model_type})")
        if t.scale_of is not None:
            loaders[t.name](reader.read(t.name), sl)
        else:
            loaders[t.name](reader.read(t.name, stored_slice(t, sl)))
        done.add(t.name)
    left = sorted(set(loaders) - done)
    if left:
        raise CheckpointError(f"no checkpoint tensor for {left[0]!r} ({len(left)} missing)")
    return len(done)


def stored_slice(t, sl: TensorSlice | None) -> TensorSlice | None:
    """A slice of t's logical shape in its file's terms: int4 packs eight values to an int32 along
    ``packed_dim``, so a slice there must start on a word."""
    if sl is None or sl.whole or t.packed_dim != sl.dim:
        return sl
    if sl.start % 8 or (sl.stop % 8 and sl.stop != t.shape[sl.dim]):
        raise CheckpointError(f"{t.name}: the slice [{sl.start}, {sl.stop}) of dim {sl.dim} cuts an int32 word of "
                              "eight int4 values (8 must divide the split)")
    return TensorSlice(sl.name, sl.dim, sl.start // 8, -(-sl.stop // 8))
