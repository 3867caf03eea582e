"""Every plan the planner emits covers every tensor of the layout exactly once per replica.

``adapt.plan.coverage`` is the same function ``adapt shard`` runs before writing and in its verify."""

import dataclasses

import pytest

from adapt.errors import PlanError
from adapt.plan import ParallelPlan, coverage, layout_of
from adapt.profile.planner import Workload, make_cluster, search
from tests.plan.conftest import CONFIG_NAMES


@pytest.mark.parametrize("stem", CONFIG_NAMES)
def test_emitted_plans_cover_the_model(stem, spec_of):
    spec = spec_of(stem)
    layout = layout_of(spec)
    total = layout.params.total + layout.params.mtp
    res = search(spec, make_cluster("h200", max_nodes=4), Workload(context=8192), model=stem)
    assert res.recommended is not None
    picks = {res.recommended.label: res.recommended}
    for want in (lambda c: c.pp > 1, lambda c: c.dp > 1 and c.ep > 1, lambda c: c.tp > 1 and c.dp > 1):
        c = next((c for c in res.candidates if want(c)), None)
        if c is not None:
            picks.setdefault(c.label, c)
    for c in picks.values():
        plan = res.plan(c)
        rep = coverage(layout, plan)
        assert rep.numel == total, c.label
        assert rep.tensors == sum(1 for t in layout if t.scale_of is None)


def test_coverage_catches_a_missing_and_a_doubled_shard(spec_of):
    spec = spec_of("mistralai__Mixtral-8x7B-v0.1")
    layout = layout_of(spec)
    plan = ParallelPlan.build(spec, tp=2, ep=2, dp=2, devices_per_node=8)
    coverage(layout, plan)
    ranks = list(plan.ranks)
    ranks[1] = dataclasses.replace(ranks[1], experts=ranks[0].experts)  # rank 1 holds rank 0's experts
    bad = dataclasses.replace(plan, ranks=tuple(ranks))
    with pytest.raises(PlanError, match="coverage: tensor .*experts"):
        coverage(layout, bad)
    ranks = list(plan.ranks)
    ranks[0] = dataclasses.replace(ranks[0], layers=(0, 31))  # the stage misses layer 31 on rank 0
    with pytest.raises(PlanError, match="coverage"):
        coverage(layout, dataclasses.replace(plan, ranks=tuple(ranks)))


def test_shard_uses_the_same_coverage():
    from pathlib import Path

    import adapt

    # read, not imported: importing shard pulls in huggingface_hub, whose env is read at import time
    src = (Path(adapt.__file__).parent / "shard" / "run.py").read_text()
    assert "coverage(layout, plan)" in src


def test_coverage_catches_a_missing_replica(spec_of):
    spec = spec_of("meta-llama__Llama-3.1-8B")
    plan = ParallelPlan.build(spec, tp=2, pp=2, dp=2, devices_per_node=8)
    ranks = list(plan.ranks)
    ranks[5] = dataclasses.replace(ranks[5], layers=(0, 16))  # a stage-1 rank claims stage 0's layers
    with pytest.raises(PlanError, match="coverage: tensor"):
        coverage(layout_of(spec), dataclasses.replace(plan, ranks=tuple(ranks)))
