"""A float32 linear on column-panel-packed weights: the tiled MoE kernel's FMA GEMM for a dense layer.

The weight [N, K] is packed once at load (``pack_linear``) into panels [N / P, K, P] of its transpose (P the
build's panel: 64 columns with AVX-512, 16 with AVX2), the layout the MoE experts use. The GEMM streams the
panels in order, two threads on halves of them, prefetching the next panel spread over the row blocks
(csrc/moe_gemm.h). For decode it streams the weights faster than oneDNN's packed float32 linear on the
reference Xeon: the bench dense model's 400 MB of weights in model order, 1 row 1.18-1.22x, 16 rows
1.12-1.16x; at 64-1024 rows (one weight, in cache) 2-5% faster. Sums run in k order per
output, in float32: not bitwise with F.linear (the oneDNN linear is not either), within the float32
tolerance. ``prepack_linears`` takes it for float32 weights whose N is a multiple of the panel.
"""

import torch
import torch.nn.functional as F

from . import fused
from .moe_tiled import tiled_panel


def linear_tiled(x: torch.Tensor, w_panels: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, W, bias) for W packed by ``pack_linear``: x [..., K] float32 -> [..., N]. The fused CPU
    kernel runs it where it takes the tensors (CPU, no autograd); otherwise W is unpacked (a copy)."""
    ext = fused.module()
    if (ext is not None and x.device.type == "cpu" and x.dtype == torch.float32
            and w_panels.shape[2] == tiled_panel(torch.float32)
            and not (torch.is_grad_enabled() and (x.requires_grad or w_panels.requires_grad))):
        rows = x.reshape(-1, x.shape[-1]).contiguous()
        y = ext.linear_tiled(rows, w_panels, None if bias is None else bias.contiguous())
        return y.view(*x.shape[:-1], y.shape[-1])
    return linear_tiled_ref(x, w_panels, bias)


def linear_tiled_ref(x: torch.Tensor, w_panels: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The twin: unpack W and call F.linear."""
    return F.linear(x, unpack_linear(w_panels), bias)


def linear_tiles(n: int, k: int, dtype: torch.dtype) -> bool:
    """Whether ``linear_tiled`` takes an [N, K] weight of ``dtype`` here: float32, N a multiple of the panel."""
    p = tiled_panel(dtype) if dtype == torch.float32 else 0
    return p > 0 and n % p == 0 and k > 0


def pack_linear(w: torch.Tensor, panel: int) -> torch.Tensor:
    """[N, K] -> [N / panel, K, panel]: column panels of the transposed weight."""
    n, k = w.shape
    assert n % panel == 0, (n, panel)
    return w.detach().reshape(n // panel, panel, k).transpose(1, 2).contiguous()


def unpack_linear(w_panels: torch.Tensor) -> torch.Tensor:
    """[N / panel, K, panel] -> [N, K] (a copy)."""
    p, k, panel = w_panels.shape
    return w_panels.transpose(1, 2).reshape(p * panel, k)
