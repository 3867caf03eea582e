"""DistributedContext collectives on 4 forked gloo ranks, several plans in one launch."""

from __future__ import annotations

import datetime
import time

import pytest
import torch

from adapt.builtin import builtin_config
from adapt.errors import DistributedError
from adapt.plan import ParallelPlan
from adapt.runtime.distributed.context import PeerFailure, group_ranks, init_distributed
from adapt.spec import ModelSpec

from .harness import spawn

SPEC = ModelSpec.from_hf_config(builtin_config("tiny-qwen3-moe"), name="tiny-qwen3-moe")
LAYOUTS = [dict(tp=4), dict(tp=2, pp=2), dict(tp=2, dp=2, ep=4), dict(pp=2, dp=2, ep=2), dict(dp=4, ep=4)]


def test_group_ranks_follow_plan_order():
    plan = ParallelPlan.build(SPEC, tp=2, pp=2, dp=2, ep=2)
    g = group_ranks(plan)
    assert g["tp"] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert g["stage"] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert g["pp"] == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert g["dp"] == [[0, 2], [1, 3], [4, 6], [5, 7]]
    for kind, lists in g.items():  # every kind partitions the world
        assert sorted(r for rs in lists for r in rs) == list(range(8)), kind
    for r in plan.ranks:  # the coordinates agree with the plan's rank map
        assert g["tp"][r.pp * plan.dp + r.dp][r.tp] == r.rank
        assert g["pp"][r.dp * plan.tp + r.tp][r.pp] == r.rank


def _collectives(rank: int, world: int) -> list[dict]:
    import torch.distributed as dist

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=30))
    out = []
    for deg in LAYOUTS:
        plan = ParallelPlan.build(SPEC, **deg)
        ctx = init_distributed(plan, "cpu", timeout_s=30)
        res: dict = {"layout": deg}
        # all_reduce / all_gather over tp and stage
        for group in ("tp", "stage", "dp"):
            members = ctx.members[group]
            x = torch.full((3,), float(rank + 1))
            res[f"ar.{group}"] = ctx.all_reduce(x.clone(), group).tolist()
            res[f"ag.{group}"] = ctx.all_gather(torch.tensor([[float(rank)]]), dim=-1, group=group).tolist()
            res[f"members.{group}"] = members
        # all_to_all over the stage: row (src, dst, i) to each peer, ragged counts, some zero
        n = ctx.group_size("stage")
        counts = [(rank + j) % 3 for j in range(n)]
        rows = [[rank, j, i] for j in range(n) for i in range(counts[j])]
        x = torch.tensor(rows, dtype=torch.float32).reshape(-1, 3)
        got, recv_counts = ctx.all_to_all(x, counts, "stage")
        res["a2a"] = (got.tolist(), recv_counts, ctx.group_rank("stage"))
        # pipeline send/recv of a hidden state
        if ctx.pp_size > 1:
            if ctx.is_first_stage:
                ctx.send(torch.full((2, 4), float(rank)), 1)
            else:
                res["recv"] = ctx.recv((2, 4), torch.float32, 0)[0, 0].item()
        res["obj"] = ctx.broadcast_object({"rank": rank} if rank == 0 else None)
        res["bytes"] = dict(ctx.bytes_by_collective)
        ctx.barrier()
        out.append(res)
    return out


@pytest.fixture(scope="module")
def results():
    return spawn(_collectives, 4)


def test_collectives(results):
    for li, deg in enumerate(LAYOUTS):
        plan = ParallelPlan.build(SPEC, **deg)
        groups = group_ranks(plan)
        for rank in range(4):
            res = results[rank][li]
            for group in ("tp", "stage", "dp"):
                members = next(g for g in groups[group] if rank in g)
                assert res[f"members.{group}"] == members
                assert res[f"ar.{group}"] == [float(sum(m + 1 for m in members))] * 3
                assert res[f"ag.{group}"] == [[float(m) for m in members]]
            stage = next(g for g in groups["stage"] if rank in g)
            me = stage.index(rank)
            rows, recv_counts, idx = res["a2a"]
            assert idx == me
            want = [[src, me, i] for src in stage for i in range((src + me) % 3)]
            assert rows == want and recv_counts == [(src + me) % 3 for src in stage]
            assert res["obj"] == {"rank": 0}
            if plan.pp > 1 and plan.ranks[rank].pp == 1:
                assert res["recv"] == float(rank - plan.tp * plan.dp)


def test_byte_accounting(results):
    for li, deg in enumerate(LAYOUTS):
        plan = ParallelPlan.build(SPEC, **deg)
        for rank in range(4):
            b = results[rank][li]["bytes"]
            n_stage = plan.tp * plan.dp
            want = {}
            for group, size in (("tp", plan.tp), ("stage", n_stage), ("dp", plan.dp)):
                if size > 1:  # groups of one move nothing
                    want[f"all_reduce.{group}"] = round(2 * (size - 1) / size * 12)  # ring, as the planner
                    want[f"all_gather.{group}"] = (size - 1) * 4
            if n_stage > 1:
                me = plan.ranks[rank].dp * plan.tp + plan.ranks[rank].tp
                want["all_to_all.stage"] = sum((rank + j) % 3 for j in range(n_stage) if j != me) * 3 * 4
            if plan.pp > 1 and plan.ranks[rank].pp == 0:
                want["send.pp"] = 2 * 4 * 4
            assert b == want, (deg, rank)


def _timeout(rank: int, world: int) -> float:
    plan = ParallelPlan.build(SPEC, tp=2)
    ctx = init_distributed(plan, "cpu", timeout_s=2)
    ctx.all_reduce(torch.ones(1))
    if rank == 1:
        time.sleep(6)  # rank 1 misses the next collective
        return 0.0
    t = time.monotonic()
    try:
        ctx.all_reduce(torch.ones(1))
    except PeerFailure as e:
        assert "rank 0: all_reduce over tp group (ranks [0, 1])" in str(e)
        assert isinstance(e, DistributedError)
        return time.monotonic() - t
    return -1.0


def test_collective_timeout_is_bounded():
    elapsed = spawn(_timeout, 2)[0]
    assert 1.5 < elapsed < 5.0


def _wrong_world(rank: int, world: int) -> str:
    try:
        init_distributed(ParallelPlan.build(SPEC, tp=4), "cpu")
    except DistributedError as e:
        return str(e)
    return ""


def test_world_size_mismatch_is_clear():
    msgs = spawn(_wrong_world, 2)
    assert "started 2 ranks but the plan tp4.pp1.ep1.dp1 needs tp*pp*dp = 4*1*1 = 4" in msgs[0]
