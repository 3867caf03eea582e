"""RMSNorm and fused residual-add + RMSNorm, numerically identical to transformers' LlamaRMSNorm.

# Legend: T tokens ("..." any leading dims), H hidden size.

transformers computes: h = x.float(); h = h * rsqrt(mean(h^2) + eps); return weight * h.to(x.dtype).
The output dtype is therefore promote(weight.dtype, x.dtype), exactly as in transformers.
"""

import torch
import torch.nn.functional as F

from . import fused

_FUSED = (torch.float32, torch.bfloat16)


def _fused(x: torch.Tensor, weight: torch.Tensor):
    # the fused CPU kernel (fused.py) when installed and it takes these tensors
    ext = fused.module()
    if ext is None or x.device.type != "cpu" or x.dtype not in _FUSED or weight.dtype != x.dtype or x.numel() == 0:
        return None
    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad):  # autograd needs the torch ops
        return None
    return ext


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """RMSNorm of x [..., H] with weight [H]; statistics in float32, cast back before the weight."""
    ext = _fused(x, weight)
    if ext is not None:  # one pass; its float32 mean sums in another order (a few ulp), bfloat16 out bitwise
        return ext.rms_norm(x.contiguous(), weight.contiguous(), eps)
    # F.rms_norm is the same h * rsqrt(mean(h^2) + eps) in one op (bitwise equal to the three-op form,
    # checked in tests/runtime/kernels/test_norm_activation.py), saving four dispatches per call
    h = F.rms_norm(x.to(torch.float32), (x.shape[-1],), eps=eps)  # [..., H] float32
    return weight * h.to(x.dtype)


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6
) -> tuple[torch.Tensor, torch.Tensor]:
    """new_residual = residual + x (in the input dtype, as the decoder layer does); returns
    (rms_norm(new_residual), new_residual), both [..., H]."""
    ext = _fused(x, weight)
    if ext is not None and residual.dtype == x.dtype and residual.shape == x.shape:
        out, new_residual = ext.add_rms_norm(x.contiguous(), residual.contiguous(), weight.contiguous(), eps)
        return out, new_residual
    new_residual = residual + x
    return rms_norm(new_residual, weight, eps), new_residual


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """Reference twin: one row at a time."""
    flat = x.reshape(-1, x.shape[-1])
    rows = []
    for row in flat:
        r = row.float()
        r = r / torch.sqrt((r * r).mean() + eps)
        rows.append(weight * r.to(x.dtype))
    if not rows:
        return (weight * x).reshape(x.shape)
    return torch.stack(rows).reshape(*x.shape[:-1], -1)


def fused_add_rms_norm_ref(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference twin of fused_add_rms_norm."""
    new_residual = residual + x
    return rms_norm_ref(new_residual, weight, eps), new_residual
