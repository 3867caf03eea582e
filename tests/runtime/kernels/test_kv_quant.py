import torch

from adapt.runtime.kernels.kv_quant import dequantize_int8, dequantize_int8_ref, quantize_int8, quantize_int8_ref


def test_int8_roundtrip_error_bound():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(9, 3, 32, generator=g) * torch.logspace(-3, 2, 9)[:, None, None]
    x[2, 1] = 0.0  # an all-zero vector
    q, scale = quantize_int8(x)
    assert q.dtype == torch.int8 and q.shape == x.shape and scale.shape == (9, 3) and scale.dtype == torch.float32
    assert scale[2, 1] == 1.0 and torch.equal(q[2, 1], torch.zeros_like(q[2, 1]))
    err = (dequantize_int8(q, scale) - x).abs()
    amax = x.abs().amax(-1, keepdim=True)
    # documented bound: amax / 254 per element, plus float32 rounding
    assert (err <= amax / 254 * (1 + 1e-5) + 1e-30).all()
    assert q.abs().max() == 127


def test_int8_matches_twin_and_dtypes():
    x = torch.randn(5, 2, 8, generator=torch.Generator().manual_seed(1)).bfloat16()
    q, s = quantize_int8(x)
    qr, sr = quantize_int8_ref(x)
    assert torch.equal(q, qr) and torch.equal(s, sr)
    assert torch.equal(dequantize_int8(q, s, torch.bfloat16), dequantize_int8_ref(q, s, torch.bfloat16))
