"""A checkpoint's weights handed to transformers modules one module at a time (the streamed reference).

The streamed reference builds the transformers model on the meta device and fills one decoder layer at
a time from the checkpoint's safetensors (``adapt.shard.checkpoint``: validated headers, ``pread`` at
the tensors' offsets, nothing mapped, so resident memory is what is loaded), in float32 as
``from_pretrained(dtype=float32)`` holds it: bfloat16 / float16 widened exactly, FP8 e4m3 blocks
dequantized with their ``_scale_inv`` (the DeepSeek-V3 layout). Routed experts are not loaded with their
layer: ``expert`` reads one expert when the router first selects it.

Names: a module parameter's checkpoint name is its model name, after the family's renames (Mixtral keeps
``block_sparse_moe``); the routed experts, which transformers fuses into ``gate_up_proj [E, 2I, H]`` and
``down_proj [E, H, I]``, are read per expert by the WeightLayout's roles (``expert_gate``/``up``/``down``).
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

import torch
import torch.nn as nn

from adapt.errors import CheckpointError
from adapt.layout import WeightLayout
from adapt.spec import ModelSpec

# model name fragment -> checkpoint name fragment, per family (transformers 5 renames these on load)
_RENAMES: dict[str, tuple[tuple[str, str], ...]] = {"mixtral": ((".mlp.", ".block_sparse_moe."),)}


def is_experts(module: nn.Module) -> bool:
    """A transformers fused-experts module (``gate_up_proj`` [E, 2I, H] and ``down_proj`` [E, H, I])."""
    g = module._parameters.get("gate_up_proj")
    d = module._parameters.get("down_proj")
    return g is not None and d is not None and g.dim() == 3 and d.dim() == 3


class WeightStream:
    """Reads tensors of one checkpoint in float32, counting the bytes read (stored bytes, scales included)."""

    def __init__(self, path: str | Path, spec: ModelSpec, layout: WeightLayout):
        from adapt.shard.checkpoint import open_checkpoint

        self.path = Path(path)
        self.spec = spec
        self.ckpt, _ = open_checkpoint(self.path)
        self.renames = _RENAMES.get(spec.family, ())
        self.block = tuple(spec.quant.block_size) if spec.quant is not None else (128, 128)
        self.experts: dict[tuple[int, str], dict[int, str]] = defaultdict(dict)
        for t in layout.main():
            if t.expert is not None and t.role in ("expert_gate", "expert_up", "expert_down") and t.is_param:
                self.experts[(t.layer, t.role)][t.expert] = t.name
        self.bytes_read = 0
        self.tensors_read = 0

    # ------------------------------------------------------------------------------------------ names

    def checkpoint_name(self, model_name: str) -> str:
        """The checkpoint's name for a model parameter (CheckpointError when it has none)."""
        if model_name in self.ckpt.tensors:
            return model_name
        for a, b in self.renames:
            alt = model_name.replace(a, b)
            if alt in self.ckpt.tensors:
                return alt
        if self.spec.tie_word_embeddings and model_name.endswith("lm_head.weight"):
            emb = model_name.replace("lm_head.weight", "model.embed_tokens.weight")
            if emb in self.ckpt.tensors:
                return emb
        raise CheckpointError(f"{self.path}: checkpoint has no tensor for {model_name!r}")

    def stored_bytes(self, name: str) -> int:
        """Bytes a read of ``name`` takes from the files (its FP8 scales included)."""
        n = self.ckpt.tensors[name].nbytes
        scale = self.ckpt.tensors.get(name + "_scale_inv")
        return n + (scale.nbytes if scale is not None else 0)

    # ------------------------------------------------------------------------------------------ reads

    def read(self, name: str, dim: int | None = None, start: int = 0, stop: int = 0) -> torch.Tensor:
        """Tensor ``name`` (or its [start, stop) along dim 0) in float32; FP8 dequantized by its block scales."""
        from adapt.shard.transform import dequant_slice

        t = self.ckpt.tensors[name]
        raw = self.ckpt.read(name, dim, start, stop)
        nbytes = raw.numel() * raw.element_size()
        if t.dtype.startswith("float8"):
            scale_name = name + "_scale_inv"
            if scale_name not in self.ckpt.tensors:
                raise CheckpointError(f"{self.path}: {name} is {t.dtype} with no {scale_name}")
            scale = self.ckpt.read(scale_name)
            nbytes += scale.numel() * scale.element_size()
            if dim is not None:  # only row ranges are read (embedding rows): the scale rows covering them
                scale = scale[start // self.block[0]:(stop - 1) // self.block[0] + 1]
            out = dequant_slice(raw, scale.float(), self.block, dim, start, "float32")
        elif t.dtype in ("int8", "int32", "uint8", "int4"):
            raise CheckpointError(f"{self.path}: {name} is {t.dtype}; the streamed reference reads float and "
                                  f"FP8 block-quantized checkpoints")
        else:
            out = raw.float()
        self.bytes_read += nbytes
        self.tensors_read += 1
        return out

    def rows(self, name: str, ids: list[int]) -> dict[int, torch.Tensor]:
        """Rows ``ids`` of a [V, H] tensor (the embedding), each run of consecutive ids read once."""
        want = sorted(set(ids))
        got: dict[int, torch.Tensor] = {}
        i = 0
        while i < len(want):
            j = i
            while j + 1 < len(want) and want[j + 1] == want[j] + 1:
                j += 1
            block = self.read(name, 0, want[i], want[j] + 1)
            for k in range(want[i], want[j] + 1):
                got[k] = block[k - want[i]]
            i = j + 1
        return got

    def expert_bytes(self, layer: int, expert: int) -> int:
        return sum(self.stored_bytes(self.experts[(layer, r)][expert])
                   for r in ("expert_gate", "expert_up", "expert_down"))

    def expert(self, layer: int, expert: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(gate_up [2I, H], down [H, I]) of one routed expert, as transformers fuses them on load."""
        names = [self.experts[(layer, r)].get(expert) for r in ("expert_gate", "expert_up", "expert_down")]
        if None in names:
            raise CheckpointError(f"the weight layout has no expert {expert} in layer {layer}")
        gate, up, down = (self.read(self.checkpoint_name(n)) for n in names)
        return torch.cat([gate, up], dim=0), down

    # ------------------------------------------------------------------------------------------ modules

    def module_tensors(self, module: nn.Module, prefix: str) -> list[tuple[nn.Module, str, str, bool]]:
        """(owner, attribute, checkpoint name, is_param) for every weight of ``module`` except fused experts."""
        out = []
        for mname, m in module.named_modules(prefix=prefix.rstrip(".")):
            if is_experts(m):
                continue
            for pname, p in m._parameters.items():
                if p is not None:
                    out.append((m, pname, self.checkpoint_name(f"{mname}.{pname}"), True))
            for bname, b in m._buffers.items():
                if b is None or bname in m._non_persistent_buffers_set:
                    continue
                out.append((m, bname, self.checkpoint_name(f"{mname}.{bname}"), False))
        return out

    def module_bytes(self, module: nn.Module, prefix: str) -> int:
        """float32 bytes ``load`` will hold for ``module`` (fused experts excluded)."""
        total = 0
        for m, attr, _name, is_param in self.module_tensors(module, prefix):
            t = m._parameters[attr] if is_param else m._buffers[attr]
            total += t.numel() * 4
        return total

    def load(self, module: nn.Module, prefix: str) -> int:
        """Fill ``module``'s weights (fused experts excluded) from the checkpoint; returns float32 bytes held."""
        held = 0
        for m, attr, name, is_param in self.module_tensors(module, prefix):
            cur = m._parameters[attr] if is_param else m._buffers[attr]
            t = self.read(name)
            if tuple(t.shape) != tuple(cur.shape):
                raise CheckpointError(f"{self.path}: {name} has shape {list(t.shape)}, the model wants "
                                      f"{list(cur.shape)}")
            if is_param:
                m._parameters[attr] = nn.Parameter(t, requires_grad=False)
            else:
                m._buffers[attr] = t
            held += t.numel() * 4
        for n, b in module.named_buffers():
            if b.is_meta:
                raise CheckpointError(f"cannot stream {prefix}{n}: a buffer the checkpoint does not hold")
        return held

    @staticmethod
    def unload(module: nn.Module) -> None:
        """Back to meta tensors: the memory of ``load`` is released."""
        module.to("meta")

    def close(self) -> None:
        self.ckpt.close()
