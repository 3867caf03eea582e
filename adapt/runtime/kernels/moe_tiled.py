"""The fused tiled MoE kernel: the whole routed MoE on the CPU in one call (csrc/moe_gemm.h).

# Legend: T tokens, H hidden size, I expert intermediate size, K top-k, E local experts.

Each expert's weights are packed once at load (``pack_tiled``): float32 in column panels for an FMA
micro-kernel, bfloat16 in AMX tiles (read by AMX, or by AVX512-BF16's vdpbf16ps where the CPU has no AMX),
or, on a CPU with neither (AMD Zen 3, AVX2), in the float32 layout's panels, widened to float32 as the FMA
micro-kernel reads them; float16 in those panels too, widened the same way (F16C, AVX-512). One call groups
the slots by expert (a counting sort), gathers each expert's rows, runs gate|up, SiLU-and-mul and down, and
the weighted combine, with no torch op between them: on a CPU, each torch op between two weight GEMMs costs a
fixed 15-25 us, and oneDNN re-packs stacked bfloat16 weights on every call. Rounding follows the torch form:
in bfloat16 (float16 alike), gate|up and down round to bfloat16 after their float32 accumulation, silu
rounds, then the product; the combine sums in float32. cpu_layouts.pack_experts takes it at load where a timed trial
says it wins. On a 2-core AMX Xeon, 32 experts top-4, H 512, I 256, experts alone, stacked / tiled, ms:
bfloat16 512 tokens 5.7 / 1.6, 16 tokens 2.7 / 0.55; float32 512 tokens 8.7 / 5.7.
"""

import torch

from . import fused
from .moe_experts import moe_experts_fused, moe_experts_fused_ref


def moe_experts_tiled(
    x: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    expert_offset: int = 0,
    choose=None,
) -> torch.Tensor:
    """moe_experts_fused with the experts packed by ``pack_tiled`` (w_gate_up from [E, 2I, H], w_down from
    [E, H, I]): out [T, H] (x.dtype). The fused CPU kernel runs it where it takes the tensors (CPU, no
    autograd); otherwise the weights are unpacked (a copy) and the stacked kernel runs."""
    ext = fused.module()
    if (ext is not None and x.is_cpu and not (torch.is_grad_enabled() and x.requires_grad)
            and x.dtype in _dtypes(ext)):
        # no conversion dispatched where none is needed (each costs ~10 us right after the kernel's last call
        # has swept the caches)
        ids = ids if ids.dtype == torch.long else ids.long()
        weights = weights if weights.dtype == torch.float32 else weights.float()
        return ext.moe_experts_tiled(x.contiguous(), ids.contiguous(), weights.contiguous(), w_gate_up, w_down,
                                     expert_offset)
    return moe_experts_fused(x, weights, ids, unpack_tiled(w_gate_up), unpack_tiled(w_down), expert_offset, choose)


def _dtypes(ext) -> frozenset:
    """The dtypes the installed module's tiled kernel runs (asked once per module: it probes AMX)."""
    if ext not in _DTYPES:
        _DTYPES[ext] = frozenset(getattr(torch, d) for d in ext.moe_tiled_dtypes())
    return _DTYPES[ext]


_DTYPES: dict = {}


def tiled_panel(dtype: torch.dtype) -> int:
    """Columns per packed block of the tiled kernel for ``dtype`` on this build and host (0: it does not
    run): the FMA kernel's panel (64 with AVX-512, 16 with AVX2) for float32, for bfloat16 where the CPU
    has no bf16 dot product, and for float16 where the vector layer converts it (F16C, AVX-512; the 16-bit
    weights widened to float32 as they are read); 16 for bfloat16 in the vnni
    layout (an AMX tile; the AVX512-BF16 form reads the same layout). The installed module's, also inside
    fused.disabled(): the torch form then unpacks the same layout."""
    ext = fused.installed()
    if ext is None or dtype not in _dtypes(ext):
        return 0
    return 16 if tiled_vnni(dtype) else int(ext.PANEL)


def tiled_vnni(dtype: torch.dtype) -> bool:
    """Whether the tiled kernel takes ``dtype`` in the vnni layout here: bfloat16 on a CPU with AMX (granted)
    or AVX512-BF16. Elsewhere bfloat16 takes the float32 panels' layout and the FMA GEMM (AMD Zen 3, AVX2)."""
    ext = fused.installed()
    return (dtype == torch.bfloat16 and ext is not None and dtype in _dtypes(ext)
            and ext.moe_tiled_bf16_gemm() in ("amx", "avx512_bf16"))


def tiles(n: int, k: int, dtype: torch.dtype) -> bool:
    """Whether the tiled kernel takes a [N, K] expert weight in ``dtype`` here: in panels, N a multiple of
    the panel; in the vnni layout, N and K multiples of 32 (the kernel takes two 16-column tiles at a time, a
    tile holds 32 values of k)."""
    p = tiled_panel(dtype)
    if tiled_vnni(dtype):
        return p > 0 and n % 32 == 0 and k % 32 == 0
    return p > 0 and n % p == 0


def pack_tiled(w: torch.Tensor, panel: int, vnni: bool | None = None, empty=None) -> torch.Tensor:
    """Stacked expert weights [E, N, K] (any strides) -> the tiled kernel's layout: vnni (bfloat16 only)
    [E, N/16, K/32, 16, 32] (each [16, 32] block one AMX B tile: 16 pairs of k by 16 columns), or panels [E,
    N/panel, K, panel] (column panels of the transposed weight). ``vnni``: None takes this host's form for
    w's dtype (``tiled_vnni``). Packed expert by expert into the result, so that a load holds one expert's
    temporary, not a second copy of the layer. ``empty(shape, dtype)`` allocates the result on w's device
    (the loader's: host_memory.empty_huge on the CPU); torch.empty by default."""
    e, n, k = w.shape
    vnni = tiled_vnni(w.dtype) if vnni is None else vnni
    shape = (e, n // 16, k // 32, 16, 32) if vnni else (e, n // panel, k, panel)
    out = empty(shape, w.dtype) if empty is not None else torch.empty(shape, dtype=w.dtype, device=w.device)
    for i in range(e):
        wi = w[i]
        if vnni:  # [nb, c, kb, r, q] -> [nb, kb, r, c, q]
            blocks = wi.reshape(n // 16, 16, k // 32, 16, 2).permute(0, 2, 3, 1, 4)
            out[i].view(n // 16, k // 32, 16, 16, 2).copy_(blocks)
        else:  # [nb, c, k] -> [nb, k, c]
            out[i].copy_(wi.reshape(n // panel, panel, k).permute(0, 2, 1))
    return out


def unpack_tiled(p: torch.Tensor) -> torch.Tensor:
    """pack_tiled's inverse: [E, N, K]."""
    if p.dim() == 5:
        e, nb, kb = p.shape[:3]
        return p.view(e, nb, kb, 16, 16, 2).permute(0, 1, 4, 2, 3, 5).reshape(e, nb * 16, kb * 32)
    e, nb, k, panel = p.shape
    return p.permute(0, 1, 3, 2).reshape(e, nb * panel, k)


def moe_experts_tiled_ref(x, weights, ids, w_gate_up, w_down, expert_offset=0, choose=None):
    """Reference twin of moe_experts_tiled: unpack the weights and run the per-token loop."""
    return moe_experts_fused_ref(x, weights, ids, unpack_tiled(w_gate_up), unpack_tiled(w_down), expert_offset)
