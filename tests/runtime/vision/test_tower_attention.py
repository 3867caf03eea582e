"""The towers' batched bidirectional attention against the varlen twin (the oracle)."""

import pytest
import torch

from adapt.runtime.kernels import get_kernels
from adapt.runtime.kernels.attention import varlen_attention_ref
from adapt.runtime.vision.common import tower_attention


@pytest.mark.parametrize("lengths", [[577], [64, 64, 64, 64], [64, 48, 64, 16, 48, 1], [300, 7]])
def test_equals_the_varlen_twin(lengths):
    g = torch.Generator().manual_seed(len(lengths))
    t, h, d = sum(lengths), 6, 32
    q, k, v = (torch.randn(t, h, d, generator=g) for _ in range(3))
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32)
    got = tower_attention(get_kernels("adapt"), q, k, v, cu, d ** -0.5)
    want = varlen_attention_ref(q, k, v, cu, d ** -0.5, False)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_segments_do_not_see_each_other():
    """Changing one segment's keys changes only that segment's outputs."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(128, 2, 16, generator=g) for _ in range(3))
    cu = torch.tensor([0, 64, 128], dtype=torch.int32)
    a = tower_attention(get_kernels("adapt"), q, k, v, cu, 0.25)
    k2 = k.clone()
    k2[64:] += 1.0
    b = tower_attention(get_kernels("adapt"), q, k2, v, cu, 0.25)
    assert torch.equal(a[:64], b[:64]) and not torch.allclose(a[64:], b[64:])


@pytest.mark.parametrize("lengths", [[577], [64, 64, 64, 52]])
def test_bfloat16_error_within_twice_plain_torch(lengths):
    """DESIGN's low-precision rule: against the float32 twin, the bfloat16 kernel errs at most 2x what the
    plain-torch twin errs in bfloat16."""
    g = torch.Generator().manual_seed(1)
    t, h, d = sum(lengths), 6, 64
    q, k, v = (2 * torch.randn(t, h, d, generator=g) for _ in range(3))
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32)
    want = varlen_attention_ref(q, k, v, cu, d ** -0.5, False)
    qb, kb, vb = (x.bfloat16() for x in (q, k, v))
    ours = (tower_attention(get_kernels("adapt"), qb, kb, vb, cu, d ** -0.5).float() - want).abs().max()
    plain = (varlen_attention_ref(qb, kb, vb, cu, d ** -0.5, False).float() - want).abs().max()
    assert ours <= 2 * plain, (ours, plain)
