"""Collectives of one forward step per rank, and their cost: the one model of communication the planner's
time estimate and the runtime's observability check (``decode_collective_bytes``) both use.

Accounting convention: **bytes sent by one rank** (every rank of a stage sends the same in expectation),
per forward step, summed over the collectives of that rank's stage. ``S = tokens x hidden x act_bytes``.

- tp all-reduce (ring): each rank sends ``2 (n-1)/n x S`` per all-reduce, n = tp. Per decoder layer: one
  after attention (o_proj), one after the MLP (dense layers; MoE layers with ep > 1 for the shared expert /
  the tp ranks' token reassembly). First stage: one more after the vocab-parallel embedding. MoE layers with
  ep = 1 reduce the experts' output over the tp x dp ranks sharing each expert: ``2 (n-1)/n x S_stage``,
  n = tp x dp, S_stage over the tokens of all dp ranks of the stage.
- lm_head: vocab-parallel logits all-gathered over tp in act dtype: ``(n-1)/n x tokens x vocab x act_bytes``
  (last stage; counted in ``tp_allgather``).
- ep all-to-all (MoE layers, ep > 1): the tp ranks of a dp group split its tokens, ``t = tokens / tp`` each;
  each (token, expert) pair goes to the moe_tp ranks holding that expert's slices, of which
  ``moe_tp - 1/ep`` are remote in expectation under uniform routing. Dispatch sends
  ``t x top_k x (moe_tp - 1/ep) x hidden x act_bytes``; combine sends the same back: the field is their sum.
- pp send: every stage but the last sends its output activations ``S`` to the next stage once per step.

Time of a collective: ring all-reduce ``2(n-1)/n x S / bw + 2(n-1) x latency``; all-gather
``(n-1)/n x S / bw + (n-1) x latency``; all-to-all ``bytes / bw + latency`` per direction; p2p
``S / bw + latency``. ``bw`` and ``latency`` are the intra-node link's when the group sits on one node, else
the inter-node link's (the ring's slowest hop).
"""

from __future__ import annotations

from dataclasses import dataclass

from adapt.plan import ParallelPlan
from adapt.spec import ModelSpec, dtype_bytes


@dataclass(frozen=True)
class Collective:
    kind: str  # tp_allreduce | tp_allgather | ep_alltoall | pp_send
    group: int  # ranks taking part
    bytes: float  # sent by one rank per call
    count: int  # calls per step
    inter_node: bool

    def time(self, cluster) -> float:
        bw = cluster.inter_node_bandwidth if self.inter_node else cluster.intra_node_bandwidth
        lat = cluster.inter_node_latency_s if self.inter_node else cluster.intra_node_latency_s
        n = self.group
        steps = {"tp_allreduce": 2 * (n - 1), "tp_allgather": n - 1, "ep_alltoall": 2, "pp_send": 1}[self.kind]
        return self.count * (self.bytes / bw + steps * lat)


def _spans_nodes(first_rank: int, n: int, dpn: int) -> bool:
    return first_rank // dpn != (first_rank + n - 1) // dpn


def stage_collectives(spec: ModelSpec, tp: int, pp: int, ep: int, dp: int, dpn: int, stage: int,
                      layers: tuple[int, int], tokens: int, act_dtype: str = "bfloat16") -> list[Collective]:
    """The collectives one rank of ``stage`` runs in a forward of ``tokens`` tokens per dp rank."""
    ab = dtype_bytes(act_dtype)
    h = spec.hidden_size
    S = tokens * h * ab
    base = stage * tp * dp  # first rank of the stage
    kinds = spec.layer_kinds[layers[0]:layers[1]]
    n_moe = kinds.count("moe")
    n_layers = len(kinds)
    tp_inter = _spans_nodes(base, tp, dpn)
    out: list[Collective] = []
    if tp > 1:
        ring = 2 * (tp - 1) / tp * S
        calls = n_layers + (n_layers - n_moe) + (1 if stage == 0 else 0)  # attention + dense MLP + embedding
        if ep > 1:
            calls += n_moe
        if dp == 1 and ep == 1:
            calls += n_moe
        out.append(Collective("tp_allreduce", tp, ring, calls, tp_inter))
        if stage == pp - 1:
            out.append(Collective("tp_allgather", tp, (tp - 1) / tp * tokens * spec.vocab_size * ab, 1, tp_inter))
    if n_moe and ep == 1 and dp > 1:
        n = tp * dp
        out.append(Collective("tp_allreduce", n, 2 * (n - 1) / n * S * dp, n_moe, _spans_nodes(base, n, dpn)))
    if n_moe and ep > 1:
        m = spec.moe
        moe_tp = tp * dp // ep
        one_way = tokens / tp * m.top_k * (moe_tp - 1 / ep) * h * ab
        out.append(Collective("ep_alltoall", tp * dp, 2 * one_way, n_moe, _spans_nodes(base, tp * dp, dpn)))
    if stage < pp - 1:
        nxt = base + tp * dp
        out.append(Collective("pp_send", 2, S, 1, base // dpn != nxt // dpn))
    return out


def comm_time(colls: list[Collective], cluster) -> float:
    """Seconds of communication (not overlapped with compute: a conservative estimate)."""
    return sum(c.time(cluster) for c in colls)


@dataclass(frozen=True)
class CollectiveBytes:
    """Bytes one rank sends per decode step, by collective (see the module docstring)."""

    tp_allreduce: float
    tp_allgather: float
    ep_alltoall: float
    pp_send: float

    @property
    def total(self) -> float:
        return self.tp_allreduce + self.tp_allgather + self.ep_alltoall + self.pp_send

    def as_dict(self) -> dict[str, float]:
        return {"tp_allreduce": self.tp_allreduce, "tp_allgather": self.tp_allgather,
                "ep_alltoall": self.ep_alltoall, "pp_send": self.pp_send, "total": self.total}


def decode_collective_bytes(spec: ModelSpec, plan: ParallelPlan, batch: int, rank: int = 0,
                            act_dtype: str = "bfloat16") -> CollectiveBytes:
    """The planner's estimate of the bytes ``rank`` sends per decode step, per collective kind.

    ``batch`` is the number of sequences decoding together on the whole plan (one new token each); a dp
    rank holds ``ceil(batch / dp)`` of them. Convention: bytes sent from that one rank in one step, ring
    all-reduce ``2(n-1)/n x size``; see the module docstring for every term. No microbatching over pp.
    """
    info = plan.rank_info(rank)
    tokens = -(-batch // plan.dp)
    colls = stage_collectives(spec, plan.tp, plan.pp, plan.ep, plan.dp, plan.devices_per_node, info.pp,
                              info.layers, tokens, act_dtype)
    tot = {"tp_allreduce": 0.0, "tp_allgather": 0.0, "ep_alltoall": 0.0, "pp_send": 0.0}
    for c in colls:
        tot[c.kind] += c.bytes * c.count
    return CollectiveBytes(**tot)
