"""The linear on column panels (csrc/moe_gemm.h linear_tiled) against its twin and F.linear: float32,
bfloat16 and float16 (widened as they are read), row tails and chunks, odd K, bias, batched inputs, thread counts, the
torch fallback, packing round trips, and the model layers that take it."""

import pytest
import torch
import torch.nn.functional as F

from adapt.runtime import cpu_kernels
from adapt.runtime.kernels import fused
from adapt.runtime.kernels.linear_tiled import (linear_tiled, linear_tiled_ref, linear_tiles, pack_linear,
                                                unpack_linear)
from adapt.runtime.kernels.moe_experts import onednn_packs
from adapt.runtime.kernels.moe_tiled import tiled_panel, tiled_vnni

from ._tol import assert_fp32_close, assert_lowp_close


def _need():
    if cpu_kernels.load() is None:
        pytest.skip(f"fused CPU kernels {cpu_kernels.status()}")
    if not linear_tiles(64, 64, torch.float32):
        pytest.skip("no vector layer in this build: linear_tiled does not run")


def _case(m, k, n, seed=0, bias=True):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(m, k, generator=g), torch.randn(n, k, generator=g) * k ** -0.5,
            torch.randn(n, generator=g) if bias else None)


@pytest.mark.parametrize("m", [1, 5, 6, 7, 16, 255, 256, 257, 600])
@pytest.mark.parametrize("k", [1, 3, 100, 768])
def test_linear_tiled_matches_f_linear_and_twin(m, k):
    _need()
    p = tiled_panel(torch.float32)
    for n, bias in ((p, True), (3 * p, False), (5 * p, True)):
        x, w, b = _case(m, k, n, seed=m * 1000 + k, bias=bias)
        wp = pack_linear(w, p)
        y = linear_tiled(x, wp, b)
        assert y.shape == (m, n) and y.dtype == torch.float32
        assert_fp32_close(y, F.linear(x, w, b), f"m={m} k={k} n={n}")
        assert_fp32_close(linear_tiled_ref(x, wp, b), F.linear(x, w, b), "twin")  # MKL's bits follow alignment


def test_linear_tiled_batched_input_threads_and_fallback():
    _need()
    p = tiled_panel(torch.float32)
    x, w, b = _case(2 * 37, 200, 4 * p)
    x = x.view(2, 37, 200)
    wp = pack_linear(w, p)
    y = linear_tiled(x, wp, b)
    assert y.shape == (2, 37, 4 * p)
    assert_fp32_close(y, F.linear(x, w, b), "batched")
    threads = torch.get_num_threads()
    try:  # an output is summed by one thread in k order: the thread count changes no bit
        torch.set_num_threads(1)
        one = linear_tiled(x, wp, b)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, y)
    with fused.disabled():  # the torch form: the same layout unpacked
        assert_fp32_close(linear_tiled(x, wp, b), F.linear(x, w, b), "torch form")
    assert linear_tiled(x[:, :0], wp, b).shape == (2, 0, 4 * p)


def test_pack_round_trip_and_what_tiles():
    p = 64
    w = torch.randn(3 * p, 50)
    wp = pack_linear(w, p)
    assert wp.shape == (3, 50, p) and torch.equal(unpack_linear(wp), w)
    assert torch.equal(wp[1, 7], w[p:2 * p, 7])  # panel 1 holds columns p..2p of the transposed weight
    if tiled_panel(torch.float32):
        q = tiled_panel(torch.float32)
        assert linear_tiles(2 * q, 7, torch.float32) and not linear_tiles(2 * q + 1, 7, torch.float32)
    # bfloat16 where the CPU has no bf16 dot product, float16 where oneDNN cannot pack it (oneDNN's native
    # 16-bit linears elsewhere)
    assert linear_tiles(128, 64, torch.bfloat16) == (tiled_panel(torch.bfloat16) > 0 and not tiled_vnni(torch.bfloat16))
    assert linear_tiles(128, 64, torch.float16) == (tiled_panel(torch.float16) > 0 and not onednn_packs(torch.float16))
    assert not linear_tiles(128, 64, torch.float64)


@pytest.mark.parametrize("m", [1, 7, 16, 300])
@pytest.mark.parametrize("k", [3, 100, 768])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_16bit_linear_tiled_within_2x_of_f_linear(m, k, dtype):
    # every host with a vector layer runs bfloat16 panels, and float16 ones where it converts float16 (F16C,
    # AVX-512); prepack takes them where oneDNN has no native 16-bit linear: one rounding after the float32
    # sum and the bias
    _need()
    if not tiled_panel(dtype):
        pytest.skip(f"this build's vector layer does not convert {dtype}")
    p = tiled_panel(torch.float32)
    for n, bias in ((p, "lowp"), (3 * p, None), (2 * p, "f32")):
        x, w, b = _case(m, k, n, seed=m * 1000 + k + 7, bias=bias is not None)
        x, w = x.to(dtype), w.to(dtype)
        b = None if b is None else b.to(dtype) if bias == "lowp" else b.to(dtype).float()
        wp = pack_linear(w, p)
        y = linear_tiled(x, wp, b)
        assert y.shape == (m, n) and y.dtype == dtype
        ref32 = F.linear(x.float(), w.float(), None if b is None else b.float())
        assert_lowp_close(y, F.linear(x, w, None if b is None else b.to(dtype)), ref32, f"{dtype} m={m} k={k} n={n}")
        assert_lowp_close(linear_tiled_ref(x, wp, None if b is None else b.to(dtype)), F.linear(
            x, w, None if b is None else b.to(dtype)), ref32, "twin")
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = linear_tiled(x, wp, b)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, y)


def test_kernel_refuses_what_it_does_not_take():
    _need()
    ext = fused.module()
    p = tiled_panel(torch.float32)
    x, w, b = _case(4, 32, p)
    wp = pack_linear(w, p)
    with pytest.raises(RuntimeError, match="linear_tiled"):
        ext.linear_tiled(x.double(), wp, None)
    with pytest.raises(RuntimeError, match="linear_tiled"):
        ext.linear_tiled(x[:, :16].contiguous(), wp, None)  # K mismatch
    with pytest.raises(RuntimeError, match="linear_tiled"):
        ext.linear_tiled(x, wp, torch.zeros(p + 1))
    with pytest.raises(RuntimeError, match="linear_tiled"):
        ext.linear_tiled(x.bfloat16(), wp, None)  # x and W of different dtypes
    with pytest.raises(RuntimeError, match="linear_tiled"):
        ext.linear_tiled(x.bfloat16(), wp.bfloat16(), torch.zeros(p, dtype=torch.float16))
    with pytest.raises(RuntimeError, match="linear_tiled"):
        ext.linear_tiled(x.half(), wp.bfloat16(), None)  # float16 x on bfloat16 panels


def test_prepacked_float32_layers_take_it_and_keep_their_outputs():
    _need()
    from adapt.runtime.backends.cpu_layouts import PanelWeight, prepack_linears
    from adapt.runtime.models.layers import Linear, linear

    layer = Linear("l", 96, 2 * tiled_panel(torch.float32), dtype=torch.float32)
    torch.nn.init.normal_(layer.weight, std=0.1)
    odd = Linear("o", 96, 2 * tiled_panel(torch.float32) + 1, dtype=torch.float32)  # N not a panel multiple
    torch.nn.init.normal_(odd.weight, std=0.1)
    model = torch.nn.ModuleList([layer, odd])
    x = torch.randn(5, 96)
    want, want_odd = F.linear(x, layer.weight), F.linear(x, odd.weight)
    assert prepack_linears(model, tiled=True) == 2
    assert isinstance(layer.weight, PanelWeight) and not isinstance(odd.weight, PanelWeight)  # the odd one: oneDNN's layout or plain
    assert_fp32_close(linear(x, layer.weight), want, "tiled layer")
    assert_fp32_close(linear(x, odd.weight), want_odd, "odd layer")


def test_prepacked_bfloat16_layers_take_it_where_the_cpu_has_no_bf16_dot_product():
    _need()
    from adapt.runtime.backends.cpu_layouts import PanelWeight, prepack_linears
    from adapt.runtime.models.layers import Linear, linear

    n = 2 * tiled_panel(torch.float32)
    layer = Linear("l", 96, n, dtype=torch.bfloat16)
    torch.nn.init.normal_(layer.weight, std=0.1)
    x = torch.randn(5, 96).bfloat16()
    want, w = F.linear(x, layer.weight), layer.weight.detach().clone()
    prepack_linears(torch.nn.ModuleList([layer]), tiled=True)
    assert isinstance(layer.weight, PanelWeight) == linear_tiles(n, 96, torch.bfloat16)
    assert_lowp_close(linear(x, layer.weight), want, F.linear(x.float(), w.float()), "bf16 layer")
