"""decode_collective_bytes: the convention stated in adapt/profile/planner/comm.py, checked term by term."""

import pytest

from adapt.plan import ParallelPlan
from adapt.profile.planner import decode_collective_bytes, make_cluster, stage_collectives


def test_tp_allreduce_ring_bytes(spec_of):
    spec = spec_of("meta-llama__Llama-3.1-8B")
    plan = ParallelPlan.build(spec, tp=8, devices_per_node=8)
    b = decode_collective_bytes(spec, plan, batch=4)
    S = 4 * 4096 * 2
    assert b.tp_allreduce == pytest.approx((2 * 32 + 1) * 2 * 7 / 8 * S)  # attention + MLP per layer, embedding
    assert b.tp_allgather == pytest.approx(7 / 8 * 4 * spec.vocab_size * 2)
    assert b.ep_alltoall == 0 and b.pp_send == 0


def test_pp_send_only_before_the_last_stage(spec_of):
    spec = spec_of("meta-llama__Llama-3.1-8B")
    plan = ParallelPlan.build(spec, tp=1, pp=2, devices_per_node=8)
    assert decode_collective_bytes(spec, plan, batch=3, rank=0).pp_send == 3 * 4096 * 2
    assert decode_collective_bytes(spec, plan, batch=3, rank=1).pp_send == 0


def test_ep_alltoall_dispatch_and_combine(spec_of):
    spec = spec_of("deepseek-ai__DeepSeek-V3")
    plan = ParallelPlan.build(spec, tp=1, ep=8, dp=8, devices_per_node=8)
    b = decode_collective_bytes(spec, plan, batch=64)  # 8 tokens per dp rank
    per_way = 8 * 8 * (1 - 1 / 8) * 7168 * 2  # tokens x top_k x remote fraction x hidden x bf16
    assert b.ep_alltoall == pytest.approx(58 * 2 * per_way)
    assert b.tp_allreduce == 0
    # ep over part of the stage: experts split over moe_tp = 2 ranks, remote copies moe_tp - 1/ep
    plan = ParallelPlan.build(spec, tp=2, ep=4, dp=4, devices_per_node=8)
    b = decode_collective_bytes(spec, plan, batch=64)
    assert b.ep_alltoall == pytest.approx(58 * 2 * (16 / 2) * 8 * (2 - 1 / 4) * 7168 * 2)


def test_time_uses_the_inter_node_link_across_nodes(spec_of):
    spec = spec_of("meta-llama__Llama-3.1-405B")
    c = make_cluster("h100-sxm", nodes=2)
    intra = stage_collectives(spec, 8, 2, 1, 1, 8, 0, (0, 63), 1)
    inter = stage_collectives(spec, 16, 1, 1, 1, 8, 0, (0, 126), 1)
    assert not any(x.inter_node for x in intra if x.kind == "tp_allreduce")
    assert any(x.kind == "pp_send" and x.inter_node for x in intra)
    assert all(x.inter_node for x in inter)
    ar = next(x for x in inter if x.kind == "tp_allreduce")
    assert ar.time(c) == pytest.approx(ar.count * (ar.bytes / c.inter_node_bandwidth + 30 * c.inter_node_latency_s))
