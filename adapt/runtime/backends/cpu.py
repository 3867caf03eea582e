"""The cpu backend's weight preparation: after loading, linears and MoE experts are packed once for the
CPU kernels that read them (backends/cpu_layouts.py: oneDNN's blocked layout, the fused kernels' column panels, the router panels).
"""

from __future__ import annotations

import torch


def prepare(model, device: torch.device, dtype: torch.dtype, ops, prepack: str = "auto") -> int:
    """Pack ``model``'s weights for the CPU kernels per ``prepack`` ("auto": every dtype, and the tiled
    layouts of the fused kernels when the cpu backend runs the MoE experts; "exact": only the dtypes whose
    oneDNN linear equals F.linear bitwise; "off": nothing). Returns the number of weights packed."""
    from adapt.runtime.backends.cpu_layouts import PACK_DTYPES_ALL, PACK_DTYPES_EXACT, can_prepack, prepack_linears

    if prepack == "off" or not can_prepack(device):
        return 0
    tiled = prepack == "auto" and "moe_experts_fused" in ops
    return prepack_linears(model, PACK_DTYPES_ALL if prepack == "auto" else PACK_DTYPES_EXACT, tiled=tiled)
