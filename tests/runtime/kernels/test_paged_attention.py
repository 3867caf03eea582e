import pytest
import torch

from adapt.runtime.kernels.kv_write import write_kv_cache, write_kv_cache_ref
from adapt.runtime.kernels.paged_attention import paged_decode_attention, paged_decode_attention_ref

from ._tol import assert_fp32_close, assert_lowp_close

pytestmark = pytest.mark.usefixtures("kernel_form")

BS = 4  # tokens per block
STEP = 2  # blocks per kernel step: chunk boundary every 8 tokens
# length 1, at / one past a block, at / one past a chunk, ragged
LENS = [1, BS, BS + 1, 2 * BS, 2 * BS + 1, 3, 3 * STEP * BS + 2]


def _layout(lens, num_blocks, seed=0):
    """Random distinct blocks per sequence; block_tables padded with -1; slot of every token."""
    g = torch.Generator().manual_seed(seed)
    perm = torch.randperm(num_blocks, generator=g).tolist()
    maxb = max((n + BS - 1) // BS for n in lens)
    tables = torch.full((len(lens), maxb), -1, dtype=torch.int32)
    slots = []
    for i, n in enumerate(lens):
        for j in range((n + BS - 1) // BS):
            tables[i, j] = perm.pop()
        slots += [int(tables[i, p // BS]) * BS + p % BS for p in range(n)]
    return tables, torch.tensor(slots, dtype=torch.long)


def _setup(lens, hq, hkv, d, dv, cache_dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    nb = sum((n + BS - 1) // BS for n in lens) + 3  # a few unused blocks
    tables, slots = _layout(lens, nb, seed)
    t = sum(lens)
    k, v = torch.randn(t, hkv, d, generator=g), torch.randn(t, hkv, dv, generator=g)
    q = torch.randn(len(lens), hq, d, generator=g)
    k_cache = torch.zeros(nb, BS, hkv, d, dtype=cache_dtype)
    v_cache = torch.zeros(nb, BS, hkv, dv, dtype=cache_dtype)
    scales = (torch.zeros(nb, BS, hkv), torch.zeros(nb, BS, hkv)) if cache_dtype == torch.int8 else (None, None)
    return q, k, v, k_cache, v_cache, scales, tables, slots


@pytest.mark.parametrize("hq,hkv", [(8, 8), (8, 4), (8, 2), (8, 1)])
def test_paged_decode_matches_twin_fp32(hq, hkv):
    q, k, v, kc, vc, _, tables, slots = _setup(LENS, hq, hkv, 16, 8)
    write_kv_cache(k, v, kc, vc, slots)
    kc2, vc2 = torch.zeros_like(kc), torch.zeros_like(vc)
    write_kv_cache_ref(k, v, kc2, vc2, slots)
    assert torch.equal(kc, kc2) and torch.equal(vc, vc2)
    lens = torch.tensor(LENS)
    out = paged_decode_attention(q, kc, vc, tables, lens, 0.25, blocks_per_step=STEP)
    assert out.shape == (len(LENS), hq, 8)
    assert_fp32_close(out, paged_decode_attention_ref(q, kc, vc, tables, lens, 0.25), f"hq={hq} hkv={hkv}")


def test_paged_decode_zero_length_and_padding_slots():
    lens = [0, 5, 1]
    q, k, v, kc, vc, _, tables, slots = _setup(lens, 4, 2, 8, 8)
    tables[0, :] = -1
    # padding tokens with slot -1 are skipped by the write
    kp, vp = torch.cat([k, torch.full((2, 2, 8), 99.0)]), torch.cat([v, torch.full((2, 2, 8), 99.0)])
    write_kv_cache(kp, vp, kc, vc, torch.cat([slots, torch.tensor([-1, -1])]))
    assert kc.abs().max() < 99
    out = paged_decode_attention(q, kc, vc, tables, torch.tensor(lens), 0.3, blocks_per_step=STEP)
    assert torch.equal(out[0], torch.zeros_like(out[0]))
    assert_fp32_close(out, paged_decode_attention_ref(q, kc, vc, tables, torch.tensor(lens), 0.3))


def test_paged_decode_int8_cache():
    q, k, v, kc, vc, (ks, vs), tables, slots = _setup(LENS, 4, 2, 16, 16, torch.int8, seed=1)
    write_kv_cache(k, v, kc, vc, slots, ks, vs)
    kc2, vc2, ks2, vs2 = (torch.zeros_like(x) for x in (kc, vc, ks, vs))
    write_kv_cache_ref(k, v, kc2, vc2, slots, ks2, vs2)
    assert torch.equal(kc, kc2) and torch.equal(vc, vc2)
    torch.testing.assert_close(ks, ks2, rtol=0, atol=0)
    lens = torch.tensor(LENS)
    out = paged_decode_attention(q, kc, vc, tables, lens, 0.25, ks, vs, blocks_per_step=STEP)
    assert_fp32_close(out, paged_decode_attention_ref(q, kc, vc, tables, lens, 0.25, ks, vs))
    # against the unquantized cache: int8 error (<= amax / 254 per element) stays small
    kf, vf = torch.zeros(kc.shape), torch.zeros(vc.shape)
    write_kv_cache(k, v, kf, vf, slots)
    exact = paged_decode_attention(q, kf, vf, tables, lens, 0.25, blocks_per_step=STEP)
    assert (out - exact).abs().max() < 0.05


@pytest.mark.parametrize("hq,hkv", [(4, 4), (8, 1)])
def test_paged_decode_bf16_within_2x_of_torch(hq, hkv):
    q, k, v, kc, vc, _, tables, slots = _setup(LENS, hq, hkv, 32, 32, seed=2)
    lens = torch.tensor(LENS)
    write_kv_cache(k, v, kc, vc, slots)
    ref32 = paged_decode_attention_ref(q, kc, vc, tables, lens, 32**-0.5)
    kb, vb = kc.bfloat16(), vc.bfloat16()
    out = paged_decode_attention(q.bfloat16(), kb, vb, tables, lens, 32**-0.5, blocks_per_step=STEP)
    assert out.dtype == torch.bfloat16
    twin = paged_decode_attention_ref(q.bfloat16(), kb, vb, tables, lens, 32**-0.5)
    assert_lowp_close(out, twin, ref32, "paged bf16")


def test_write_bf16_cache_casts():
    _, k, v, kc, vc, _, _, slots = _setup([5], 2, 2, 8, 8, torch.bfloat16)
    write_kv_cache(k, v, kc, vc, slots)
    assert torch.equal(kc.view(-1, 2, 8)[slots], k.bfloat16())


def test_decode_meta_shared_by_layers_equals_per_call():
    from adapt.runtime.kernels.paged_attention import decode_meta

    q, k, v, kc, vc, _, tables, slots = _setup(LENS, 8, 2, 16, 8)
    write_kv_cache(k, v, kc, vc, slots, checked=True)
    lens = torch.tensor(LENS)
    for step in (STEP, 16):  # chunked and single-chunk steps
        meta = decode_meta(tables, lens, BS, step)
        assert (meta.blocks is None) == (meta.num_blocks > step)
        a = paged_decode_attention(q, kc, vc, tables, lens, 0.25, blocks_per_step=step, meta=meta)
        b = paged_decode_attention(q, kc, vc, tables, lens, 0.25, blocks_per_step=step)
        assert torch.equal(a, b)
        assert_fp32_close(a, paged_decode_attention_ref(q, kc, vc, tables, lens, 0.25))


@pytest.mark.parametrize("stacked_max", [0, 1 << 20])
@pytest.mark.parametrize("hq,hkv", [(8, 8), (8, 2), (8, 1)])
def test_single_chunk_paths_match_twin(hq, hkv, stacked_max, monkeypatch):
    # single-chunk steps take the stacked-heads path while Hkv * keys <= _STACKED_MAX, else the per-head
    # gather; both (and the zero-length sequence) must match the twin
    from adapt.runtime.kernels import paged_attention as pa

    monkeypatch.setattr(pa, "_STACKED_MAX", stacked_max)
    lens = [0, 1, 16, 17, 33]
    q, k, v, kc, vc, _, tables, slots = _setup(lens, hq, hkv, 16, 8)
    write_kv_cache(k, v, kc, vc, slots)
    t = torch.tensor(lens)
    out = paged_decode_attention(q, kc, vc, tables, t, 0.25)  # default blocks_per_step: one chunk
    assert_fp32_close(out, paged_decode_attention_ref(q, kc, vc, tables, t, 0.25), f"hq={hq} hkv={hkv}")
    assert torch.equal(out[0], torch.zeros_like(out[0]))


@pytest.mark.parametrize("window", [1, 3, BS, 9, 1000])
@pytest.mark.parametrize("path", ["stacked", "per_head", "chunked", "int8_single", "int8_chunked"])
def test_paged_decode_sliding_window_matches_twin(window, path, monkeypatch):
    # the new token (position seq_len - 1) sees the latest `window` keys, on every path of the kernel
    from adapt.runtime.kernels import paged_attention as pa

    monkeypatch.setattr(pa, "_STACKED_MAX", 1 << 20 if path == "stacked" else 0)
    cache_dtype = torch.int8 if path.startswith("int8") else torch.float32
    q, k, v, kc, vc, (ks, vs), tables, slots = _setup(LENS, 8, 2, 16, 8, cache_dtype, seed=5)
    write_kv_cache(k, v, kc, vc, slots, ks, vs)
    lens = torch.tensor(LENS)
    step = STEP if path.endswith("chunked") else 16
    out = paged_decode_attention(q, kc, vc, tables, lens, 0.25, ks, vs, blocks_per_step=step, window=window)
    ref = paged_decode_attention_ref(q, kc, vc, tables, lens, 0.25, ks, vs, window=window)
    assert_fp32_close(out, ref, f"{path} window={window}")
    if cache_dtype == torch.float32:  # the twin: plain attention over each sequence's last `window` keys
        start = 0
        for i, n in enumerate(LENS):
            lo = start + max(0, n - window)
            kk = k[lo:start + n].repeat_interleave(4, dim=1).transpose(0, 1)  # [Hq, w, D]
            vv = v[lo:start + n].repeat_interleave(4, dim=1).transpose(0, 1)
            p = torch.softmax(torch.matmul(q[i][:, None], kk.transpose(1, 2)) * 0.25, dim=-1)
            assert_fp32_close(ref[i], torch.matmul(p, vv)[:, 0])
            start += n
