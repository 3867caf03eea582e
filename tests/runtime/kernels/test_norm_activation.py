import pytest
import torch
from transformers.activations import ACT2FN
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from adapt.runtime.kernels import fused
from adapt.runtime.kernels.activation import silu_and_mul, silu_and_mul_ref
from adapt.runtime.kernels.norm import fused_add_rms_norm, fused_add_rms_norm_ref, rms_norm, rms_norm_ref

from ._tol import assert_fp32_close

pytestmark = pytest.mark.usefixtures("kernel_form")


def _same(got, expected, kernel_form):
    # the torch forms are bitwise transformers'; the fused float32 kernels sum the mean (and take exp) in
    # their own order, a few ulp away; in bfloat16 they round where the torch ops do
    if kernel_form == "fused" and got.dtype == torch.float32:
        assert got.dtype == expected.dtype
        assert_fp32_close(got, expected)
    else:
        assert got.dtype == expected.dtype and torch.equal(got, expected)


@pytest.mark.parametrize("x_dtype,w_dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                                             (torch.bfloat16, torch.float32)])
def test_rms_norm_bit_exact_vs_transformers(x_dtype, w_dtype, kernel_form):
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(3, 5, 64, generator=g) * 3).to(x_dtype)
    norm = LlamaRMSNorm(64, eps=1e-5)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(64, generator=g) + 0.5)
    norm = norm.to(w_dtype)
    with torch.no_grad():
        expected = norm(x)
    got = rms_norm(x, norm.weight.detach(), 1e-5)
    _same(got, expected, kernel_form)
    if x_dtype == torch.float32:
        assert_fp32_close(rms_norm_ref(x, norm.weight.detach(), 1e-5), expected)


def test_fused_add_rms_norm():
    g = torch.Generator().manual_seed(1)
    x, res, w = torch.randn(7, 32, generator=g), torch.randn(7, 32, generator=g), torch.rand(32, generator=g)
    normed, new_res = fused_add_rms_norm(x, res, w, 1e-6)
    assert torch.equal(new_res, res + x) and torch.equal(normed, rms_norm(res + x, w, 1e-6))
    normed_r, new_res_r = fused_add_rms_norm_ref(x, res, w, 1e-6)
    assert_fp32_close(normed, normed_r)
    assert torch.equal(new_res, new_res_r)
    xb, rb = x.bfloat16(), res.bfloat16()
    nb, rb2 = fused_add_rms_norm(xb, rb, w.bfloat16(), 1e-6)
    assert nb.dtype == torch.bfloat16 and torch.equal(rb2, rb + xb)


@pytest.mark.parametrize("n", [24, 2048 + 5])  # the fused kernel's 16-lane body and its scalar tail
def test_silu_and_mul(n, kernel_form):
    x = torch.randn(4, 3, 2 * n, generator=torch.Generator().manual_seed(2)) * 4
    gate, up = x[..., :n], x[..., n:]
    _same(silu_and_mul(x), ACT2FN["silu"](gate) * up, kernel_form)
    assert_fp32_close(silu_and_mul_ref(x), silu_and_mul(x))
    xb = x.bfloat16()
    _same(silu_and_mul(xb), ACT2FN["silu"](xb[..., :n]) * xb[..., n:], kernel_form)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_rms_norm_equals_the_three_op_form_bitwise(dtype, kernel_form):
    # the torch form uses F.rms_norm; it must stay bitwise equal to h * rsqrt(mean(h^2) + eps) (transformers)
    g = torch.Generator().manual_seed(11)
    for shape in [(1, 64), (16, 768), (512, 768), (3, 5, 96)]:
        x = (torch.randn(*shape, generator=g) * 3).to(dtype)
        w = (torch.rand(shape[-1], generator=g) + 0.5).to(dtype)
        h = x.float()
        expected = w * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)).to(dtype)
        _same(rms_norm(x, w, 1e-6), expected, kernel_form)
        r = (torch.randn(*shape, generator=g) * 3).to(dtype)
        normed, new_res = fused_add_rms_norm(x, r, w, 1e-6)
        with fused.disabled():
            normed_t, new_res_t = fused_add_rms_norm(x, r, w, 1e-6)
        assert torch.equal(new_res, new_res_t)
        _same(normed, normed_t, kernel_form)
