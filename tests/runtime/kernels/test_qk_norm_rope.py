"""The fused qk_norm_rope (csrc/attention.h) against the three fused calls it joins: rms_norm of q and k,
rotate_half rope, the paged cache write; bitwise, in float32 and bfloat16."""

import pytest
import torch

from adapt.runtime import cpu_kernels
from adapt.runtime.kernels import fused
from adapt.runtime.kernels.kv_write import write_kv_cache
from adapt.runtime.kernels.norm import rms_norm
from adapt.runtime.kernels.rope import apply_rope, rope_cos_sin, rope_inv_freq


@pytest.fixture(scope="module")
def ext():
    mod = cpu_kernels.load()
    if mod is None or fused.vectorized() is None:
        pytest.skip(f"vectorized fused CPU kernels {cpu_kernels.status()}")
    return mod


def _case(T, H, Hkv, D, dtype, seed=0, nb=6, bs=4):
    g = torch.Generator().manual_seed(seed)
    qkv = (torch.randn(T, (H + 2 * Hkv) * D, generator=g) * 3).to(dtype)
    qw = (torch.rand(D, generator=g) + 0.5).to(dtype)
    kw = (torch.rand(D, generator=g) + 0.5).to(dtype)
    pos = torch.randint(0, 5000, (T,), generator=g)
    cos, sin = rope_cos_sin(rope_inv_freq(D, 1e6, {}, 4096)[0], pos, 1.0, dtype)
    kc = torch.randn(nb, bs, Hkv, D, generator=g).to(dtype)
    vc = torch.randn(nb, bs, Hkv, D, generator=g).to(dtype)
    slots = torch.randperm(nb * bs, generator=g)[:T]
    return qkv, qw, kw, cos, sin, kc, vc, slots


def _unjoined(qkv, H, Hkv, D, qw, kw, eps, cos, sin, kc, vc, slots):
    T = qkv.shape[0]
    q = qkv[:, : H * D].view(T, H, D)
    k = qkv[:, H * D: (H + Hkv) * D].view(T, Hkv, D)
    v = qkv[:, (H + Hkv) * D:].view(T, Hkv, D)
    if qw is not None:
        q, k = rms_norm(q, qw, eps), rms_norm(k, kw, eps)
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    if kc is not None:
        write_kv_cache(k, v, kc, vc, slots)
    return q, k


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("T,H,Hkv,D", [(1, 8, 2, 64), (5, 4, 4, 24), (3, 2, 1, 128), (1, 3, 1, 18)])
@pytest.mark.parametrize("norms", [True, False])
def test_equals_the_three_calls_bitwise(ext, dtype, T, H, Hkv, D, norms):
    qkv, qw, kw, cos, sin, kc, vc, slots = _case(T, H, Hkv, D, dtype)
    if T > 1:
        slots[1] = -1  # a padding row: skipped by both
    if not norms:
        qw = kw = None
    kc2, vc2 = kc.clone(), vc.clone()
    q, k = _unjoined(qkv, H, Hkv, D, qw, kw, 1e-6, cos, sin, kc, vc, slots)
    q2, k2 = ext.qk_norm_rope(qkv, H, Hkv, qw, kw, 1e-6, cos, sin, kc2, vc2, slots)
    assert q2.shape == (T, H, D) and k2.shape == (T, Hkv, D)
    assert torch.equal(q2, q) and torch.equal(k2, k)
    assert torch.equal(kc2, kc) and torch.equal(vc2, vc)


def test_without_a_cache_and_on_strided_rows(ext):
    qkv, qw, kw, cos, sin, *_ = _case(4, 4, 2, 32, torch.float32)
    wide = torch.zeros(4, qkv.shape[1] + 16)
    wide[:, : qkv.shape[1]] = qkv
    view = wide[:, : qkv.shape[1]]  # rows with a stride beyond their width
    q, k = _unjoined(qkv, 4, 2, 32, qw, kw, 1e-5, cos, sin, None, None, None)
    q2, k2 = ext.qk_norm_rope(view, 4, 2, qw, kw, 1e-5, cos, sin, None, None, None)
    assert torch.equal(q2, q) and torch.equal(k2, k)


def test_bad_inputs_are_errors(ext):
    qkv, qw, kw, cos, sin, kc, vc, slots = _case(2, 4, 2, 16, torch.float32)
    with pytest.raises(RuntimeError, match="outside the cache"):
        ext.qk_norm_rope(qkv, 4, 2, qw, kw, 1e-6, cos, sin, kc, vc, torch.tensor([0, kc.shape[0] * kc.shape[1]]))
    with pytest.raises(RuntimeError, match="come together"):
        ext.qk_norm_rope(qkv, 4, 2, qw, kw, 1e-6, cos, sin, kc, None, slots)
    with pytest.raises(RuntimeError, match="norm weights"):
        ext.qk_norm_rope(qkv, 4, 2, qw[:8], kw, 1e-6, cos, sin, None, None, None)
    with pytest.raises(RuntimeError, match="cos / sin"):
        ext.qk_norm_rope(qkv, 4, 2, qw, kw, 1e-6, cos[:1], sin[:1], None, None, None)
    with pytest.raises(RuntimeError, match="qkv"):
        ext.qk_norm_rope(qkv[:, :-1], 4, 2, qw, kw, 1e-6, cos, sin, None, None, None)
