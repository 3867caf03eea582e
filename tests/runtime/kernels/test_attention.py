import pytest
import torch

from adapt.runtime.kernels.attention import varlen_attention, varlen_attention_ref

from ._tol import assert_fp32_close, assert_lowp_close
from ._track import largest_allocation

TILE = 16
# at, one past and one before the tile boundary, length 1, a few tiles
LENS = [1, TILE, TILE + 1, TILE - 1, 2 * TILE + 1, 3]


def _cu(lens):
    return torch.tensor([0] + lens).cumsum(0)


def _qkv(lens, hq, hkv, d, dv, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    t = sum(lens)
    q = torch.randn(t, hq, d, generator=g)
    k = torch.randn(t, hkv, d, generator=g)
    v = torch.randn(t, hkv, dv, generator=g)
    return q.to(dtype), k.to(dtype), v.to(dtype)


@pytest.mark.parametrize("fused", [True, False])  # CPU SDPA's flash kernel per sequence, or the tile loop
@pytest.mark.parametrize("hq,hkv", [(8, 8), (8, 4), (8, 2), (8, 1), (3, 1)])  # GQA 1/2/4/8, MQA
@pytest.mark.parametrize("causal", [True, False])
def test_varlen_matches_twin_fp32(hq, hkv, causal, fused):
    q, k, v = _qkv(LENS, hq, hkv, 16, 16)
    scale = 16**-0.5
    out = varlen_attention(q, k, v, _cu(LENS), scale, causal, q_tile=TILE, k_tile=TILE, fused=fused)
    assert out.shape == (sum(LENS), hq, 16) and out.dtype == torch.float32
    assert_fp32_close(out, varlen_attention_ref(q, k, v, _cu(LENS), scale, causal), f"hq={hq} hkv={hkv}")


def test_varlen_mla_dims_and_uneven_tiles():
    # D = 192, Dv = 128 (MLA after decompression); query and key tiles of different sizes
    lens = [7, 24, 1]
    q, k, v = _qkv(lens, 2, 2, 192, 128, seed=1)
    scale = 192**-0.5
    out = varlen_attention(q, k, v, _cu(lens), scale, q_tile=8, k_tile=5)
    assert out.shape == (32, 2, 128)
    assert_fp32_close(out, varlen_attention_ref(q, k, v, _cu(lens), scale))


def test_varlen_chunked_prefill_bottom_right_causal():
    # queries are the last Lq tokens of each sequence whose Lk keys (prefix + chunk) are given
    lq, lk = [3, 1, 17], [10, 1, 40]
    g = torch.Generator().manual_seed(2)
    q = torch.randn(sum(lq), 4, 8, generator=g)
    k = torch.randn(sum(lk), 2, 8, generator=g)
    v = torch.randn(sum(lk), 2, 8, generator=g)
    out = varlen_attention(q, k, v, _cu(lq), 0.3, True, cu_seqlens_k=_cu(lk), q_tile=TILE, k_tile=TILE)
    assert_fp32_close(out, varlen_attention_ref(q, k, v, _cu(lq), 0.3, True, cu_seqlens_k=_cu(lk)))
    # the last chunk's queries equal the last rows of a full prefill of that sequence
    full_q = torch.cat([torch.randn(lk[2] - lq[2], 4, 8, generator=g), q[4:]])
    full = varlen_attention(full_q, k[11:], v[11:], _cu([lk[2]]), 0.3, True, q_tile=TILE, k_tile=TILE)
    assert_fp32_close(out[4:], full[-lq[2]:])


@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("hq,hkv", [(4, 4), (4, 1)])
def test_varlen_bf16_within_2x_of_torch(hq, hkv, fused):
    q, k, v = _qkv(LENS, hq, hkv, 32, 32, seed=3)
    cu = _cu(LENS)
    ref32 = varlen_attention_ref(q, k, v, cu, 32**-0.5)
    qb, kb, vb = (x.bfloat16() for x in (q, k, v))
    out = varlen_attention(qb, kb, vb, cu, 32**-0.5, q_tile=TILE, k_tile=TILE, fused=fused)
    assert out.dtype == torch.bfloat16
    assert_lowp_close(out, varlen_attention_ref(qb, kb, vb, cu, 32**-0.5), ref32, "varlen bf16")


def test_varlen_empty_sequence_in_batch():
    lens = [4, 0, 5]
    q, k, v = _qkv(lens, 2, 1, 8, 8)
    out = varlen_attention(q, k, v, _cu(lens), 0.5, q_tile=TILE, k_tile=TILE)
    assert_fp32_close(out, varlen_attention_ref(q, k, v, _cu(lens), 0.5))


@pytest.mark.parametrize("fused", [True, False])
def test_prefill_memory_is_linear_in_length(fused):
    """The largest single allocation grows linearly in L (output-sized), not as L^2: measured
    by intercepting every aten op (see _track.py), so it does not depend on timing or allocator."""
    hq, d = 2, 8
    sizes = {}
    for n in (128, 512):
        q, k, v = _qkv([n], hq, 1, d, d)
        sizes[n] = largest_allocation(lambda: varlen_attention(q, k, v, _cu([n]), 0.3, q_tile=TILE, k_tile=TILE,
                                                               fused=fused))
        out_bytes = n * hq * d * 4
        assert sizes[n] <= max(out_bytes, 4 * hq * TILE * TILE * 4), (n, sizes[n])
    assert sizes[512] <= 4.5 * sizes[128], sizes  # linear: x4 for x4 length (quadratic would be x16)
    # the detector sees the quadratic twin: its score matrix is hq * L * L floats
    q, k, v = _qkv([512], hq, 1, d, d)
    assert largest_allocation(lambda: varlen_attention_ref(q, k, v, _cu([512]), 0.3)) >= hq * 512 * 512 * 4


def test_gqa_does_not_materialize_repeated_kv():
    # Hq = 8 over one kv head, D = 64 >> Dv = 4: a repeat_interleave of K would be T * Hq * D floats
    n, hq, d, dv = 256, 8, 64, 4
    q, k, v = _qkv([n], hq, 1, d, dv)
    largest = largest_allocation(lambda: varlen_attention(q, k, v, _cu([n]), 0.1, q_tile=TILE, k_tile=TILE))
    assert largest < n * hq * d * 4 // 4, largest
    # D == Dv: the fused route (SDPA's flash kernel with enable_gqa) neither repeats K/V nor holds the scores
    q, k, v = _qkv([n], hq, 1, d, d)
    largest = largest_allocation(lambda: varlen_attention(q, k, v, _cu([n]), 0.1, q_tile=TILE, k_tile=TILE))
    assert largest <= n * hq * d * 4, largest  # the output's size: K repeated to Hq heads would be as large again


def test_plain_prefill_takes_the_fused_route_and_others_the_loop():
    # which route ran, seen from the ops: SDPA's flash kernel for a whole causal sequence; the tile loop (bmm)
    # for a chunk over a cached prefix, a sliding window and D != Dv
    from torch.profiler import profile

    def ops(fn):
        with profile() as p:
            fn()
        return {e.key for e in p.key_averages()}

    q, k, v = _qkv([40], 4, 2, 16, 16)
    flash = "aten::_scaled_dot_product_flash_attention_for_cpu"
    assert flash in ops(lambda: varlen_attention(q, k, v, _cu([40]), 0.25))
    assert flash not in ops(lambda: varlen_attention(q, k, v, _cu([40]), 0.25, fused=False))
    assert flash not in ops(lambda: varlen_attention(q, k, v, _cu([40]), 0.25, window=8))
    assert flash not in ops(lambda: varlen_attention(q[30:], k, v, _cu([10]), 0.25, cu_seqlens_k=_cu([40])))
    q, k, v = _qkv([40], 4, 2, 16, 8)
    assert flash not in ops(lambda: varlen_attention(q, k, v, _cu([40]), 0.25))


def test_non_contiguous_inputs():
    # q, k, v as slices of one fused qkv projection
    lens = [5, 17]
    g = torch.Generator().manual_seed(4)
    qkv = torch.randn(sum(lens), 4 + 2 + 2, 8, generator=g)
    q, k, v = qkv[:, :4], qkv[:, 4:6], qkv[:, 6:]
    out = varlen_attention(q, k, v, _cu(lens), 0.3, q_tile=TILE, k_tile=TILE)
    assert_fp32_close(out, varlen_attention_ref(q.contiguous(), k.contiguous(), v.contiguous(), _cu(lens), 0.3))


@pytest.mark.parametrize("window", [1, 5, TILE, TILE + 3, 100])
@pytest.mark.parametrize("hq,hkv", [(8, 2), (3, 1)])
def test_varlen_sliding_window_matches_twin(window, hq, hkv):
    # query p sees keys p - window < j <= p; windows inside one tile, at and across tile edges, and one
    # longer than every sequence (then it is plain causal attention)
    q, k, v = _qkv(LENS, hq, hkv, 16, 16, seed=3)
    scale = 16**-0.5
    out = varlen_attention(q, k, v, _cu(LENS), scale, True, q_tile=TILE, k_tile=TILE, window=window)
    ref = varlen_attention_ref(q, k, v, _cu(LENS), scale, True, window=window)
    assert_fp32_close(out, ref, f"window={window}")
    full = varlen_attention_ref(q, k, v, _cu(LENS), scale, True)
    if window >= max(LENS):
        assert_fp32_close(out, full)
    else:
        assert not torch.allclose(out, full)


def test_varlen_sliding_window_twin_is_causal_attention_over_the_window():
    # the twin's windowed row p equals plain attention of that query over keys (p - W, p]
    lens, w = [13], 4
    q, k, v = _qkv(lens, 2, 1, 8, 8, seed=4)
    out = varlen_attention_ref(q, k, v, _cu(lens), 0.5, True, window=w)
    for p in range(13):
        lo = max(0, p - w + 1)
        one = varlen_attention_ref(q[p:p + 1], k[lo:p + 1], v[lo:p + 1], _cu([1]), 0.5, True,
                                   cu_seqlens_k=_cu([p + 1 - lo]))
        assert_fp32_close(out[p], one[0])
    with pytest.raises(ValueError, match="causal"):
        varlen_attention(q, k, v, _cu(lens), 0.5, False, window=w)
