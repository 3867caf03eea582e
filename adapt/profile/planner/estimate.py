"""Per-device memory and the time model of one layout.

Memory per device (the worst stage; every rank of a stage holds the same):
    weights     per-rank shards from the layout (``weights.py``)
    kv          ceil(concurrency / dp) sequences x context x layers of the stage x KV bytes/token/layer / split
                (split: GQA min(tp, kv_heads); MLA 1 -- the latent is not split by tp, so only dp divides it)
    activations peak of one chunked-prefill forward, min(context, prefill_chunk) tokens (``costs.py``)
    usable      device memory x memory_utilization (the rest is the reserve)

Time per stage and step, roofline per device: ``t = max(FLOPs / peak, bytes / memory_bandwidth) + comm``
    FLOPs  2 x non-expert params per rank x tokens + 2 x expert params per rank x stage tokens x top_k / E
           + attention core (``costs.attention_flops``)
    bytes  non-expert weights (the input embedding is read sparsely: not counted) + routed-expert weights x
           the fraction of experts touched, 1 - (1 - top_k/E)^stage_tokens (uniform routing) + KV read
    comm   ``comm.stage_collectives`` (not overlapped with compute)
Decode: the dp ranks of a stage step together, b = ceil(C / dp) tokens each; with pp the b sequences form
    m = min(pp, b) microbatches (vLLM's virtual engines) of ceil(b / m):
    TPOT = t_stage (pp = 1);  TPOT = pp x (max_s t_s + t_p2p) (pp > 1: a token visits every stage once per
    cycle of pp ticks);  tokens/s = C / TPOT.
TTFT: one request's prompt of ``context`` tokens through the stages in turn (the pipeline bubble: the other
    stages idle), TTFT = sum_s t_s(prefill) + (pp - 1) t_p2p.
"""

from __future__ import annotations

from dataclasses import dataclass

from adapt.profile.planner import costs
from adapt.profile.planner.cluster import Cluster, Workload
from adapt.profile.planner.comm import comm_time, stage_collectives
from adapt.profile.planner.weights import FP8, per_layer, stage_weights
from adapt.spec import ModelSpec

GB = 1e9


@dataclass(frozen=True)
class Memory:
    """Per-device bytes of the worst stage."""

    weights: float
    kv: float
    activations: float
    stage: int

    @property
    def total(self) -> float:
        return self.weights + self.kv + self.activations


@dataclass(frozen=True)
class Times:
    ttft_s: float
    tpot_s: float
    tokens_per_s: float
    comm_decode_s: float  # communication share of one decode tick (worst stage)


def memory(spec: ModelSpec, tp: int, ep: int, dp: int, ranges, work: Workload, places=None) -> Memory:
    """Per-device memory of the layout; see the module docstring."""
    places = places or per_layer(spec, tp, ep, dp, work.weights_dtype)
    kv_tok = costs.kv_bytes_per_token_layer(spec, work.kv_dtype) / costs.kv_split(spec, tp)
    seqs = -(-work.concurrency // dp)
    act = costs.activation_peak_bytes(spec, min(work.context, work.prefill_chunk), tp, work.act_dtype)
    worst = None
    pp = len(ranges)
    for s, r in enumerate(ranges):
        w = stage_weights(spec, places, r, s == 0, s == pp - 1, work.include_mtp)
        kv = seqs * costs.kv_tokens(spec, work.context) * (r[1] - r[0]) * kv_tok
        m = Memory(w.bytes, kv, act, s)
        if worst is None or m.total > worst.total:
            worst = m
    return worst


def _stage_time(spec: ModelSpec, w, r, tp: int, dp: int, tokens: int, stage_tokens: int, context: int,
                prefill: bool, peak: float, cluster: Cluster, kv_tok: float) -> float:
    n = r[1] - r[0]
    flops = 2 * w.params * tokens + n * costs.attention_flops(spec, tokens, context, tp, prefill)
    expert_read = 0.0
    if spec.moe and w.expert_bytes:
        e, k = spec.moe.num_experts, spec.moe.top_k
        flops += 2 * w.expert_params * stage_tokens * k / e
        expert_read = w.expert_bytes * (1 - (1 - k / e) ** stage_tokens)
    kv = n * kv_tok * (costs.kv_tokens(spec, context) * tokens if not prefill else tokens)
    read = w.bytes - w.embed_bytes - w.expert_bytes + expert_read + kv
    return max(flops / peak, read / cluster.hardware.memory_bandwidth)


def times(spec: ModelSpec, tp: int, pp: int, ep: int, dp: int, ranges, work: Workload, cluster: Cluster,
          places=None) -> Times:
    """TTFT, TPOT and output tokens/s of the layout; see the module docstring for the formulas."""
    places = places or per_layer(spec, tp, ep, dp, work.weights_dtype)
    hw = cluster.hardware
    peak = hw.peak_flops(FP8 if (work.weights_dtype or spec.weight_dtype) == FP8 else "bfloat16")
    kv_tok = costs.kv_bytes_per_token_layer(spec, work.kv_dtype) / costs.kv_split(spec, tp)
    dpn = cluster.devices_per_node
    b = -(-work.concurrency // dp)
    m = max(1, min(pp, b))
    b_mb = -(-b // m)
    L = work.context
    ttft, ticks, comm_worst, p2p_dec, p2p_pre = 0.0, [], 0.0, 0.0, 0.0
    for s, r in enumerate(ranges):
        w = stage_weights(spec, places, r, s == 0, s == pp - 1, work.include_mtp)
        c_dec = stage_collectives(spec, tp, pp, ep, dp, dpn, s, r, b_mb, work.act_dtype)
        c_pre = stage_collectives(spec, tp, pp, ep, dp, dpn, s, r, L, work.act_dtype)
        send_dec = [c for c in c_dec if c.kind == "pp_send"]
        send_pre = [c for c in c_pre if c.kind == "pp_send"]
        comm_dec = comm_time([c for c in c_dec if c.kind != "pp_send"], cluster)
        comm_pre = comm_time([c for c in c_pre if c.kind != "pp_send"], cluster)
        p2p_dec = max(p2p_dec, comm_time(send_dec, cluster))
        p2p_pre += comm_time(send_pre, cluster)
        t_dec = _stage_time(spec, w, r, tp, dp, b_mb, b_mb * dp, L, False, peak, cluster, kv_tok) + comm_dec
        t_pre = _stage_time(spec, w, r, tp, dp, L, L, L, True, peak, cluster, kv_tok) + comm_pre
        ticks.append(t_dec)
        comm_worst = max(comm_worst, comm_dec)
        ttft += t_pre
    ttft += p2p_pre
    tpot = ticks[0] if pp == 1 else pp * (max(ticks) + p2p_dec)
    return Times(ttft, tpot, work.concurrency / tpot, comm_worst)


def fmt_gb(x: float) -> str:
    return f"{x / GB:.1f} GB"


def memory_reason(mem: Memory, usable: float, util: float) -> str:
    """The arithmetic of a memory rejection, naming the term that dominates."""
    terms = {"weights": mem.weights, "kv": mem.kv, "activations": mem.activations}
    big = max(terms, key=terms.get)
    stage = f" (stage {mem.stage})" if mem.stage else ""
    return (f"memory: needs {fmt_gb(mem.total)} per device{stage} > {fmt_gb(usable)} usable "
            f"({util:.0%} of {fmt_gb(usable / util)}): weights {fmt_gb(mem.weights)} + kv {fmt_gb(mem.kv)} + "
            f"activations {fmt_gb(mem.activations)}; largest term: {big}")

