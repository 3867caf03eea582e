"""Every Triton kernel against its twin, under Triton's CPU interpreter (TRITON_INTERPRET=1) in float32,
on odd shapes: head_dim 40, GQA 3:1, block sizes that do not divide the sequences, ragged batches, a
cached prefix (cu_seqlens_k), sliding windows, int8 caches, expert-parallel offsets. On a machine with a
GPU, ADAPT_TEST_DEVICE=cuda runs the same tests there instead (bench/kernels_bench.py times them).
"""

import os

import pytest
import torch

DEVICE = os.environ.get("ADAPT_TEST_DEVICE", "cpu")
if DEVICE == "cpu":
    os.environ.setdefault("TRITON_INTERPRET", "1")  # read when the kernels are decorated: before their import
pytest.importorskip("triton", reason="triton is not installed (pip install 'adapt[triton]'): the Triton kernels "
                    "are not tested")

from adapt.runtime.kernels import activation, attention, kv_write, mla, moe_experts, moe_routing, norm  # noqa: E402
from adapt.runtime.kernels import paged_attention, rope  # noqa: E402
from adapt.runtime.kernels.kv_quant import quantize_int8  # noqa: E402
from adapt.runtime.kernels.triton import attention as t_attn  # noqa: E402
from adapt.runtime.kernels.triton import cache as t_cache  # noqa: E402
from adapt.runtime.kernels.triton import mla as t_mla  # noqa: E402
from adapt.runtime.kernels.triton import moe as t_moe  # noqa: E402
from adapt.runtime.kernels.triton import norm_act as t_na  # noqa: E402
from adapt.runtime.kernels.triton import routing as t_route  # noqa: E402
from tests.runtime.kernels._tol import assert_fp32_close  # noqa: E402

D, HQ, HKV = 40, 6, 2  # head_dim 40, GQA 3:1


def rn(*shape, scale=1.0):
    return (torch.randn(*shape) * scale).to(DEVICE)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def _paged(bs=5):
    # ragged: 7 and 13 keys over blocks of 5 (neither a multiple), an empty sequence, a single key
    lens = torch.tensor([7, 13, 0, 1], dtype=torch.int32, device=DEVICE)
    tables = torch.tensor([[3, 1, -1], [0, 2, 4], [-1, -1, -1], [5, -1, -1]], dtype=torch.int32, device=DEVICE)
    return lens, tables


def test_rms_norm_and_fused_add():
    x, r, w = rn(7, 3, 40), rn(7, 3, 40), rn(40).abs() + 0.5
    assert_fp32_close(t_na.rms_norm(x, w, 1e-6), norm.rms_norm_ref(x, w, 1e-6), "rms_norm")
    out, new = t_na.fused_add_rms_norm(x, r, w, 1e-5)
    ref_out, ref_new = norm.fused_add_rms_norm_ref(x, r, w, 1e-5)
    assert_fp32_close(out, ref_out, "fused_add_rms_norm")
    assert torch.equal(new, ref_new)


def test_silu_and_mul_odd_width():
    x = rn(5, 3, 2 * 37)
    assert_fp32_close(t_na.silu_and_mul(x), activation.silu_and_mul_ref(x), "silu_and_mul")


@pytest.mark.parametrize("layout", ["rotate_half", "interleave", "interleave_pairs"])
def test_rope_layouts_partial_rotary_on_a_strided_view(layout):
    inv, _ = rope.rope_inv_freq(24, 10000.0)
    cos, sin = rope.rope_cos_sin(inv.to(DEVICE), torch.arange(5, device=DEVICE))
    x = rn(5, 9, D)[:, 2:7]  # a view with a head stride, as q|k of the fused qkv; 24 of 40 dims rotated
    assert_fp32_close(t_na.apply_rope(x, cos, sin, layout), rope.apply_rope_ref(x, cos, sin, layout), layout)


@pytest.mark.parametrize("int8", [False, True])
def test_write_kv_cache(int8):
    k, v = rn(6, HKV, D), rn(6, HKV, 24)
    slots = torch.tensor([0, 3, 5, -1, 9, 11], device=DEVICE)  # a padding slot
    dt = torch.int8 if int8 else torch.float32
    caches = [torch.zeros(4, 3, HKV, n, dtype=dt, device=DEVICE) for n in (D, 24)]
    scales = [torch.zeros(4, 3, HKV, device=DEVICE) for _ in range(2)] if int8 else [None, None]
    ref_c = [c.clone() for c in caches]
    ref_s = [s.clone() if s is not None else None for s in scales]
    t_cache.write_kv_cache(k, v, *caches, slots, *scales)
    kv_write.write_kv_cache_ref(k, v, *ref_c, slots, *ref_s)
    for a, b in zip(caches + scales, ref_c + ref_s):
        if a is not None:
            assert torch.equal(a, b)


def test_write_mla_cache():
    c, kp = rn(6, 32), rn(6, 8)
    slots = torch.tensor([0, 3, 5, -1, 9, 11], device=DEVICE)
    lat = torch.zeros(4, 3, 40, device=DEVICE)
    ref = lat.clone()
    t_cache.write_mla_cache(c, kp, lat, slots)
    mla.write_mla_cache_ref(c, kp, ref, slots)
    assert torch.equal(lat, ref)


@pytest.mark.parametrize("window", [None, 4])
def test_paged_decode_gqa_window(window):
    lens, tables = _paged()
    q, kc, vc = rn(4, HQ, D), rn(12, 5, HKV, D), rn(12, 5, HKV, 24)
    out = t_attn.paged_decode_attention(q, kc, vc, tables, lens, 0.3, window=window)
    ref = paged_attention.paged_decode_attention_ref(q, kc, vc, tables, lens, 0.3, window=window)
    assert_fp32_close(out, ref, f"paged decode window={window}")
    assert torch.equal(out[2], torch.zeros_like(out[2]))  # no key: zeros by contract


def test_paged_decode_int8_cache():
    lens, tables = _paged()
    q = rn(4, HQ, D)
    (k8, ks), (v8, vs) = quantize_int8(rn(12, 5, HKV, D)), quantize_int8(rn(12, 5, HKV, D))
    out = t_attn.paged_decode_attention(q, k8, v8, tables, lens, 0.3, ks, vs)
    assert_fp32_close(out, paged_attention.paged_decode_attention_ref(q, k8, v8, tables, lens, 0.3, ks, vs), "int8")


@pytest.mark.parametrize("window", [None, 6])
def test_varlen_prefill_over_a_cached_prefix(window):
    # queries 5 and 17 after cached prefixes of 4 and 4 keys; 16-row tiles do not divide 17 or 21
    cu, cu_k = (torch.tensor(x, dtype=torch.int32, device=DEVICE) for x in ([0, 5, 22], [0, 9, 30]))
    q, k, v = rn(22, HQ, D), rn(30, HKV, D), rn(30, HKV, 24)
    out = t_attn.varlen_attention(q, k, v, cu, 0.2, True, cu_k, 16, 16, window)
    assert_fp32_close(out, attention.varlen_attention_ref(q, k, v, cu, 0.2, True, cu_k, window=window), "varlen")


def test_varlen_plain_and_bidirectional():
    cu = torch.tensor([0, 5, 22], dtype=torch.int32, device=DEVICE)
    q, k, v = rn(22, HQ, D), rn(22, HKV, D), rn(22, HKV, D)
    for causal in (True, False):
        out = t_attn.varlen_attention(q, k, v, cu, 0.2, causal)
        assert_fp32_close(out, attention.varlen_attention_ref(q, k, v, cu, 0.2, causal), f"causal={causal}")
    with pytest.raises(ValueError, match="sequence 1: 17 queries over 3 keys"):
        t_attn.varlen_attention(q, k, v, cu, 0.2, True, torch.tensor([0, 5, 8], dtype=torch.int32, device=DEVICE))


def test_mla_decode_absorbed_and_prefill():
    lens, tables = _paged()
    h, r, dr, dn, dv = 3, 32, 8, 16, 24
    kv_b = rn(h * (dn + dv), r, scale=0.3)
    lat = rn(12, 5, r + dr)
    qn, qp = rn(4, h, dn), rn(4, h, dr)
    assert_fp32_close(t_mla.mla_decode(qn, qp, lat, tables, lens, kv_b, dv, 0.2),
                      mla.mla_decode_ref(qn, qp, lat, tables, lens, kv_b, dv, 0.2), "mla_decode")
    cu, cu_k = (torch.tensor(x, dtype=torch.int32, device=DEVICE) for x in ([0, 5, 22], [0, 9, 30]))
    qn, qp, c, kp = rn(22, h, dn), rn(22, h, dr), rn(30, r), rn(30, dr)
    assert_fp32_close(t_attn.mla_prefill(qn, qp, c, kp, kv_b, dv, cu, 0.2, cu_seqlens_k=cu_k),
                      mla.mla_prefill_ref(qn, qp, c, kp, kv_b, dv, cu, 0.2, cu_seqlens_k=cu_k), "mla_prefill")


def _by_id(w, ids):
    o = ids.argsort(-1)
    return w.gather(-1, o), ids.gather(-1, o)


@pytest.mark.parametrize("renormalize", [True, False])
def test_softmax_topk_and_router(renormalize):
    logits = rn(9, 12)
    w, i = _by_id(*t_route.softmax_topk(logits, 3, renormalize))
    rw, ri = _by_id(*moe_routing.softmax_topk_ref(logits, 3, renormalize))
    assert torch.equal(i, ri)
    assert_fp32_close(w, rw, "softmax_topk")
    x, gate = rn(9, 40), rn(12, 40, scale=0.3)
    lg, w, i = t_route.router_softmax_topk(x, gate, None, 2, renormalize)
    rlg, rw, ri = moe_routing.router_softmax_topk_ref(x, gate, None, 2, renormalize)
    assert_fp32_close(lg, rlg, "router logits")
    assert torch.equal(_by_id(w, i)[1], _by_id(rw, ri)[1])


@pytest.mark.parametrize("n_group,topk_group,norm", [(4, 2, True), (1, 1, False), (3, 1, True)])
def test_sigmoid_grouped_topk(n_group, topk_group, norm):
    logits, bias = rn(9, 12), rn(12, scale=0.1)  # groups of 3 experts: not a power of two
    w, i = _by_id(*t_route.sigmoid_grouped_topk(logits, 3, bias, n_group, topk_group, norm, 2.5))
    rw, ri = _by_id(*moe_routing.sigmoid_grouped_topk_ref(logits, 3, bias, n_group, topk_group, norm, 2.5))
    assert torch.equal(i, ri)
    assert_fp32_close(w, rw, "sigmoid_grouped_topk")


@pytest.mark.parametrize("offset", [0, 3])
def test_fused_moe_transposed_weights_and_foreign_slots(offset):
    # 5 local experts of 8 (offset 3: slots routed to ids < 3 are another rank's); the weights are held
    # transposed as the runtime's MoE holds them; I = 24 and H = 40 do not fill the tiles
    x, w = rn(7, 40), torch.rand(7, 3, device=DEVICE)
    ids = torch.randint(0, 8, (7, 3), device=DEVICE)
    gu, dn = rn(5, 48, 40, scale=0.2), rn(5, 40, 24, scale=0.2)
    gu_t, dn_t = (t.transpose(1, 2).contiguous().transpose(1, 2) for t in (gu, dn))
    out = t_moe.moe_experts_fused(x, w, ids, gu_t, dn_t, offset)
    assert_fp32_close(out, moe_experts.moe_experts_fused_ref(x, w, ids, gu, dn, offset), "fused moe")
    none_here = t_moe.moe_experts_fused(x, w, ids, gu, dn, 100)  # every slot another rank's
    assert torch.equal(none_here, torch.zeros_like(none_here))
