import math

import pytest
import torch

from adapt.validate import compare as C


def test_elementwise_known_values():
    r = torch.tensor([1.0, 2.0, 0.0, -4.0])
    t = torch.tensor([1.0, 2.5, 0.0, -3.0])
    assert C.max_abs(t, r) == pytest.approx(1.0)
    assert C.max_rel(t, r) == pytest.approx(0.25)
    assert C.max_rel(torch.tensor([1e-3]), torch.tensor([0.0])) == pytest.approx(1e-3 / C.REL_EPS)
    assert C.cosine(r, r) == pytest.approx(1.0)
    assert C.cosine(torch.tensor([1.0, 0.0]), torch.tensor([0.0, 1.0])) == pytest.approx(0.0)
    assert C.cosine(-r, r) == pytest.approx(-1.0)
    assert C.cosine(torch.zeros(3), torch.zeros(3)) == 1.0
    assert C.cosine(torch.zeros(3), torch.ones(3)) == 0.0
    with pytest.raises(ValueError, match="shape"):
        C.max_abs(torch.zeros(2), torch.zeros(3))


def test_cosine_is_float64_and_flattened():
    x = torch.randn(3, 5, dtype=torch.bfloat16)
    assert C.cosine(x, x.reshape(3, 5)) == pytest.approx(1.0, abs=1e-12)


def test_kl_known_value():
    # two positions: identical, then p = softmax([0, 0]) vs q = softmax([log 3, 0]) = (3/4, 1/4)
    ref = torch.tensor([[1.0, 2.0], [0.0, 0.0]])
    tgt = torch.tensor([[1.0, 2.0], [math.log(3.0), 0.0]])
    expect = 0.5 * math.log(0.5 / 0.75) + 0.5 * math.log(0.5 / 0.25)
    kl = C.kl_divergence(ref, tgt)
    assert kl["kl_max"] == pytest.approx(expect)
    assert kl["kl_mean"] == pytest.approx(expect / 2)
    assert C.kl_divergence(ref, ref)["kl_max"] == 0.0


def test_kl_reference_zero_probability_is_finite():
    ref = torch.tensor([[0.0, -math.inf]])
    tgt = torch.tensor([[0.0, 0.0]])
    assert C.kl_divergence(ref, tgt)["kl_mean"] == pytest.approx(math.log(2.0))


def test_top1_and_topk():
    ref = torch.tensor([[[5.0, 4.0, 3.0, 0.0], [0.0, 1.0, 2.0, 3.0]]])  # [B=1, T=2, V=4]
    tgt = torch.tensor([[[5.0, 3.0, 4.0, 0.0], [3.0, 1.0, 2.0, 0.0]]])
    assert C.top1_agreement(ref, tgt) == pytest.approx(0.5)
    assert C.topk_overlap(ref, tgt, k=2) == pytest.approx((1 / 2 + 1 / 2) / 2)
    assert C.topk_overlap(ref, tgt, k=4) == pytest.approx(1.0)
    assert C.topk_overlap(ref, tgt, k=99) == pytest.approx(1.0)


def test_perplexity_uniform_and_delta():
    v = 8
    logits = torch.zeros(2, 3, v)
    ids = torch.randint(0, v, (2, 3))
    assert C.perplexity(logits, ids) == pytest.approx(v)
    sharp = torch.zeros(2, 3, v).scatter_(-1, ids.unsqueeze(-1), 10.0)
    d = C.perplexity_delta(logits, sharp, ids)
    assert d["ppl_reference"] == pytest.approx(v)
    assert d["ppl_delta"] == pytest.approx(d["ppl_target"] - v)
    assert d["ppl_delta"] < 0 and d["ppl_delta_rel"] == pytest.approx(d["ppl_delta"] / v)
    with pytest.raises(ValueError):
        C.perplexity(logits, ids[:, :2])


def test_tensor_compare_prints_like_llmc():
    r = torch.ones(4)
    ok = C.compare_tensors(r + 1e-7, r, name="ln_f")
    assert ok.ok and str(ok).startswith("ln_f: TENSOR OK, maxdiff = 1.")
    bad = C.compare_tensors(r + 1.0, r)
    assert not bad.ok and str(bad).startswith("TENSOR NOT OK, maxdiff = 1.000000e+00")
    nan = C.compare_tensors(torch.tensor([math.nan]), torch.tensor([0.0]), atol=math.inf)
    assert not nan.ok


def _lp(*pairs):
    return dict(pairs)


def test_logprobs_identical():
    res = C.check_logprobs_close([1, 2, 3], [{}] * 3, [1, 2, 3], [{}] * 3)
    assert res.close and res.identical and res.diverged_at is None


def test_logprobs_close_at_first_divergence():
    ref_lp = [_lp((1, -0.1)), _lp((2, -0.5), (7, -0.6), (9, -3.0))]
    tgt_lp = [_lp((1, -0.1)), _lp((7, -0.5), (2, -0.55))]
    # after the divergence the continuations differ wildly: not compared
    res = C.check_logprobs_close([1, 2, 5], ref_lp + [{}], [1, 7, 8], tgt_lp + [{}])
    assert res.close and not res.identical
    assert (res.diverged_at, res.reference_token, res.target_token) == (1, 2, 7)


def test_logprobs_not_close_names_position():
    ref_lp = [_lp((4, -0.1), (5, -2.0))]
    tgt_lp = [_lp((6, -0.1), (4, -2.0))]
    res = C.check_logprobs_close([4], ref_lp, [6], tgt_lp)
    assert not res.close and res.diverged_at == 0
    assert "target token 6 not in reference top-N" in res.message


def test_logprobs_top_n_restricts():
    ref_lp = [_lp((4, -0.1), (5, -1.0), (6, -2.0))]
    tgt_lp = [_lp((6, -0.1), (4, -0.2))]
    assert C.check_logprobs_close([4], ref_lp, [6], tgt_lp).close
    assert not C.check_logprobs_close([4], ref_lp, [6], tgt_lp, top_n=2).close


def test_logprobs_length_mismatch_is_reported():
    res = C.check_logprobs_close([1, 2], [{}, {}], [1], [{}])
    assert res.close and res.length_mismatch and res.diverged_at == 1


def test_layer_error_growth_and_first_divergence():
    torch.manual_seed(0)
    ref = [torch.randn(2, 4) for _ in range(3)]
    tgt = [ref[0].clone(), ref[1] + 1e-3, ref[2] + 4e-3]
    curve = C.layer_error_growth(ref, tgt, names=["a", "b", "c"])
    assert [e["name"] for e in curve] == ["a", "b", "c"]
    assert curve[0]["max_abs"] == 0.0 and curve[0]["growth"] == 1.0
    assert curve[1]["growth"] == math.inf
    assert curve[2]["growth"] == pytest.approx(4.0, rel=1e-3)
    assert C.first_divergence(curve, max_abs_max=2e-3) == {"layer": 2, "module": "c"}
    assert C.first_divergence(curve, max_abs_max=1.0) is None
    with pytest.raises(ValueError):
        C.layer_error_growth(ref, tgt[:2])


def test_logits_metrics_bundle():
    x = torch.randn(3, 10)
    m = C.logits_metrics(x, x)
    assert m["max_abs"] == 0.0 and m["top1_agreement"] == 1.0 and m["kl_max"] == 0.0
