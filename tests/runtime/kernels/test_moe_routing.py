"""Routers against transformers' own router modules, and against the per-token twins."""

import pytest
import torch
from transformers import DeepseekV2Config, DeepseekV3Config, MixtralConfig, Qwen2MoeConfig, Qwen3MoeConfig
from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2TopkRouter
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter
from transformers.models.mixtral.modeling_mixtral import MixtralTopKRouter
from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeTopKRouter
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

from adapt.runtime.kernels.moe_experts import onednn_packs
from adapt.runtime.kernels.moe_routing import (
    deepseek_v2_topk,
    deepseek_v2_topk_ref,
    router_logits,
    sigmoid_grouped_topk,
    sigmoid_grouped_topk_ref,
    softmax_topk,
    softmax_topk_ref,
)

T, HID, E = 37, 32, 16


def _x(dtype=torch.float32, seed=0):
    return torch.randn(T, HID, generator=torch.Generator().manual_seed(seed)).to(dtype)


def _randomize(router, seed=1):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        router.weight.copy_(torch.randn(router.weight.shape, generator=g))
        if hasattr(router, "e_score_correction_bias"):
            router.e_score_correction_bias.copy_(torch.rand(E, generator=g) * 0.5)
    return router


def _canon(w, ids):
    order = ids.argsort(dim=-1)
    return w.gather(1, order), ids.gather(1, order)


def _assert_twin(got, twin):
    (w, i), (wr, ir) = _canon(*got), _canon(*twin)
    assert torch.equal(i, ir.to(i.dtype))
    torch.testing.assert_close(w, wr.float(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mixtral(dtype):
    cfg = MixtralConfig(hidden_size=HID, num_local_experts=E, num_experts_per_tok=2)
    router = _randomize(MixtralTopKRouter(cfg)).to(dtype)
    x = _x(dtype)
    _, w_t, ids_t = router(x)
    w, ids = softmax_topk(router_logits(x, router.weight, float32=False), 2, renormalize=True)
    assert w.dtype == torch.float32 and ids.dtype == torch.int64
    assert torch.equal(ids, ids_t) and torch.equal(w, w_t)
    _assert_twin((w, ids), softmax_topk_ref(router_logits(x, router.weight, False), 2, True))


@pytest.mark.parametrize("cls,cfg_cls", [(Qwen2MoeTopKRouter, Qwen2MoeConfig), (Qwen3MoeTopKRouter, Qwen3MoeConfig)])
@pytest.mark.parametrize("norm_topk_prob", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_qwen_moe(cls, cfg_cls, norm_topk_prob, dtype):
    cfg = cfg_cls(hidden_size=HID, num_experts=E, num_experts_per_tok=4, norm_topk_prob=norm_topk_prob)
    router = _randomize(cls(cfg)).to(dtype)
    x = _x(dtype)
    _, w_t, ids_t = router(x)
    w, ids = softmax_topk(router_logits(x, router.weight, float32=False), 4, renormalize=norm_topk_prob)
    assert torch.equal(ids, ids_t)
    assert torch.equal(w.to(dtype), w_t)  # transformers casts the weights back to the logits' dtype
    _assert_twin((w, ids), softmax_topk_ref(router_logits(x, router.weight, False), 4, norm_topk_prob))


@pytest.mark.parametrize("method", ["greedy", "group_limited_greedy"])
def test_deepseek_v2(method):
    cfg = DeepseekV2Config(
        hidden_size=HID, n_routed_experts=E, num_experts_per_tok=3, topk_method=method, n_group=4, topk_group=2,
        routed_scaling_factor=16.0,
    )
    router = _randomize(DeepseekV2TopkRouter(cfg))
    assert router.num_experts == E
    x = _x(torch.bfloat16)
    _, w_t, ids_t = router(x)
    logits = router_logits(x, router.weight, float32=True)
    w, ids = deepseek_v2_topk(logits, 3, method, n_group=4, topk_group=2, routed_scaling_factor=16.0)
    assert torch.equal(ids, ids_t) and torch.equal(w, w_t)
    _assert_twin((w, ids), deepseek_v2_topk_ref(logits, 3, method, 4, 2, 16.0))


@pytest.mark.parametrize(
    "n_group,topk_group,norm,top_k",
    [(4, 2, True, 4), (4, 1, False, 3), (1, 1, True, 8)],  # DeepSeek-V3 style, one group, Kimi-K2 style
)
def test_deepseek_v3_sigmoid_grouped(n_group, topk_group, norm, top_k):
    cfg = DeepseekV3Config(
        hidden_size=HID, n_routed_experts=E, num_experts_per_tok=top_k, n_group=n_group, topk_group=topk_group,
        norm_topk_prob=norm, routed_scaling_factor=2.5,
    )
    router = _randomize(DeepseekV3TopkRouter(cfg))
    assert router.num_experts == E
    x = _x(torch.bfloat16, seed=3)
    _, w_t, ids_t = router(x)
    logits = router_logits(x, router.weight, float32=True)
    bias = router.e_score_correction_bias
    w, ids = sigmoid_grouped_topk(logits, top_k, bias, n_group, topk_group, norm, 2.5)
    assert torch.equal(ids, ids_t) and torch.equal(w, w_t)
    _assert_twin((w, ids), sigmoid_grouped_topk_ref(logits, top_k, bias, n_group, topk_group, norm, 2.5))


def test_bias_steers_selection_not_weights():
    logits = torch.zeros(2, 8)
    logits[:, 0] = 1.0  # expert 0 has the best score
    bias = torch.zeros(8)
    bias[5] = 10.0  # expert 5 is always selected
    w, ids = sigmoid_grouped_topk(logits, 1, bias, norm_topk_prob=False)
    assert ids.flatten().tolist() == [5, 5]
    torch.testing.assert_close(w, torch.full((2, 1), 0.5))  # sigmoid(0), unbiased


def test_unknown_v2_method():
    with pytest.raises(ValueError, match="topk_method"):
        deepseek_v2_topk(torch.zeros(1, 4), 1, "noaux_tc")


# ---- the fused kernels' top-k (softmax_topk's selection on the CPU): torch.topk's values, ids and order


def _topk_cases():
    g = torch.Generator().manual_seed(5)
    for t, e, k in [(1, 8, 1), (37, 16, 2), (512, 32, 4), (300, 64, 6), (9, 8, 8), (130, 128, 8), (0, 16, 2)]:
        yield f"{t}x{e}k{k}", torch.softmax(torch.randn(t, e, generator=g), dim=-1), k
    tied = torch.softmax(torch.randn(64, 16, generator=g), dim=-1)
    tied[3] = 1 / 16  # a row of equal scores (a zero hidden state routes like this)
    tied[7, 5] = tied[7].max()  # two equal among the chosen
    yield "ties", tied, 4
    boundary = torch.softmax(torch.randn(16, 16, generator=g), dim=-1)
    top = boundary[2].sort(descending=True).values
    boundary[2, boundary[2] == top[4]] = top[3]  # the 4th and 5th best equal: which one is chosen
    yield "tie at the boundary", boundary, 4
    nan = torch.softmax(torch.randn(8, 16, generator=g), dim=-1)
    nan[1, 3] = float("nan")
    yield "nan", nan, 2
    # bfloat16 logits: many rows with ties, among rows without (each undecided row redone by torch.topk)
    logits = (torch.randn(512, 32, generator=g) * 0.3).to(torch.bfloat16)
    yield "bfloat16 logits", torch.softmax(logits, dim=-1, dtype=torch.float32), 4


@pytest.mark.parametrize("case", list(_topk_cases()), ids=lambda c: c[0])
def test_topk_selection_is_torch_topk(case, kernel_form):
    from adapt.runtime.kernels.moe_routing import _topk_sorted

    _, probs, k = case
    v, i = _topk_sorted(probs, k)
    vt, it = torch.topk(probs, k, dim=-1)
    assert torch.equal(i, it) and torch.equal(v.nan_to_num(-1.0), vt.nan_to_num(-1.0))


def test_topk_rows_flags_what_it_cannot_decide():
    from adapt.runtime import cpu_kernels

    ext = cpu_kernels.load()
    if ext is None:
        pytest.skip(f"fused CPU kernels {cpu_kernels.status()}")
    x = torch.tensor([[0.1, 0.4, 0.3, 0.2], [0.5, 0.1, 0.3, 0.1]])
    v, i, undecided = ext.topk_rows(x, 2)
    assert undecided.tolist() == [] and torch.equal(i, torch.tensor([[1, 2], [0, 2]]))
    assert torch.equal(v, x.gather(1, i))
    assert ext.topk_rows(x, 3)[2].tolist() == [1]  # row 1: its 3rd best (0.1) equals the best left out
    assert ext.topk_rows(x, 4)[2].tolist() == [1]  # row 1 holds two equal values among the chosen
    nan = torch.tensor([[0.1, 0.2, 0.3], [0.1, float("nan"), 0.3], [0.3, 0.2, 0.1]])
    assert ext.topk_rows(nan, 1)[2].tolist() == [1]
    with pytest.raises(RuntimeError, match="1 <= K <= E"):
        ext.topk_rows(x, 5)
    with pytest.raises(RuntimeError, match="float32"):
        ext.topk_rows(x.double(), 2)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_16bit_router_logits_round_once_from_float32_sums(dtype):
    # 16-bit logits: float32 sums rounded once, whichever GEMM runs (F.linear's 16-bit path where oneDNN has
    # native 16-bit dot products; float32's GEMM elsewhere), so within the 2x rule of torch's own F.linear
    import torch.nn.functional as F

    from ._tol import assert_lowp_close

    g = torch.Generator().manual_seed(3)
    x, w = torch.randn(37, 96, generator=g).to(dtype), (torch.randn(8, 96, generator=g) * 0.1).to(dtype)
    out = router_logits(x, w, float32=False)
    assert out.dtype == dtype and out.shape == (37, 8)
    assert_lowp_close(out, F.linear(x, w), F.linear(x.float(), w.float()), f"router {dtype}")
    if x.device.type == "cpu" and not onednn_packs(dtype):
        assert torch.equal(out, F.linear(x.float(), w.float()).to(dtype))


# ---- the fused softmax router (router_softmax_topk): logits, softmax and top-k in one call on packed panels


def _router_ext():
    from adapt.runtime import cpu_kernels

    ext = cpu_kernels.load()
    if ext is None or not list(ext.ROUTER_PANELS):
        pytest.skip(f"fused CPU kernels {cpu_kernels.status()}, or no vector layer")
    return ext


def _router_cases():
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        for t, h, e, k, renorm in [(37, 96, 8, 2, True), (512, 64, 32, 4, False), (5, 48, 60, 4, True),
                                   (100, 32, 128, 8, True), (3, 16, 1, 1, False), (0, 16, 8, 2, True)]:
            yield dtype, t, h, e, k, renorm


@pytest.mark.parametrize("case", list(_router_cases()), ids=lambda c: f"{str(c[0])[6:]}-{c[1]}x{c[2]}-e{c[3]}k{c[4]}"
                         f"{'-renorm' if c[5] else ''}")
def test_fused_router_is_logits_then_softmax_topk(case):
    # every panel width the build takes, and the vnni form where this CPU runs it: logits within the dtype's
    # tolerance of F.linear's, and the weights and ids exactly softmax_topk's on the logits it returns (ties and
    # NaNs go to torch.topk)
    from adapt.runtime.kernels.linear_tiled import unpack_linear
    from adapt.runtime.kernels.moe_routing import pack_router, router_softmax_topk, router_vnni
    from adapt.runtime.kernels.moe_tiled import unpack_tiled

    from ._tol import assert_fp32_close, assert_lowp_close

    ext = _router_ext()
    dtype, t, h, e, k, renorm = case
    g = torch.Generator().manual_seed(t + e)
    x = torch.randn(t, h, generator=g).to(dtype)
    w = (torch.randn(e, h, generator=g) * 0.2).to(dtype)
    ref32 = torch.nn.functional.linear(x.float(), w.float())
    forms = list(ext.ROUTER_PANELS) + (["vnni"] if router_vnni(h, dtype) else [])
    for p in forms:
        if p == "vnni":
            panels = pack_router(w)
            assert panels.shape == (-(-e // 32) * 2, h // 32, 16, 32)
            plain = unpack_tiled(panels[None])[0]
        else:
            panels = pack_router(w, p)
            assert panels.shape == (-(-e // p), h, p)
            plain = unpack_linear(panels)
        assert torch.equal(plain[:e], w) and not plain[e:].any()  # zero past E
        logits, weights, ids = router_softmax_topk(x, w, panels, k, renorm)
        assert logits.dtype == dtype and logits.shape == (t, e) and weights.dtype == torch.float32
        if dtype == torch.float32 or t == 0:
            assert_fp32_close(logits, ref32, f"router logits, panel {p}")
        else:
            assert_lowp_close(logits, torch.nn.functional.linear(x, w), ref32, f"router logits {dtype}, panel {p}")
        wt, it = softmax_topk(logits, k, renorm)
        assert torch.equal(ids, it), f"panel {p}"
        torch.testing.assert_close(weights, wt, rtol=2e-6, atol=1e-7)


def test_fused_router_hands_ties_and_nans_to_torch_topk():
    from adapt.runtime.kernels.moe_routing import pack_router, router_softmax_topk

    ext = _router_ext()
    g = torch.Generator().manual_seed(9)
    x = torch.randn(64, 32, generator=g)
    w = torch.randn(16, 32, generator=g)
    w[5] = w[2]  # experts 2 and 5 tie on every token: where both are chosen, torch.topk's order decides
    x[7] = 0.0  # a zero hidden state: every logit 0, all 16 experts tie
    x[9, 3] = float("nan")
    x[11] = 1e30  # logits overflow: +inf among them makes torch's softmax of the row NaN
    panels = pack_router(w, ext.ROUTER_PANELS[-1])
    logits, weights, ids = router_softmax_topk(x, w, panels, 4, True)
    _, _, _, undecided = ext.router_softmax_topk(x, panels, 16, 4, True)
    assert {7, 9, 11} <= set(undecided.tolist())  # the kernel says which rows it cannot decide
    wt, it = softmax_topk(logits, 4, True)
    assert torch.equal(ids, it)
    torch.testing.assert_close(weights, wt, rtol=2e-6, atol=1e-7, equal_nan=True)


def test_router_panel_pads_least():
    from adapt.runtime.kernels.linear_tiled import fma_panels
    from adapt.runtime.kernels.moe_routing import router_panel

    ext = _router_ext()
    widths = list(ext.ROUTER_PANELS)
    assert widths == sorted(widths, reverse=True) and all(w % widths[-1] == 0 for w in widths)
    for e in (1, 8, 32, 60, 128, 160, 384):
        p = router_panel(e, torch.float32)
        pad = -(-e // p) * p - e
        assert p in widths and all(pad < -(-e // w) * w - e or (pad == -(-e // w) * w - e and p >= w) for w in widths)
    assert router_panel(32, torch.float32) == max(w for w in widths if 32 % w == 0)  # no padding, the widest
    for dtype in (torch.bfloat16, torch.float16):  # 16-bit only where its linears take the FMA panels
        assert (router_panel(32, dtype) > 0) == fma_panels(dtype)
    assert router_panel(32, torch.float64) == 0


def test_pack_router_takes_the_hosts_form():
    from adapt.runtime.kernels.moe_routing import pack_router, router_panel, router_vnni

    ext = _router_ext()
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        for h in (64, 48):
            w = torch.randn(8, h).to(dtype)
            got = pack_router(w)
            if router_vnni(h, dtype):
                assert got.shape == (2, h // 32, 16, 32)
            elif router_panel(8, dtype):
                assert got.shape == (1, h, router_panel(8, dtype))
            else:
                assert got is None
    # bfloat16 takes the vnni form wherever the tiled MoE kernel runs a bf16 dot product (AVX512-BF16, with or
    # without AMX: the module's dp_gemm), never on the FMA panels
    assert router_vnni(64, torch.bfloat16) == (ext.moe_tiled_bf16_gemm() in ("avx512_bf16", "amx")
                                               and bool(ext.ROUTER_VNNI))
    assert not router_vnni(48, torch.bfloat16) and not router_vnni(64, torch.float32)


def test_fused_router_rejects_what_it_cannot_read():
    from adapt.runtime.kernels.moe_routing import pack_router

    ext = _router_ext()
    x, w = torch.randn(4, 32), torch.randn(8, 32)
    p = pack_router(w, ext.ROUTER_PANELS[0])
    with pytest.raises(RuntimeError, match="1 <= K <= E"):
        ext.router_softmax_topk(x, p, 8, 9, True)
    with pytest.raises(RuntimeError, match="panels"):
        ext.router_softmax_topk(x, p, p.shape[0] * p.shape[2] + 1, 2, True)  # more experts than the panels hold
    with pytest.raises(RuntimeError, match="panels"):
        ext.router_softmax_topk(x[:, :16].contiguous(), p, 8, 2, True)  # x's width is not the weight's
    with pytest.raises(RuntimeError, match="panels"):
        ext.router_softmax_topk(x, p.to(torch.bfloat16), 8, 2, True)  # another dtype
    odd = torch.zeros(1, 32, ext.ROUTER_PANELS[-1] * 3)
    with pytest.raises(RuntimeError, match="vectors"):
        ext.router_softmax_topk(x, odd, 8, 2, True)  # a panel width the build does not take
    xb = x.to(torch.bfloat16)
    with pytest.raises(RuntimeError, match="vnni"):  # 16 columns: the bfloat16 GEMM takes pairs of 16
        ext.router_softmax_topk(xb, torch.zeros(1, 1, 16, 32, dtype=torch.bfloat16), 8, 2, True)
    with pytest.raises(RuntimeError, match="vnni"):  # float32 in the vnni layout
        ext.router_softmax_topk(x, torch.zeros(2, 1, 16, 32), 8, 2, True)
