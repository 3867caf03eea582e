"""Tolerance rules for kernel tests (origins in DESIGN.md, "Numerics").

FP32_ATOL / FP32_RTOL: a float32 kernel against its float32 twin differs only by summation order
(tiling, online softmax), ~1e-6 relative on these small shapes; 1e-5 leaves a margin.

assert_lowp_close: FlashAttention's test rule. With the float32 twin as the reference, the
low-precision kernel's max error must not exceed FACTOR (2) times the max error of the plain-torch
twin run in the same low precision, plus a tiny absolute floor so that an exact twin does not
demand an exact kernel.
"""

import torch

FP32_ATOL = 1e-5
FP32_RTOL = 1e-5
LOWP_FACTOR = 2.0
LOWP_FLOOR = 1e-6


def assert_fp32_close(actual: torch.Tensor, expected: torch.Tensor, what: str = "") -> None:
    """Float32 kernel vs float32 twin, within FP32_ATOL + FP32_RTOL * |expected|."""
    torch.testing.assert_close(
        actual.float(), expected.float(), atol=FP32_ATOL, rtol=FP32_RTOL, msg=lambda m: f"{what}: {m}"
    )


def lowp_errors(kernel_lowp: torch.Tensor, twin_lowp: torch.Tensor, twin_fp32: torch.Tensor) -> tuple[float, float]:
    """(max |kernel - fp32 ref|, max |lowp twin - fp32 ref|)."""
    ref = twin_fp32.float()
    return (kernel_lowp.float() - ref).abs().max().item(), (twin_lowp.float() - ref).abs().max().item()


def assert_lowp_close(
    kernel_lowp: torch.Tensor,
    twin_lowp: torch.Tensor,
    twin_fp32: torch.Tensor,
    what: str = "",
    factor: float = LOWP_FACTOR,
) -> None:
    """FlashAttention's rule: err(kernel_lowp) <= factor * err(twin_lowp) + LOWP_FLOOR vs twin_fp32."""
    assert torch.isfinite(kernel_lowp.float()).all(), f"{what}: non-finite output"
    err_k, err_t = lowp_errors(kernel_lowp, twin_lowp, twin_fp32)
    assert err_k <= factor * err_t + LOWP_FLOOR, f"{what}: kernel err {err_k:.3g} > {factor} x twin err {err_t:.3g}"
