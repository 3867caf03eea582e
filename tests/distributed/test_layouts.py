"""Every layout of the acceptance list gives one rank's greedy tokens and logits (float32, gloo, tiny models).

Layouts of the same world size share one launch of forked ranks (process start-up dominates on 2 cores).
"""

from __future__ import annotations

import pytest
import torch

from adapt.runtime.sampling import SamplingParams

from .harness import spawn

PROMPTS = [[1, 5, 9, 33, 70, 11], [1, 7], [1, 300, 4]]  # ragged
MAX_TOKENS = 4
LAYOUTS = {  # world size -> (model, degrees)
    2: [("tiny-llama", dict(tp=2)), ("tiny-llama", dict(pp=2)), ("tiny-qwen3-moe", dict(tp=2, ep=2)),
        ("tiny-k2", dict(tp=2, ep=2)), ("tiny-k2", dict(pp=2)), ("tiny-qwen3-moe", dict(tp=2))],
    4: [("tiny-llama", dict(tp=4)), ("tiny-qwen3-moe", dict(tp=4, ep=4)), ("tiny-k2", dict(tp=4, ep=4)),
        ("tiny-llama", dict(tp=2, pp=2)), ("tiny-k2", dict(tp=2, pp=2, ep=2)), ("tiny-qwen3-moe", dict(tp=4, ep=2))],
}


def _name(model, deg):
    return model + "-" + "".join(f"{k}{v}" for k, v in deg.items())


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    from adapt.runtime.init_model import init_model
    from adapt.shard.run import shard

    root = tmp_path_factory.mktemp("dist")
    ckpts = {m: init_model(m, root / m) for m in ("tiny-llama", "tiny-qwen3-moe", "tiny-k2")}
    outs = {}
    for layouts in LAYOUTS.values():
        for model, deg in layouts:
            outs[_name(model, deg)] = shard(ckpts[model], root / _name(model, deg), **deg) and root / _name(model, deg)
    return ckpts, outs


def _reference(ckpt):
    from adapt.runtime.engine import Engine

    eng = Engine.from_pretrained(ckpt, kv_cache_memory="16MiB")
    toks = [r.token_ids for r in eng.generate(PROMPTS, SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True))]
    return toks, [eng.prefill_logits(p) for p in PROMPTS]


def _ranks(rank: int, world: int, dirs: list[str]) -> list:
    from adapt.runtime.distributed.generate import generate, open_distributed

    out = []
    for d in dirs:
        eng, ctx = open_distributed(d, timeout_s=60, kv_cache_memory="16MiB")
        res = generate(eng, ctx, PROMPTS, SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True))
        logits = [eng.prefill_logits(p) for p in PROMPTS]
        out.append(([r.token_ids for r in res] if res is not None else None, logits))
    return out


@pytest.mark.parametrize("world", sorted(LAYOUTS))
def test_layouts_match_one_rank(models, world):
    ckpts, outs = models
    layouts = LAYOUTS[world]
    got = spawn(_ranks, world, [str(outs[_name(m, d)]) for m, d in layouts])
    refs = {m: _reference(ckpts[m]) for m in {m for m, _ in layouts}}
    for li, (model, deg) in enumerate(layouts):
        toks, logits = refs[model]
        assert got[0][li][0] == toks, (model, deg)
        for rank in range(world):
            for a, b in zip(got[rank][li][1], logits):
                assert torch.allclose(a, b, atol=1e-4, rtol=0), (model, deg, rank, (a - b).abs().max().item())
