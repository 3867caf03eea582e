"""The fused tiled MoE kernel (csrc/moe_gemm.h, moe_experts_tiled) against its twin: float32 (the FMA
kernel), bfloat16 (AMX or AVX512-BF16 on vnni-packed weights, where the host has one; `pytest -m slow` also
builds the latter on an AMX host; and on every host with a vector layer, the FMA kernel on bfloat16 panels
widened as they are read; float16 panels the same way where the vector layer converts float16), packing
round trips, row tails and chunks, expert parallelism, thread counts, the
torch fallback, and inputs it refuses."""

import pytest
import torch

from adapt.runtime import cpu_kernels
from adapt.runtime.kernels import fused
from adapt.runtime.kernels.moe_experts import moe_experts_ref
from adapt.runtime.kernels.moe_tiled import (moe_experts_tiled, moe_experts_tiled_ref, pack_tiled, tiled_panel,
                                             tiled_vnni, tiles, unpack_tiled)

from ._tol import assert_fp32_close, assert_lowp_close


def _case(t, h, inter, e, k, seed=0, ids=None, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, h, generator=g)
    wgu = torch.randn(e, 2 * inter, h, generator=g) * h ** -0.5
    wd = torch.randn(e, h, inter, generator=g) * inter ** -0.5
    if ids is None:
        probs = 1.0 / torch.arange(1, e + 1, dtype=torch.float32)  # skewed, as real routing is
        ids = torch.multinomial(probs.expand(t, e), k, generator=g)
    w = torch.rand(ids.shape, generator=g) + 0.1
    w = (w / w.sum(-1, keepdim=True)).to(dtype)
    return x.to(dtype), w, ids, wgu.to(dtype), wd.to(dtype)


def _need(dtype):
    if cpu_kernels.load() is None:
        pytest.skip(f"fused CPU kernels {cpu_kernels.status()}")
    if not tiles(64, 64, dtype):
        pytest.skip(f"the tiled MoE kernel does not run {dtype} on this host (no vector layer in this build)")


def _packed(wgu, wd, vnni=None):
    """Packed in this host's form (vnni None), or in the one asked: vnni False is the panel form."""
    p = tiled_panel(wgu.dtype) if vnni is None else 16 if vnni else int(fused.installed().PANEL)
    return pack_tiled(wgu, p, vnni), pack_tiled(wd, p, vnni)


@pytest.mark.parametrize("dtype,panel,vnni", [(torch.float32, 16, False), (torch.float32, 32, False),
                                              (torch.bfloat16, 16, True), (torch.bfloat16, 16, False),
                                              (torch.float16, 16, False)])
def test_pack_and_unpack_are_inverse_and_lay_out_tiles(dtype, panel, vnni):
    w = torch.randn(3, 64, 96).to(dtype)
    p = pack_tiled(w, panel, vnni)
    assert torch.equal(unpack_tiled(p), w)
    if vnni:  # one AMX B tile: row r holds the k pairs (2r, 2r + 1) of 16 columns
        assert p.shape == (3, 4, 3, 16, 32)
        assert p[1, 2, 1, 5, 2 * 7 + 1] == w[1, 2 * 16 + 7, 32 + 2 * 5 + 1]
    else:  # a column panel of the transposed weight
        assert p.shape == (3, 64 // panel, 96, panel) and p[2, 1, 50, 3] == w[2, panel + 3, 50]


@pytest.mark.parametrize(
    "t,h,inter,e,k",
    # I a multiple of the panel (64 with AVX-512, 16 with AVX2) takes the one-pass gate|up + SiLU (fma_gate_up);
    # 32 and 96 the two-pass form on AVX-512
    [(1, 64, 32, 8, 2), (13, 128, 32, 6, 2), (50, 192, 96, 5, 3), (300, 64, 32, 4, 1), (37, 64, 96, 8, 4),
     (1, 64, 64, 4, 2), (43, 128, 64, 6, 2), (200, 64, 128, 4, 3)],
)
def test_float32_matches_twin(t, h, inter, e, k):
    _need(torch.float32)
    x, w, ids, wgu, wd = _case(t, h, inter, e, k, seed=t)
    pg, pd = _packed(wgu, wd)
    out = moe_experts_tiled(x, w, ids, pg, pd)
    assert out.shape == (t, h) and out.dtype == torch.float32
    assert_fp32_close(out, moe_experts_tiled_ref(x, w, ids, pg, pd))
    assert_fp32_close(out, moe_experts_ref(x, w, ids, wgu[:, :inter], wgu[:, inter:], wd))


@pytest.mark.parametrize("t,h,inter,e,k", [(1, 64, 32, 8, 2), (29, 64, 32, 6, 2), (70, 96, 64, 5, 3)])
def test_bfloat16_within_2x_of_torch(t, h, inter, e, k):
    _need(torch.bfloat16)
    x, w, ids, wgu, wd = _case(t, h, inter, e, k, seed=t, dtype=torch.bfloat16)
    pg, pd = _packed(wgu, wd)
    out = moe_experts_tiled(x, w, ids, pg, pd)
    assert out.dtype == torch.bfloat16
    ref32 = moe_experts_tiled_ref(x.float(), w.float(), ids, pg.float(), pd.float())
    assert_lowp_close(out, moe_experts_tiled_ref(x, w, ids, pg, pd), ref32, "tiled moe bf16")


# H and 2I multiples of 64, the panel width with AVX-512 (a 96-wide H is no panel layout there)
@pytest.mark.parametrize("t,h,inter,e,k", [(1, 64, 32, 8, 2), (29, 64, 32, 6, 2), (70, 192, 96, 5, 3),
                                           (300, 128, 96, 4, 2), (61, 64, 128, 4, 2)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_16bit_panels_on_the_fma_kernel_within_2x_of_torch(t, h, inter, e, k, dtype):
    # the form a CPU without bf16 dot products runs (AMD Zen 3), and float16's on every CPU whose vector layer
    # converts it: the 16-bit weights widened to float32 as they are read, the torch form's roundings
    _need(torch.float32)
    if dtype == torch.float16:
        _need(dtype)
    x, w, ids, wgu, wd = _case(t, h, inter, e, k, seed=t + 1, dtype=dtype)
    pg, pd = _packed(wgu, wd, vnni=False)
    assert pg.dim() == 4 and pg.dtype == dtype
    out = moe_experts_tiled(x, w, ids, pg, pd)
    assert out.dtype == dtype and out.shape == (t, h)
    ref32 = moe_experts_tiled_ref(x.float(), w.float(), ids, pg.float(), pd.float())
    assert_lowp_close(out, moe_experts_tiled_ref(x, w, ids, pg, pd), ref32, f"tiled moe {dtype} panels")


def test_the_host_form_of_bfloat16():
    # vnni where the CPU has a bf16 dot product (AMX granted, AVX512-BF16), else the FMA kernel's panels
    _need(torch.float32)
    ext = fused.installed()
    vnni = ext.moe_tiled_bf16_gemm() in ("amx", "avx512_bf16")
    assert tiled_vnni(torch.bfloat16) == vnni and not tiled_vnni(torch.float32)
    assert tiled_panel(torch.bfloat16) == (16 if vnni else tiled_panel(torch.float32))
    assert ext.moe_tiled_bf16_gemm() in ("amx", "avx512_bf16", "fma")
    z = torch.zeros(2, 64, 64, dtype=torch.bfloat16)
    assert _packed(z, z[:, :, :32])[0].dim() == (5 if vnni else 4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_idle_experts_one_expert_and_a_chunked_busy_expert(dtype):
    _need(dtype)
    t, h, inter, e = 600, 64, 32, 6
    cases = {
        "idle": torch.tensor([1, 4]).repeat(t, 1),  # experts 0, 2, 3, 5 get no token
        "one": torch.full((t, 1), 3),  # 600 rows on one expert: more than one row chunk
    }
    for name, ids in cases.items():
        x, w, ids, wgu, wd = _case(t, h, inter, e, ids.shape[1], seed=3, ids=ids, dtype=dtype)
        pg, pd = _packed(wgu, wd)
        out = moe_experts_tiled(x, w, ids, pg, pd)
        if dtype == torch.float32:
            assert_fp32_close(out, moe_experts_tiled_ref(x, w, ids, pg, pd), name)
        else:
            ref32 = moe_experts_tiled_ref(x.float(), w.float(), ids, pg.float(), pd.float())
            assert_lowp_close(out, moe_experts_tiled_ref(x, w, ids, pg, pd), ref32, name)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_expert_parallel_ranks_sum_to_the_full_output(dtype):
    _need(dtype)
    x, w, ids, wgu, wd = _case(40, 64, 32, 6, 2, seed=5, dtype=dtype)
    full = moe_experts_tiled(x, w, ids, *_packed(wgu, wd))
    parts = [moe_experts_tiled(x, w, ids, *_packed(wgu[a:b], wd[a:b]), a) for a, b in [(0, 2), (2, 5), (5, 6)]]
    # each slot is computed by the rank holding its expert; only the combine's sum order differs
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(sum(p.float() for p in parts), full.float(), **tol)
    none = moe_experts_tiled(x, w, ids, *_packed(wgu[:1], wd[:1]), 6)  # a rank none of the slots route to
    assert torch.equal(none, torch.zeros_like(none))


@pytest.mark.parametrize("dtype,vnni", [(torch.float32, None), (torch.bfloat16, None), (torch.bfloat16, False),
                                        (torch.float16, None)])
def test_one_and_two_threads_give_the_same_bits(dtype, vnni):
    # a row is computed by one thread whatever the split, and the combine's order is fixed (vnni None: the
    # host's form; False: bfloat16 panels on the FMA kernel)
    _need(dtype if vnni is None else torch.float32)
    x, w, ids, wgu, wd = _case(200, 64, 64, 8, 2, seed=6, dtype=dtype)  # I = 64: the one-pass gate|up on AVX-512
    pg, pd = _packed(wgu, wd, vnni)
    n = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = moe_experts_tiled(x, w, ids, pg, pd)
        torch.set_num_threads(2)
        two = moe_experts_tiled(x, w, ids, pg, pd)
    finally:
        torch.set_num_threads(n)
    assert torch.equal(one, two)


def test_torch_fallback_unpacks_and_matches():
    _need(torch.float32)
    x, w, ids, wgu, wd = _case(20, 64, 32, 4, 2, seed=7)
    pg, pd = _packed(wgu, wd)
    with fused.disabled():
        out = moe_experts_tiled(x, w, ids, pg, pd)
    assert_fp32_close(out, moe_experts_tiled_ref(x, w, ids, pg, pd))


def test_bad_inputs_are_errors_not_reads_out_of_bounds():
    _need(torch.float32)
    ext = fused.module()
    x, w, ids, wgu, wd = _case(8, 64, 32, 4, 2, seed=8)
    pg, pd = _packed(wgu, wd)
    with pytest.raises(RuntimeError, match="moe_experts_tiled"):
        ext.moe_experts_tiled(x[:, :32].contiguous(), ids, w.float(), pg, pd, 0)  # H does not match
    with pytest.raises(RuntimeError, match="moe_experts_tiled"):
        ext.moe_experts_tiled(x, ids.int(), w.float(), pg, pd, 0)  # int32 ids
    with pytest.raises(RuntimeError, match="moe_experts_tiled"):
        ext.moe_experts_tiled(x, ids, w.float(), pg, pd[:2], 0)  # expert counts differ
    with pytest.raises(RuntimeError, match="moe_experts_tiled"):
        ext.moe_experts_tiled(x, ids, w.float(), wgu, wd, 0)  # not packed
    with pytest.raises(RuntimeError, match="moe_experts_tiled"):
        ext.moe_experts_tiled(x.bfloat16(), ids, w.float(), pg, pd, 0)  # weights of another dtype
    vg, vd = (pack_tiled(t.bfloat16(), 16, vnni=True) for t in (wgu, wd))
    with pytest.raises(RuntimeError, match="moe_experts_tiled"):
        ext.moe_experts_tiled(x.bfloat16(), ids, w.float(), vg, pg.bfloat16(), 0)  # two layouts
    # ids outside this rank's experts (negative ones included) are slots served elsewhere: they add nothing
    bad = ids.clone()
    bad[0, 0] = -3
    bad[1, 1] = 99
    out = ext.moe_experts_tiled(x, bad, w.float(), pg, pd, 0)
    keep = (bad >= 0) & (bad < 4)
    assert_fp32_close(out, moe_experts_ref(x, w * keep, bad.clamp(0, 3), wgu[:, :32], wgu[:, 32:], wd))


def test_the_load_trial_packs_a_subset_of_a_wide_layer(monkeypatch):
    # packing_wins times the tiled form on at most 32 of a block's experts (a copy), not the whole layer
    _need(torch.float32)
    import adapt.runtime.tactics as tactics

    x, w, ids, wgu, wd = _case(4, 64, 32, 40, 2, seed=9)

    class Block:  # what packing_wins reads from a MoE module
        experts, hidden_size, num_inter, expert_offset = tuple(range(40)), 64, 32, 0
        w_gate_up, w_down = wgu.transpose(1, 2).contiguous().transpose(1, 2), wd

        class moe:
            top_k = 2

    packed = []
    real = tactics.pack_tiled
    monkeypatch.setattr(tactics, "pack_tiled", lambda t, p: packed.append(t.shape[0]) or real(t, p))
    monkeypatch.setattr(tactics.TACTICS, "recall", lambda *a: None)
    monkeypatch.setattr(tactics.TACTICS, "remember", lambda *a: None)
    monkeypatch.setattr(tactics, "_PACK_TRIALS", {})
    assert isinstance(tactics.packing_wins(Block, torch.float32, "tiled"), bool)
    assert packed == [32, 32] and torch.equal(Block.w_gate_up, wgu)
