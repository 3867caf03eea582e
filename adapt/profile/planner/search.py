"""Search tp x pp x ep x dp layouts for a cluster and a workload; rank what fits, say why the rest does not.

Every layout of every searched world size is tried: tp | W, pp | W/tp, dp = W/(tp pp), and for MoE models
ep | tp x dp (expert parallelism spans the tp x dp ranks of a stage; dp > 1 with tp = 1 is SGLang's
data-parallel attention). A layout is rejected by the first rule that fails, and the reason names it:
``divisibility: ...`` (``adapt.plan.check_divisibility``), ``fp8 block alignment: ...``, ``memory: ...``
(with the arithmetic and the largest term), ``slo: ...``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from adapt.errors import PlanError
from adapt.plan import ParallelPlan, balanced_stages, check_divisibility
from adapt.profile.planner.cluster import Cluster, Workload
from adapt.profile.planner.estimate import Memory, Times, memory, memory_reason, times
from adapt.profile.planner.weights import fp8_alignment, per_layer
from adapt.spec import ModelSpec, ceil_div


@dataclass(frozen=True)
class Candidate:
    """A layout that fits, with its estimates."""

    tp: int
    pp: int
    ep: int
    dp: int
    devices_per_node: int
    layer_ranges: tuple[tuple[int, int], ...]
    memory: Memory
    times: Times

    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.dp

    @property
    def nodes(self) -> int:
        return ceil_div(self.world_size, self.devices_per_node)

    @property
    def label(self) -> str:
        return f"tp{self.tp}.pp{self.pp}.ep{self.ep}.dp{self.dp}"

    def row(self) -> dict[str, Any]:
        """The JSON contract's fields, then the breakdown."""
        return {"tp": self.tp, "pp": self.pp, "ep": self.ep, "dp": self.dp, "world_size": self.world_size,
                "nodes": self.nodes, "memory_per_device_bytes": int(self.memory.total),
                "est_ttft_s": self.times.ttft_s, "est_tpot_s": self.times.tpot_s,
                "est_tokens_per_s": self.times.tokens_per_s, "layout": self.label,
                "memory_breakdown_bytes": {"weights": int(self.memory.weights), "kv": int(self.memory.kv),
                                           "activations": int(self.memory.activations),
                                           "worst_stage": self.memory.stage},
                "layer_ranges": [list(r) for r in self.layer_ranges]}


@dataclass(frozen=True)
class Rejection:
    layout: str
    rule: str  # divisibility | fp8 block alignment | memory | slo
    reason: str
    needs_bytes: float = 0.0  # memory rejections: bytes per device the layout needs

    def row(self) -> dict[str, str]:
        return {"layout": self.layout, "rule": self.rule, "reason": self.reason}


@dataclass
class PlanResult:
    model: str
    spec: ModelSpec
    cluster: Cluster
    workload: Workload
    candidates: list[Candidate] = field(default_factory=list)
    rejected: list[Rejection] = field(default_factory=list)

    @property
    def recommended(self) -> Candidate | None:
        return self.candidates[0] if self.candidates else None

    def plan(self, c: Candidate | None = None) -> ParallelPlan:
        """The ParallelPlan (with its rank map) of a candidate, by default the recommended one."""
        c = c or self.recommended
        if c is None:
            raise PlanError(self.summary())
        return ParallelPlan.build(self.spec, c.tp, c.pp, c.ep, c.dp, self.cluster.devices_per_node,
                                  c.layer_ranges, model=self.model)

    def summary(self) -> str:
        if self.recommended:
            r = self.recommended
            return f"recommended {r.label} on {r.world_size} devices ({r.nodes} node(s))"
        best = min((x for x in self.rejected if x.rule == "memory"), key=lambda x: x.needs_bytes, default=None)
        sizes = ", ".join(map(str, self.cluster.world_sizes()))
        why = f"; closest: {best.layout}: {best.reason}" if best else ""
        return f"no layout fits {self.model} on {sizes} x {self.cluster.hardware.name}{why}"

    def to_dict(self) -> dict[str, Any]:
        rec = self.recommended
        return {"model": self.model, "cluster": self.cluster.to_dict(), "workload": self.workload.to_dict(),
                "recommended": rec.row() if rec else None, "candidates": [c.row() for c in self.candidates],
                "rejected": [r.row() for r in self.rejected]}


def layouts(spec: ModelSpec, world: int):
    """Every (tp, pp, ep, dp) with tp x pp x dp = world (ep over the divisors of tp x dp for MoE)."""
    for tp in _divisors(world):
        for pp in _divisors(world // tp):
            dp = world // (tp * pp)
            for ep in (_divisors(tp * dp) if spec.moe else (1,)):
                yield tp, pp, ep, dp


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def evaluate(spec: ModelSpec, tp: int, pp: int, ep: int, dp: int, cluster: Cluster, work: Workload,
             ranges=None, _cache: dict | None = None) -> Candidate | Rejection:
    """One layout: a Candidate with estimates, or the Rejection naming the failed rule."""
    label = f"tp{tp}.pp{pp}.ep{ep}.dp{dp}"
    try:
        check_divisibility(spec, tp, pp, ep, dp)
    except PlanError as e:
        return Rejection(label, "divisibility", f"divisibility: {e}")
    try:
        fp8_alignment(spec, tp, ep, dp, work.weights_dtype)
    except PlanError as e:
        return Rejection(label, "fp8 block alignment", str(e))
    ranges = tuple(tuple(r) for r in ranges) if ranges else balanced_stages(spec, pp)
    key = (tp, ep, dp)
    places = _cache.get(key) if _cache is not None else None
    if places is None:
        places = per_layer(spec, tp, ep, dp, work.weights_dtype)
        if _cache is not None:
            _cache[key] = places
    mem = memory(spec, tp, ep, dp, ranges, work, places)
    if mem.total > cluster.usable_bytes:
        return Rejection(label, "memory", memory_reason(mem, cluster.usable_bytes, cluster.memory_utilization),
                         mem.total)
    t = times(spec, tp, pp, ep, dp, ranges, work, cluster, places)
    if work.max_ttft_s is not None and t.ttft_s > work.max_ttft_s:
        return Rejection(label, "slo", f"slo: est TTFT {t.ttft_s:.3g} s > --max-ttft-s {work.max_ttft_s:g}")
    if work.max_tpot_s is not None and t.tpot_s > work.max_tpot_s:
        return Rejection(label, "slo", f"slo: est TPOT {t.tpot_s:.3g} s > --max-tpot-s {work.max_tpot_s:g}")
    return Candidate(tp, pp, ep, dp, cluster.devices_per_node, ranges, mem, t)


def rank_key(c: Candidate, objective: str):
    """min-devices: fewest devices, then throughput; latency: lowest TPOT, then TTFT, then devices;
    throughput: most output tokens/s, then fewest devices."""
    if objective == "latency":
        return (c.times.tpot_s, c.times.ttft_s, c.world_size)
    if objective == "throughput":
        return (-c.times.tokens_per_s, c.world_size, c.times.tpot_s)
    return (c.world_size, -c.times.tokens_per_s, c.times.tpot_s)


def search(spec: ModelSpec, cluster: Cluster, work: Workload, model: str = "") -> PlanResult:
    """Try every layout of every world size of the cluster; candidates ranked by the workload's objective."""
    res = PlanResult(model or spec.name, spec, cluster, work)
    cache: dict = {}
    for world in cluster.world_sizes():
        for tp, pp, ep, dp in layouts(spec, world):
            r = evaluate(spec, tp, pp, ep, dp, cluster, work, _cache=cache)
            (res.candidates if isinstance(r, Candidate) else res.rejected).append(r)
    res.candidates.sort(key=lambda c: rank_key(c, work.objective))
    return res


def check_plan(spec: ModelSpec, plan: ParallelPlan, cluster: Cluster, work: Workload) -> Candidate | Rejection:
    """Estimates for a given (hand-written) plan, under its own layer ranges."""
    return evaluate(spec, plan.tp, plan.pp, plan.ep, plan.dp, cluster, work, plan.layer_ranges)
