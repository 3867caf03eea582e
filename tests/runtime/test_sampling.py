"""Sampling: params validation, greedy, filtering, seeds independent of the batch, logprobs."""

from __future__ import annotations

import math

import pytest
import torch

from adapt.errors import RuntimeConfigError
from adapt.runtime.sampling import SamplingParams, make_generator, sample

GREEDY = SamplingParams(temperature=0)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"top_k": -2}, "top_k"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"seed": 1.5}, "seed"),
        ({"stop": [""]}, "stop"),
        ({"stop_token_ids": [-1]}, "stop_token_ids"),
        ({"logprobs": 21}, "logprobs"),
        ({"logprobs": -1}, "logprobs"),
    ],
)
def test_params_validation(kwargs: dict, match: str) -> None:
    with pytest.raises(RuntimeConfigError, match=match) as info:
        SamplingParams(**kwargs)
    assert "\n" not in str(info.value)


def test_params_normalisation() -> None:
    p = SamplingParams(stop="END", stop_token_ids=[3, 4], top_k=0)  # type: ignore[arg-type]
    assert p.stop == ("END",) and p.stop_token_ids == (3, 4) and p.top_k is None
    assert SamplingParams(top_k=-1).top_k is None
    assert GREEDY.greedy and not SamplingParams().greedy
    assert make_generator(SamplingParams()) is None
    assert make_generator(SamplingParams(seed=-5)) is not None


def test_greedy_is_argmax_with_lowest_id_ties() -> None:
    logits = torch.tensor([[1.0, 3.0, 3.0, 0.0], [5.0, 5.0, 5.0, 5.0], [0.0, 0.0, 0.0, 9.0]])
    out = sample(logits, [GREEDY] * 3)
    assert out.token_ids.tolist() == [1, 0, 3]
    assert torch.equal(out.token_ids, torch.argmax(logits, dim=-1))
    assert out.top_logprobs == [None, None, None]


def test_top_k_one_is_greedy_and_top_k_restricts() -> None:
    torch.manual_seed(0)
    logits = torch.randn(1, 50).expand(4000, 50).contiguous()
    assert (sample(logits, [SamplingParams(top_k=1)] * 4000).token_ids == logits[0].argmax()).all()
    allowed = set(logits[0].topk(5).indices.tolist())
    drawn = set(sample(logits, [SamplingParams(top_k=5, temperature=2.0)] * 4000).token_ids.tolist())
    assert drawn == allowed


def test_top_p_keeps_smallest_prefix() -> None:
    logits = torch.tensor([[0.5, 0.3, 0.2]]).log().expand(3000, 3)
    assert set(sample(logits, [SamplingParams(top_p=0.6)] * 3000).token_ids.tolist()) == {0, 1}
    assert set(sample(logits, [SamplingParams(top_p=0.5)] * 3000).token_ids.tolist()) == {0}
    assert set(sample(logits, [SamplingParams(top_p=0.9)] * 3000).token_ids.tolist()) == {0, 1, 2}


def test_frequencies_follow_softmax_with_temperature() -> None:
    torch.manual_seed(1)
    base = torch.tensor([2.0, 1.0, 0.0, -1.0])
    n = 40000
    for t in (1.0, 0.5):
        ids = sample(base.expand(n, 4), [SamplingParams(temperature=t)] * n).token_ids
        freq = torch.bincount(ids, minlength=4).float() / n
        # 4 sigma of a binomial proportion at n = 40000 is < 0.01
        assert torch.allclose(freq, torch.softmax(base / t, -1), atol=0.01), (t, freq)


def test_seeded_rows_do_not_depend_on_batch() -> None:
    torch.manual_seed(2)
    vocab = 97
    steps = [torch.randn(1, vocab) for _ in range(8)]
    mine = SamplingParams(seed=1234, top_p=0.9, temperature=0.8)

    def run(companions: list[SamplingParams], position: int) -> list[int]:
        gens = [make_generator(p) for p in companions]
        params = list(companions)
        params.insert(position, mine)
        gens.insert(position, make_generator(mine))
        chosen = []
        for row in steps:
            logits = torch.randn(len(params), vocab)
            logits[position] = row[0]
            chosen.append(int(sample(logits, params, gens).token_ids[position]))
        return chosen

    alone = run([], 0)
    assert run([GREEDY, SamplingParams(), SamplingParams(top_k=3, seed=7)], 2) == alone
    assert run([SamplingParams(temperature=1.3, top_p=0.5)] * 5, 0) == alone
    assert len(set(alone)) > 1  # it did sample


def test_logprobs() -> None:
    torch.manual_seed(3)
    logits = torch.randn(3, 30)
    params = [SamplingParams(temperature=0, logprobs=5), SamplingParams(logprobs=0), SamplingParams()]
    out = sample(logits, params)
    ref = torch.log_softmax(logits, -1)
    assert torch.allclose(out.logprobs, ref.gather(-1, out.token_ids[:, None])[:, 0])
    top = out.top_logprobs[0]
    assert top is not None and len(top) == 5
    assert [i for i, _ in top] == ref[0].topk(5).indices.tolist()
    assert top[0][0] == int(out.token_ids[0]) and math.isclose(top[0][1], float(ref[0].max()), rel_tol=1e-6)
    assert out.top_logprobs[1] == [] and out.top_logprobs[2] is None
    assert out.logprobs.dtype == torch.float32 and out.token_ids.dtype == torch.int64


def test_low_precision_logits_and_errors() -> None:
    logits = torch.randn(2, 16, dtype=torch.bfloat16)
    out = sample(logits, [GREEDY, SamplingParams(seed=0)])
    assert out.token_ids[0] == logits.float().argmax(-1)[0]
    with pytest.raises(RuntimeConfigError, match="rows"):
        sample(logits, [GREEDY])
    with pytest.raises(RuntimeConfigError, match="generators"):
        sample(logits, [GREEDY, GREEDY], [None])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_seeded_rows_do_not_depend_on_batch() -> None:
    params = SamplingParams(seed=99, top_k=20, temperature=0.7)
    row = torch.randn(1, 1000, device="cuda")
    alone = sample(row, [params], [make_generator(params, "cuda")]).token_ids
    batch = torch.cat([torch.randn(3, 1000, device="cuda"), row])
    others = [GREEDY, SamplingParams(), SamplingParams(top_p=0.3)]
    gens = [None, None, None, make_generator(params, "cuda")]
    assert sample(batch, others + [params], gens).token_ids[3] == alone[0]


def test_no_logprobs_asked_skips_them_and_greedy_ties_stay_lowest() -> None:
    logits = torch.zeros(2, 50)
    logits[0, [7, 3, 30]] = 2.0  # a three-way tie: the lowest id wins
    logits[1, 49] = 1.0
    out = sample(logits, [GREEDY, GREEDY])
    assert out.logprobs is None and out.top_logprobs == [None, None]
    assert out.token_ids.tolist() == [3, 49]
