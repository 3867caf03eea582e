"""Every layout of the acceptance list gives one rank's greedy tokens and logits (float32, gloo, tiny models).

Layouts of the same world size share one launch of forked ranks (process start-up dominates on 2 cores).
dp replicas with MoE layers (data-parallel attention, the stage's experts shared) also run ragged
termination (per-prompt max_tokens) and a replica with no prompt (lockstep idle steps), and their
collective bytes are compared on a larger batch: with 3 prompts the all-to-all of a tp1 layout is the
whole traffic and its routing noise alone is ~15% (tiny-k2 dp2.ep2: 1.22 at 3 prompts, 0.93 at 16).
"""

from __future__ import annotations

import pytest
import torch

from adapt.runtime.sampling import SamplingParams

from .harness import spawn

PROMPTS = [[1, 5, 9, 33, 70, 11], [1, 7], [1, 300, 4]]  # ragged
MAX_TOKENS = 4
RAGGED = (6, 2, 3)  # max_tokens per prompt: the replicas finish at different steps
BIG = [[1, 3 + (7 * i) % 400, 5 + (13 * i) % 300][: 2 + i % 2] for i in range(16)]  # bytes check of dp x ep
BIG_TOKENS = 8
LAYOUTS = {  # world size -> (model, degrees)
    2: [("tiny-llama", dict(tp=2)), ("tiny-llama", dict(pp=2)), ("tiny-qwen3-moe", dict(tp=2, ep=2)),
        ("tiny-k2", dict(tp=2, ep=2)), ("tiny-k2", dict(pp=2)), ("tiny-qwen3-moe", dict(tp=2)),
        ("tiny-qwen3-moe", dict(dp=2, ep=2)), ("tiny-k2", dict(dp=2, ep=2))],
    4: [("tiny-llama", dict(tp=4)), ("tiny-qwen3-moe", dict(tp=4, ep=4)), ("tiny-k2", dict(tp=4, ep=4)),
        ("tiny-llama", dict(tp=2, pp=2)), ("tiny-k2", dict(tp=2, pp=2, ep=2)), ("tiny-qwen3-moe", dict(tp=4, ep=2)),
        ("tiny-qwen3-moe", dict(tp=2, dp=2, ep=4)), ("tiny-k2", dict(tp=2, dp=2, ep=4)), ("tiny-k2", dict(pp=2, dp=2, ep=2))],
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


_CONFIG = {}


@pytest.fixture(autouse=True)
def _keep_config(request):
    _CONFIG["c"] = request.config


def _config():
    return _CONFIG["c"]


def _greedy(n):
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)


def _extra_runs():
    """(prompts, params) of the dp x MoE lockstep cases: ragged termination, a replica with no prompt."""
    return [(PROMPTS, [_greedy(n) for n in RAGGED]), (PROMPTS[:1], _greedy(3))]


def _reference(ckpt):
    from adapt.runtime.engine import Engine

    eng = Engine.from_pretrained(ckpt, kv_cache_memory="16MiB")
    toks = [r.token_ids for r in eng.generate(PROMPTS, _greedy(MAX_TOKENS))]
    extra = [[r.token_ids for r in eng.generate(p, sp)] for p, sp in _extra_runs()]
    return toks, [eng.prefill_logits(p) for p in PROMPTS], extra


def _ranks(rank: int, world: int, dirs: list[str]) -> list:
    from adapt.runtime.distributed.generate import generate, open_distributed
    from adapt.runtime.distributed.stats import compare_with_planner

    out = []
    for d in dirs:
        eng, ctx = open_distributed(d, timeout_s=60, kv_cache_memory="16MiB")
        res = generate(eng, ctx, PROMPTS, _greedy(MAX_TOKENS))
        cmp = compare_with_planner(eng.spec, ctx.plan, ctx.rank, ctx.steps, "float32")
        extra = None
        if ctx.dp_size > 1 and eng.spec.moe is not None:
            extra = [generate(eng, ctx, p, sp) for p, sp in _extra_runs()]
            extra = [[r.token_ids for r in x] if x is not None else None for x in extra]
            n0 = len(ctx.steps)
            generate(eng, ctx, BIG, _greedy(BIG_TOKENS))
            cmp = compare_with_planner(eng.spec, ctx.plan, ctx.rank, ctx.steps[n0:], "float32")
        logits = [eng.prefill_logits(p) for p in PROMPTS]
        out.append(([r.token_ids for r in res] if res is not None else None, logits, cmp, extra))
    return out


@pytest.mark.parametrize("world", sorted(LAYOUTS))
def test_layouts_match_one_rank(models, world):
    ckpts, outs = models
    layouts = LAYOUTS[world]
    got = spawn(_ranks, world, [str(outs[_name(m, d)]) for m, d in layouts])
    if not hasattr(pytest_config := _config(), "cache_layouts"):
        pytest_config.cache_layouts = {}
    pytest_config.cache_layouts[world] = got
    refs = {m: _reference(ckpts[m]) for m in {m for m, _ in layouts}}
    for li, (model, deg) in enumerate(layouts):
        toks, logits, extra = refs[model]
        assert got[0][li][0] == toks, (model, deg)
        if got[0][li][3] is not None:  # dp x MoE: lockstep with ragged termination and an idle replica
            assert got[0][li][3] == extra, (model, deg)
        for rank in range(world):
            for a, b in zip(got[rank][li][1], logits):
                assert torch.allclose(a, b, atol=1e-4, rtol=0), (model, deg, rank, (a - b).abs().max().item())


@pytest.mark.parametrize("world", sorted(LAYOUTS))
def test_collective_bytes_match_planner(models, world, request):
    """Measured bytes per decode step within 10% of adapt.profile.planner's estimate, every rank and layout."""
    got = request.config.cache_layouts[world] if hasattr(request.config, "cache_layouts") else None
    assert got is not None, "runs after test_layouts_match_one_rank"
    for li, (model, deg) in enumerate(LAYOUTS[world]):
        meas = est = 0.0
        for rank in range(world):
            cmp = got[rank][li][2]
            assert cmp["decode_steps"] == (BIG_TOKENS if got[rank][li][3] is not None else MAX_TOKENS) - 1
            for kind in ("tp_allreduce", "tp_allgather", "pp_send"):  # exact: no routing involved
                r = cmp["ratio"][kind]
                assert r is not None and abs(r - 1) <= 0.10, (model, deg, rank, kind, cmp)
            meas += cmp["measured_per_step"]["total"]
            est += cmp["estimated_per_step"]["total"]
        # the all-to-all depends on routing; the planner assumes it uniform, so compare over the world
        a2a_m = sum(got[r][li][2]["measured_per_step"]["ep_alltoall"] for r in range(world))
        a2a_e = sum(got[r][li][2]["estimated_per_step"]["ep_alltoall"] for r in range(world))
        print(f"{model} {deg}: measured {meas:.0f} B/decode step over {world} ranks, estimated {est:.0f} "
              f"(ratio {meas / est:.3f}; all-to-all {a2a_m:.0f} vs {a2a_e:.0f})")
        assert abs(meas / est - 1) <= 0.10, (model, deg, meas, est)
