"""oneDNN linears run at bucketed row counts: the bucket rule, and results equal to the unpadded GEMM."""

import pytest
import torch
import torch.nn.functional as F

from adapt.runtime.kernels.rows import BUCKET_EXACT, bucket_rows, pad_rows
from adapt.runtime.backends.cpu_layouts import OneDNNWeight, can_prepack
from adapt.runtime.models.layers import linear


def test_bucket_rule_bounds_shapes_and_padding():
    sizes = [bucket_rows(n) for n in range(1, 8193)]
    assert all(m >= n for n, m in zip(range(1, 8193), sizes))
    assert sizes[:BUCKET_EXACT] == list(range(1, BUCKET_EXACT + 1))  # decode batch sizes stay exact
    assert all(m - n <= 15 for n, m in zip(range(1, 257), sizes[:256]))
    assert all(m - n < 64 and m % 64 == 0 for n, m in zip(range(257, 8193), sizes[256:]))
    assert sizes == sorted(sizes) and len(set(sizes)) == 16 + 15 + (8192 - 256) // 64  # monotone, few shapes


def test_pad_rows_appends_zero_rows_only_when_needed():
    x = torch.randn(5, 3)
    assert pad_rows(x, 5) is x
    p = pad_rows(x, 8)
    assert p.shape == (8, 3) and torch.equal(p[:5], x) and not p[5:].any()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_packed_linear_with_bucketed_rows_equals_f_linear(dtype):
    from adapt.runtime.kernels.moe_experts import onednn_packs

    if not can_prepack(torch.device("cpu")) or not onednn_packs(dtype):
        pytest.skip(f"no oneDNN packing of {dtype} here")
    g = torch.Generator().manual_seed(3)
    w = (torch.randn(96, 64, generator=g) / 8).to(dtype)
    b = torch.randn(96, generator=g).to(dtype)
    wp = OneDNNWeight(w)  # what the cpu backend gives a linear: linear() calls it
    for n in (1, 15, 16, 17, 100, 256, 257, 300):
        x = torch.randn(n, 64, generator=g).to(dtype)
        y, ref = linear(x, wp, b), F.linear(x, w, b)
        assert y.shape == (n, 96) and y.is_contiguous()
        if dtype == torch.bfloat16:
            assert torch.equal(y, ref), n  # bf16 packing is bitwise F.linear, padded rows or not
        else:
            assert (y - ref).abs().max().item() <= 1e-5 * max(1.0, ref.abs().max().item()), n
    x3 = torch.randn(2, 9, 64, generator=g).to(dtype)  # leading dims kept
    assert linear(x3, wp).shape == (2, 9, 96)
