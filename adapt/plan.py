"""ParallelPlan: tensor / pipeline / expert / data parallel degrees plus the explicit rank map.

Rank order (tp fastest, then dp, then pp, so that a pipeline stage's tp x dp ranks are contiguous and
sit on as few nodes as possible)::

    rank = (pp_idx * dp + dp_idx) * tp + tp_idx

Expert parallelism spans the tp x dp ranks of a stage. With ``s = dp_idx * tp + tp_idx`` the stage-local
index, a rank's expert-parallel index is ``ep_idx = s % ep`` and it owns routed experts
``[ep_idx * E/ep, (ep_idx + 1) * E/ep)``. The ``m = tp*dp/ep`` ranks that share an ep_idx split each
of those experts further along its tp_dim by ``j = s // ep`` (m = 1: whole experts; ep = 1: classic
tensor-parallel MoE over the stage).

``tensor_slice`` is the single function that says which part of which tensor a rank holds; ``adapt shard``
writes by it and the runtime loads by it.
"""

from __future__ import annotations

import functools
from dataclasses import asdict, dataclass, field
from typing import Any, Iterable

from adapt.errors import PlanError
from adapt.layout import TensorSpec, WeightLayout
from adapt.spec import ModelSpec, ceil_div


def divide(total: int, parts: int, what: str) -> int:
    """total / parts, or a PlanError that shows the arithmetic."""
    if parts <= 0:
        raise PlanError(f"{what}: degree must be positive, got {parts}")
    if total % parts:
        raise PlanError(f"{what}: {total} is not divisible by {parts} ({total} = {total // parts} x {parts} + "
                        f"{total % parts})")
    return total // parts


@dataclass(frozen=True)
class RankInfo:
    """One global rank of the plan."""

    rank: int
    node: int
    local_rank: int
    tp: int
    pp: int
    dp: int
    ep: int
    layers: tuple[int, int]  # [start, stop) of the decoder layers of its stage
    experts: tuple[int, ...] = ()  # routed expert ids it holds (whole or split by moe_tp)


@dataclass(frozen=True)
class TensorSlice:
    """The part of a tensor a rank holds: the whole tensor (dim None) or [start, stop) along dim."""

    name: str
    dim: int | None = None
    start: int = 0
    stop: int = 0

    @property
    def whole(self) -> bool:
        return self.dim is None

    def shape(self, full: tuple[int, ...]) -> tuple[int, ...]:
        if self.dim is None:
            return full
        s = list(full)
        s[self.dim] = self.stop - self.start
        return tuple(s)


@dataclass(frozen=True)
class ParallelPlan:
    """Degrees and rank map. Build with :meth:`build` (checks every split) or :meth:`from_dict`."""

    tp: int
    pp: int
    ep: int
    dp: int
    devices_per_node: int
    layer_ranges: tuple[tuple[int, int], ...]
    num_experts: int = 0
    ranks: tuple[RankInfo, ...] = field(default=(), repr=False)
    model: str = ""

    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.dp

    @property
    def nodes(self) -> int:
        return ceil_div(self.world_size, self.devices_per_node)

    @property
    def moe_tp(self) -> int:
        """How many ranks split each routed expert (ranks of a stage sharing an ep index)."""
        return self.tp * self.dp // self.ep

    def rank_info(self, rank: int) -> RankInfo:
        return self.ranks[rank]

    def label(self) -> str:
        return f"tp{self.tp}.pp{self.pp}.ep{self.ep}.dp{self.dp}"

    @classmethod
    def build(cls, spec: ModelSpec, tp: int = 1, pp: int = 1, ep: int = 1, dp: int = 1,
              devices_per_node: int | None = None, layer_ranges: Iterable[Iterable[int]] | None = None,
              model: str = "") -> "ParallelPlan":
        """A plan for ``spec``; raises PlanError naming the first rule that fails, with the arithmetic."""
        check_divisibility(spec, tp, pp, ep, dp)
        world = tp * pp * dp
        dpn = devices_per_node or world
        ranges = tuple(tuple(int(x) for x in r) for r in layer_ranges) if layer_ranges else balanced_stages(spec, pp)
        _check_ranges(ranges, spec.num_layers, pp)
        n_exp = spec.moe.num_experts if spec.moe else 0
        ranks = []
        for pp_i in range(pp):
            for dp_i in range(dp):
                for tp_i in range(tp):
                    r = (pp_i * dp + dp_i) * tp + tp_i
                    s = dp_i * tp + tp_i
                    ep_i = s % ep
                    per = n_exp // ep if n_exp else 0
                    ranks.append(RankInfo(r, r // dpn, r % dpn, tp_i, pp_i, dp_i, ep_i, ranges[pp_i],
                                          tuple(range(ep_i * per, (ep_i + 1) * per))))
        return cls(tp, pp, ep, dp, dpn, ranges, n_exp, tuple(ranks), model)

    def to_dict(self) -> dict[str, Any]:
        return {
            "adapt_plan": 1,
            "model": self.model,
            "degrees": {"tp": self.tp, "pp": self.pp, "ep": self.ep, "dp": self.dp},
            "world_size": self.world_size,
            "devices_per_node": self.devices_per_node,
            "nodes": self.nodes,
            "num_experts": self.num_experts,
            "layer_ranges": [list(r) for r in self.layer_ranges],
            "ranks": [dict(asdict(r), layers=list(r.layers), experts=list(r.experts)) for r in self.ranks],
        }

    @classmethod
    def from_dict(cls, d: Any, spec: ModelSpec | None = None, source: str = "plan") -> "ParallelPlan":
        """Parse and check a plan dict (from plan.yaml); every error names the field."""
        from adapt.plan_file import plan_from_dict

        return plan_from_dict(d, spec, source)


def check_divisibility(spec: ModelSpec, tp: int, pp: int, ep: int, dp: int) -> None:
    """Every split the degrees imply, checked with the arithmetic in the message."""
    a = spec.attention
    for name, v in (("tp", tp), ("pp", pp), ("ep", ep), ("dp", dp)):
        if not isinstance(v, int) or v < 1:
            raise PlanError(f"{name} must be a positive integer, got {v!r}")
    divide(a.num_heads, tp, "attention heads over tp")
    if a.kind == "gqa":
        if tp > a.num_kv_heads:
            divide(tp, a.num_kv_heads, "tp over KV heads (replicated when tp exceeds them)")
        else:
            divide(a.num_kv_heads, tp, "KV heads over tp")
    divide(spec.vocab_size, tp, "vocabulary over tp")
    if any(k == "dense" for k in spec.layer_kinds):
        divide(spec.intermediate_size, tp, "dense MLP intermediate size over tp")
    if pp > spec.num_layers:
        raise PlanError(f"layers over pp: {spec.num_layers} layers cannot fill {pp} stages")
    m = spec.moe
    if m is None:
        if ep != 1:
            raise PlanError(f"ep={ep} but the model has no experts")
        return
    if ep > 1 and (tp * dp) % ep:
        raise PlanError(
            f"--ep {ep} splits the experts over the tp x dp ranks of a pipeline stage, and this layout has "
            f"tp x dp = {tp} x {dp} = {tp * dp} of them, not a multiple of {ep}; for {ep}-way expert parallelism "
            f"use --tp {ep} --ep {ep} (vLLM's TP + expert parallel) or --dp {ep} --ep {ep} "
            f"(SGLang's DP-attention + EP)")
    divide(m.num_experts, ep, "routed experts over ep")
    divide(m.intermediate_size, tp * dp // ep, "expert intermediate size over the ranks sharing an expert")
    if m.shared_intermediate_size:
        divide(m.shared_intermediate_size, tp, "shared expert intermediate size over tp")


@functools.lru_cache(maxsize=16)
def layout_of(spec: ModelSpec) -> WeightLayout:
    """The WeightLayout of a spec, built once per spec (a Kimi-K2 layout has 140k rows)."""
    return WeightLayout.from_spec(spec)


@functools.lru_cache(maxsize=16)
def layer_costs(spec: ModelSpec) -> tuple[int, ...]:
    """Weights (elements) per decoder layer, the cost ``balanced_stages`` balances."""
    cost = [0] * spec.num_layers
    for t in layout_of(spec):
        if t.layer is not None and t.layer < spec.num_layers and t.is_param:
            cost[t.layer] += t.numel
    return tuple(cost)


def balanced_stages(spec: ModelSpec, pp: int) -> tuple[tuple[int, int], ...]:
    """Contiguous layer ranges, balanced by weight bytes per layer (MoE layers weigh more)."""
    if pp > spec.num_layers:
        raise PlanError(f"layers over pp: {spec.num_layers} layers cannot fill {pp} stages")
    cost = layer_costs(spec)
    # embedding / lm_head weigh on the first / last stage
    edge = spec.vocab_size * spec.hidden_size
    total = sum(cost) + edge * (1 if spec.tie_word_embeddings else 2)
    target = total / pp
    ranges, start, acc = [], 0, edge
    for i, c in enumerate(cost):
        left_layers = spec.num_layers - i
        left_stages = pp - len(ranges)
        if len(ranges) < pp - 1 and i > start and (acc + c / 2 > target or left_layers == left_stages - 1):
            ranges.append((start, i))
            start, acc = i, 0
        acc += c
    ranges.append((start, spec.num_layers))
    while len(ranges) < pp:  # degenerate case: split the largest range
        j = max(range(len(ranges)), key=lambda k: ranges[k][1] - ranges[k][0])
        a, b = ranges[j]
        ranges[j:j + 1] = [(a, (a + b) // 2), ((a + b) // 2, b)]
    return tuple(ranges)


def _check_ranges(ranges, num_layers: int, pp: int) -> None:
    if len(ranges) != pp:
        raise PlanError(f"'layer_ranges' has {len(ranges)} stages but pp = {pp}")
    pos = 0
    for i, r in enumerate(ranges):
        if len(r) != 2:
            raise PlanError(f"'layer_ranges[{i}]' must be [start, stop]")
        a, b = r
        if a != pos:
            kind = "gap" if a > pos else "overlap"
            raise PlanError(f"'layer_ranges[{i}]' starts at {a}: {kind} after layer {pos - 1}")
        if b <= a:
            raise PlanError(f"'layer_ranges[{i}]' is empty ([{a}, {b}))")
        pos = b
    if pos != num_layers:
        raise PlanError(f"'layer_ranges' cover layers [0, {pos}) but the model has {num_layers}")


def stage_holds(t: TensorSpec, info: RankInfo, plan: ParallelPlan, spec: ModelSpec) -> bool:
    """Whether the rank's pipeline stage holds tensor t at all."""
    first, last = info.pp == 0, info.pp == plan.pp - 1
    if t.layer is not None:
        if t.mtp:
            return last
        return info.layers[0] <= t.layer < info.layers[1]
    if t.role == "embed":
        return first or (last and spec.tie_word_embeddings)
    if t.role in ("vision", "projector"):
        return first
    return last  # final norm, lm_head


def tensor_slice(t: TensorSpec, plan: ParallelPlan, rank: int, spec: ModelSpec) -> TensorSlice | None:
    """The part of tensor t that ``rank`` holds, or None. The one place where splitting is decided."""
    info = plan.ranks[rank]
    if not stage_holds(t, info, plan, spec):
        return None
    if t.split == "replicated" or t.tp_dim is None:
        if t.split == "expert" and t.expert not in info.experts:
            return None
        return TensorSlice(t.name)
    if t.split == "expert":
        if t.expert not in info.experts:
            return None
        m = plan.moe_tp
        j = (info.dp * plan.tp + info.tp) // plan.ep
        return _even(t, m, j)
    tp, idx = plan.tp, info.tp
    if t.head_size and t.role.startswith(("attn_k", "attn_v")) and spec.attention.kind == "gqa":
        kv = spec.attention.num_kv_heads
        if tp > kv:  # replicate: tp/kv ranks share one KV head
            head = idx // (tp // kv)
            size = t.head_size
            return TensorSlice(t.name, t.tp_dim, head * size, (head + 1) * size)
    return _even(t, tp, idx)


def _even(t: TensorSpec, parts: int, idx: int) -> TensorSlice:
    if parts == 1:
        return TensorSlice(t.name)
    n = t.shape[t.tp_dim]
    size = divide(n, parts, f"{t.name} dim {t.tp_dim}")
    return TensorSlice(t.name, t.tp_dim, idx * size, (idx + 1) * size)


def rank_tensors(layout: WeightLayout, plan: ParallelPlan, rank: int) -> list[tuple[TensorSpec, TensorSlice]]:
    """Every (tensor, slice) that rank holds, in layout order. FP8 scale tensors are sliced by the caller
    in block units (see ``scale_slice``)."""
    out = []
    for t in layout:
        if t.scale_of is not None:
            continue
        s = tensor_slice(t, plan, rank, layout.spec)
        if s is not None:
            out.append((t, s))
    return out


def scale_slice(weight_slice: TensorSlice, scale: TensorSpec, block: tuple[int, int]) -> TensorSlice:
    """The FP8 block-scale slice covering a weight slice; the weight slice must be block aligned."""
    if weight_slice.whole:
        return TensorSlice(scale.name)
    b = block[weight_slice.dim]
    if weight_slice.start % b:
        raise PlanError(f"{weight_slice.name}: slice [{weight_slice.start}, {weight_slice.stop}) on dim "
                        f"{weight_slice.dim} is not aligned to the {b}-wide FP8 scale blocks "
                        f"({weight_slice.start} % {b} = {weight_slice.start % b}); "
                        "dequantize (--dtype bf16) or choose a smaller degree")
    return TensorSlice(scale.name, weight_slice.dim, weight_slice.start // b, ceil_div(weight_slice.stop, b))


def stored_slice_of(t: TensorSpec, weight: TensorSpec, weight_slice: TensorSlice, spec: ModelSpec) -> TensorSlice:
    """The slice, in the file's own coordinates, of stored tensor t (a quantized weight ``weight`` itself or one of
    its companions) that a rank holding ``weight_slice`` of the weight's logical [N, K] holds.

    fp8 block scales: ``scale_slice``. compressed-tensors: the weight's rows or columns (int4 columns eight to an
    int32 word), its group-scale columns (one per group), per-channel scales' rows (whole where K splits), packed
    zero-point rows (eight to a word), ``weight_shape`` whole (``adapt shard`` rewrites its value). A slice that
    would cut a block, a group or a packed word is a PlanError naming the tensor and the arithmetic."""
    q = spec.quant
    if weight_slice.whole:
        return TensorSlice(t.name)
    if q is None or q.method == "fp8":
        return scale_slice(weight_slice, t, q.block_size) if t.scale_of else TensorSlice(
            t.name, weight_slice.dim, weight_slice.start, weight_slice.stop)
    d, a, b = weight_slice.dim, weight_slice.start, weight_slice.stop
    where = f"{weight.name}: slice [{a}, {b}) on dim {d}"
    if t.name.endswith("weight_shape") or (t.scale_of and t.tp_dim is None):
        return TensorSlice(t.name)
    if d == 1 and q.group_size and (a % q.group_size or b % q.group_size):
        off = a % q.group_size or b % q.group_size
        raise PlanError(f"{where} cuts a group of {q.group_size} columns ({a if a % q.group_size else b} % "
                        f"{q.group_size} = {off}); choose a tp degree that splits K on group edges")
    if t.scale_of and d == 1:  # group scales: one column per group
        return TensorSlice(t.name, 1, a // q.group_size, b // q.group_size)
    if t.packed_dim == d:  # eight int4 values to an int32 along d
        if a % 8 or (b % 8 and b != t.shape[d]):
            raise PlanError(f"{where} cuts an int32 word of eight int4 values ({a if a % 8 else b} % 8 = "
                            f"{a % 8 or b % 8}) of {t.name}; choose a tp degree that splits on multiples of 8")
        return TensorSlice(t.name, d, a // 8, ceil_div(b, 8))
    return TensorSlice(t.name, d, a, b)


@dataclass(frozen=True)
class CoverageReport:
    """What ``coverage`` found: every tensor tiled exactly once per replica."""

    tensors: int  # weight tensors of the layout (FP8 scale tensors excluded; they follow their weight)
    numel: int  # elements of one replica: the sum of the distinct shards, equal to the model's
    slices: int  # (rank, tensor) pairs the plan assigns
    replicas: dict[str, int] = field(default_factory=dict)  # split kind -> copies of each element (min..max)


def coverage(layout: WeightLayout, plan: ParallelPlan) -> CoverageReport:
    """Check that the plan's rank map covers every tensor of the layout exactly once per replica.

    For each weight tensor, the slices ``rank_tensors`` assigns (over all ranks) must be either all whole or
    all along one dim; the distinct intervals must tile the dim with no gap or overlap, and each must occur
    the same number of times (the replica count). The sum of one replica's shards is then the tensor.
    ``adapt shard`` verify and the planner's tests both call this. Raises PlanError naming the tensor.
    """
    held: dict[str, list[TensorSlice]] = {}
    n_slices = 0
    for r in range(plan.world_size):
        for t, s in rank_tensors(layout, plan, r):
            held.setdefault(t.name, []).append(s)
            n_slices += 1
    numel, tensors, reps = 0, 0, {}
    per_stage = plan.tp * plan.dp
    for t in layout:
        if t.scale_of is not None:
            continue
        tensors += 1
        slices = held.get(t.name)
        if not slices:
            raise PlanError(f"coverage: tensor {t.name} is held by no rank of {plan.label()}")
        dims = {s.dim for s in slices}
        if len(dims) != 1:
            raise PlanError(f"coverage: tensor {t.name} is held whole by some ranks and sliced by others")
        dim = dims.pop()
        if dim is None:
            k = len(slices)
        else:
            count: dict[tuple[int, int], int] = {}
            for s in slices:
                count[(s.start, s.stop)] = count.get((s.start, s.stop), 0) + 1
            pos = 0
            for a, b in sorted(count):
                if a != pos:
                    kind = "gap" if a > pos else "overlap"
                    raise PlanError(f"coverage: tensor {t.name} dim {dim}: {kind} at [{min(a, pos)}, {max(a, pos)})")
                pos = b
            if pos != t.shape[dim]:
                raise PlanError(f"coverage: tensor {t.name} dim {dim}: covered up to {pos} of {t.shape[dim]}")
            ks = set(count.values())
            if len(ks) != 1:
                raise PlanError(f"coverage: tensor {t.name}: shards held an unequal number of times {sorted(ks)}")
            k = ks.pop()
        pieces = 1 if dim is None else len(count)
        stages = sum(1 for st in range(plan.pp) if stage_holds(t, plan.ranks[st * per_stage], plan, layout.spec))
        want = stages * (plan.moe_tp if t.split == "expert" else per_stage)
        if k * pieces != want:
            raise PlanError(f"coverage: tensor {t.name} is held by {k * pieces} ranks; {plan.label()} puts it on "
                            f"{want} ({stages} stage(s) x {want // max(stages, 1)} ranks)")
        lo, hi = reps.get(t.split, (k, k))
        reps[t.split] = (min(lo, k), max(hi, k))
        numel += t.numel
    return CoverageReport(tensors, numel, n_slices, {k: v[0] if v[0] == v[1] else v for k, v in reps.items()})
