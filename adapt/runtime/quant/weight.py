"""QuantizedWeight: a linear's weight held as the checkpoint stores it (fp8 blocks, int8 channels, int4 groups).

It takes the place of a linear's ``weight`` parameter (``prepare`` in load.py); the linear's forward calls
``layers.linear(x, weight, bias)``, which hands it to this module. The parameters are the quantized values,
their float32 scales and (int4 with zero points) int8 zero points, flagged ``keep_dtype`` so that
``loader.materialize`` allocates them as they are.

Held forms (``kernels/quant_linear.py`` legend): fp8 q [N, K] float8_e4m3fn, scale [ceil(N / rb), ceil(K / 128)]
with rb 128 (the checkpoint's blocks) or 1 (one scale row per weight row, where fused or sliced rows do not
start on a block edge); int8 q [N, K], scale [N, 1]; int4 q [N, 4 * ceil(K / 8)] uint8 (the int32 words'
bytes), scale [N, ceil(K / group)], zero [N, ceil(K / group)] int8 or none. ``act="int8"`` (W8A8, W4A8): the
forward quantizes x per row first (kernels/quant_linear.py).
"""

from __future__ import annotations

import torch
import torch.nn as nn

from adapt.runtime.kernels.quant_linear import dequantize, quant_linear, quant_linear_ref
from adapt.runtime.module import Module


def _param(shape: tuple[int, ...], dtype: torch.dtype) -> nn.Parameter:
    p = nn.Parameter(torch.empty(shape, dtype=dtype), requires_grad=False)
    p.keep_dtype = True
    return p


class QuantizedWeight(Module):
    """An [N, K] weight held quantized; ``sources``: (checkpoint weight name, first row, rows) of each matrix
    fused into it (q|k|v, gate|up), whose stored tensors the loaders (load.py) copy in; ``act``: how its inputs
    are taken (None as they are, "int8" quantized per row)."""

    def __init__(self, kind: str, n: int, k: int, rb: int, bk: int, zero: bool, sources: list[tuple[str, int, int]],
                 fused: bool, act: str | None = None):
        super().__init__()
        self.kind, self.n, self.k, self.rb, self.bk, self.act = kind, n, k, rb, bk, act
        self.sources, self.fused = sources, fused
        groups = -(-k // bk)
        if kind == "int4":
            self.q = _param((n, 4 * -(-k // 8)), torch.uint8)
        else:
            self.q = _param((n, k), torch.float8_e4m3fn if kind == "fp8" else torch.int8)
        self.scale = _param((-(-n // rb), groups), torch.float32)
        self.zero = _param((n, groups), torch.int8) if zero else None

    @property
    def shape(self) -> torch.Size:
        return torch.Size((self.n, self.k))

    def forward(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        fn = quant_linear if self.fused else quant_linear_ref
        return fn(x, self.kind, self.q, self.scale, self.zero, self.rb, self.bk, self.k, bias, self.act)

    def dequantized(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The real weight [N, K] (a copy)."""
        return dequantize(self.kind, self.q, self.scale, self.zero, self.rb, self.bk, self.k, dtype)

    def nbytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.parameters())

    def form(self) -> str:
        """How it is held, for engine stats: 'fp8 128x128 blocks', 'int8 per channel', 'int4 g128 (zero points)',
        with ', int8 activations per token' where its inputs are quantized."""
        held = self._held()
        return held + (", int8 activations per token" if self.act == "int8" else "")

    def _held(self) -> str:
        if self.kind == "fp8":
            return f"fp8 {self.rb}x{self.bk} blocks" if self.rb > 1 else f"fp8 1x{self.bk} row blocks"
        if self.kind == "int8":
            return "int8 per channel"
        what = "per channel" if self.bk >= self.k else f"g{self.bk}"
        return f"int4 {what}" + (" (zero points)" if self.zero is not None else "")

    def extra_repr(self) -> str:
        return f"{self.form()}, [{self.n}, {self.k}], kernel {'fused' if self.fused else 'twin'}"
