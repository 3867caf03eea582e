"""A linear on column-panel-packed weights: the tiled MoE kernel's FMA GEMM for a dense layer.

The weight [N, K] is packed once at load (``pack_linear``) into panels [N / P, K, P] of its transpose (P the
build's panel: 64 columns with AVX-512, 16 with AVX2), the layout the MoE experts use. The GEMM streams the
panels in order, two threads on halves of them, prefetching the next panel spread over the row blocks
(csrc/moe_gemm.h). For decode it streams the weights faster than oneDNN's packed float32 linear on the
reference Xeon: the bench dense model's 400 MB of weights in model order, 1 row 1.18-1.22x, 16 rows
1.12-1.16x; at 64-1024 rows (one weight, in cache) 2-5% faster. Sums run in k order per
output, in float32: not bitwise with F.linear (the oneDNN linear is not either), within the float32
tolerance. ``prepack_linears`` (backends/cpu_layouts.py) takes it for float32 weights whose N is a multiple
of the panel, and for bfloat16 ones on a CPU without bf16 dot products (no AMX or AVX512-BF16: AMD Zen 3, where
oneDNN cannot pack bfloat16 and F.linear runs it several times slower than float32), and float16 ones where oneDNN
cannot pack float16 (no AVX512-FP16 or AMX-FP16; F.linear took 3.1 ms for a [16, 768] x [768, 2048] float16 linear on a
2-core AMD EPYC, 1.1 ms in float32). There the panels hold the 16-bit values, widened to float32 as they are
read, x's rows are taken as float32, and each output rounds once, after the bias.
"""

import torch
import torch.nn.functional as F

from . import fused
from .moe_tiled import tiled_panel, tiled_vnni

_DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # what the FMA GEMM reads (16-bit widened)


def linear_tiled(x: torch.Tensor, w_panels: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, W, bias) for W packed by ``pack_linear``: x [..., K] float32, bfloat16 or float16 (W's dtype) ->
    [..., N]. The fused CPU kernel runs it where it takes the tensors (CPU, no autograd); otherwise W is
    unpacked (a copy)."""
    ext = fused.module()
    if (ext is not None and x.device.type == "cpu" and x.dtype in _DTYPES and w_panels.dtype == x.dtype
            and w_panels.shape[2] == int(ext.PANEL) > 0
            and not (torch.is_grad_enabled() and (x.requires_grad or w_panels.requires_grad))):
        rows = x.reshape(-1, x.shape[-1]).contiguous()
        y = ext.linear_tiled(rows, w_panels, None if bias is None else bias.contiguous())
        return y.view(*x.shape[:-1], y.shape[-1])
    return linear_tiled_ref(x, w_panels, bias)


def linear_tiled_ref(x: torch.Tensor, w_panels: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The twin: unpack W and call F.linear."""
    return F.linear(x, unpack_linear(w_panels), bias)



def fma_panels(dtype: torch.dtype) -> bool:
    """Whether a linear weight of ``dtype`` runs here on the FMA GEMM's column panels: float32; bfloat16 where
    the CPU has no bf16 dot product (no vnni layout: AMX and AVX512-BF16 CPUs keep oneDNN's native bfloat16
    linear); float16 where oneDNN cannot pack it (CPUs with FP16 arithmetic keep oneDNN's)."""
    if dtype not in _DTYPES or tiled_vnni(dtype):
        return False
    if dtype == torch.float16:
        from .moe_experts import onednn_packs

        if onednn_packs(dtype):
            return False
    return tiled_panel(dtype) > 0


def linear_tiles(n: int, k: int, dtype: torch.dtype) -> bool:
    """Whether ``linear_tiled`` takes an [N, K] weight of ``dtype`` here: ``fma_panels``, N a multiple of the
    panel."""
    return fma_panels(dtype) and n % tiled_panel(dtype) == 0 and k > 0


def pack_linear(w: torch.Tensor, panel: int, empty=None) -> torch.Tensor:
    """[N, K] -> [N / panel, K, panel]: column panels of the transposed weight. ``empty(shape, dtype)``
    allocates the result on w's device (the loader's: host_memory.empty_huge on the CPU); default a
    contiguous copy."""
    n, k = w.shape
    assert n % panel == 0, (n, panel)
    src = w.detach().reshape(n // panel, panel, k).transpose(1, 2)
    return src.contiguous() if empty is None else empty(src.shape, w.dtype).copy_(src)


def unpack_linear(w_panels: torch.Tensor) -> torch.Tensor:
    """[N / panel, K, panel] -> [N, K] (a copy)."""
    p, k, panel = w_panels.shape
    return w_panels.transpose(1, 2).reshape(p * panel, k)


def panel_rows(w_panels: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Rows ``ids`` of W from its panels ([N / panel, K, panel] -> [*ids.shape, K]): an embedding lookup on a
    weight packed for a tied head."""
    p = w_panels.shape[2]
    return w_panels[ids // p, :, ids % p]

