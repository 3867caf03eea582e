"""Per-device weight bytes in closed form, derived from the WeightLayout grouped by (place, split, shape).

``rank_tensors`` over a Kimi-K2 layout (140k tensors) for every rank of every candidate layout is too slow
for a search, so the layout is grouped once: tensors that sit in the same place (a decoder layer of one
kind, the first stage, the last stage) and split the same way with the same shape cost the same on every
rank. A rank's bytes are then sum(count_held x cost(slice shape)) per group, where the slice shape comes
from the same rules as ``adapt.plan.tensor_slice``. ``tests/plan/test_weights.py`` checks that this equals
the sum over ``rank_tensors`` on the tiny models, rank by rank.

Cost of one tensor slice (the convention of ``WeightLayout.weight_bytes``): with no ``weights_dtype`` the
checkpoint's own dtype plus its FP8 block scales (float32, one per 128x128 block); with a ``weights_dtype``
the quantizable matrices at that dtype (FP8 adds block scales) and everything else at the model dtype.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from adapt.errors import PlanError
from adapt.layout import TensorSpec, WeightLayout, is_quantizable, quantized_tensors
from adapt.plan import layout_of
from adapt.spec import ModelSpec, ceil_div, dtype_bytes

FP8 = "float8_e4m3fn"


@dataclass(frozen=True)
class Group:
    """Tensors that cost the same on every rank of a stage."""

    place: str  # dense | moe | mtp (per decoder layer of that kind) | first | last | first+last
    share: str  # full | tp | kv | expert
    tp_dim: int | None
    shape: tuple[int, ...]
    dtype: str
    scaled: bool  # the checkpoint stores FP8 block scales for it
    quantizable: bool
    role: str  # the role of the first tensor (for names in messages)
    count: int  # tensors in the whole model


@functools.lru_cache(maxsize=16)
def layout_groups(spec: ModelSpec) -> tuple[Group, ...]:
    """The layout grouped once per spec."""
    layout = layout_of(spec)
    scaled = {t.scale_of for t in layout if t.scale_of is not None}
    acc: dict[tuple, list] = {}
    for t in layout:
        if t.scale_of is not None:
            continue
        key = (_place(t, spec), _share(t, spec), t.tp_dim, t.shape, t.dtype, t.name in scaled, is_quantizable(t))
        g = acc.get(key)
        if g is None:
            acc[key] = [t.role, 1]
        else:
            g[1] += 1
    return tuple(Group(*k, role=v[0], count=v[1]) for k, v in acc.items())


def _place(t: TensorSpec, spec: ModelSpec) -> str:
    if t.layer is not None:
        return "mtp" if t.mtp else spec.layer_kinds[t.layer]
    if t.role == "embed":
        return "first+last" if spec.tie_word_embeddings else "first"
    if t.role in ("vision", "projector"):
        return "first"
    return "last"


def _share(t: TensorSpec, spec: ModelSpec) -> str:
    if t.split == "expert":
        return "expert"
    if t.split == "replicated" or t.tp_dim is None:
        return "full"
    if t.head_size and t.role.startswith(("attn_k", "attn_v")) and spec.attention.kind == "gqa":
        return "kv"
    return "tp"


def slice_shape(g: Group, spec: ModelSpec, tp: int, moe_tp: int) -> tuple[int, ...]:
    """The shape one rank holds of each tensor of the group (tensor_slice's rules)."""
    if g.share == "full" or g.tp_dim is None:
        return g.shape
    s = list(g.shape)
    if g.share == "expert":
        parts = moe_tp
    elif g.share == "kv" and tp > spec.attention.num_kv_heads:
        s[g.tp_dim] = g.shape[g.tp_dim] // spec.attention.num_kv_heads  # one KV head, replicated
        return tuple(s)
    else:
        parts = tp
    s[g.tp_dim] = g.shape[g.tp_dim] // parts
    return tuple(s)


def tensor_cost(shape: tuple[int, ...], dtype: str, scaled: bool, quantizable: bool, spec: ModelSpec,
                weights_dtype: str | None) -> float:
    """Bytes of one tensor slice of ``shape`` (see the module docstring for the convention)."""
    n = 1
    for x in shape:
        n *= x
    if weights_dtype is None:
        b = n * dtype_bytes(dtype)
        fp8 = scaled
        if scaled and spec.quant is not None and spec.quant.method != "fp8" and len(shape) == 2:
            # compressed-tensors: its scales (zero points, shape) as the layout stores them for this slice
            parts = quantized_tensors(spec.quant, "w.weight", tuple(shape), "", "replicated", None, None, None,
                                      None, False, spec.dtype)
            return sum(p.nbytes for p in parts)
    elif quantizable:
        b = n * dtype_bytes(weights_dtype)
        fp8 = weights_dtype == FP8
    else:
        return n * dtype_bytes(spec.dtype)
    if fp8 and len(shape) == 2:
        bm, bn = spec.quant.block_size if spec.quant else (128, 128)
        b += ceil_div(shape[0], bm) * ceil_div(shape[1], bn) * 4
    return b


@dataclass(frozen=True)
class StageWeights:
    """Per-rank weights of one pipeline stage (every rank of a stage holds the same amount)."""

    bytes: float  # all weights the rank holds
    expert_bytes: float  # of which routed experts
    embed_bytes: float  # of which the input embedding (read sparsely)
    params: float  # elements the rank holds, excluding routed experts and the input embedding
    expert_params: float  # routed-expert elements the rank holds


def per_layer(spec: ModelSpec, tp: int, ep: int, dp: int, weights_dtype: str | None) -> dict[str, list[float]]:
    """place -> [bytes, expert_bytes, embed_bytes, params, expert_params] per rank for the whole place
    (all layers of that kind together; divide by the number of layers of the kind for one layer)."""
    moe_tp = tp * dp // ep
    out: dict[str, list[float]] = {}
    for g in layout_groups(spec):
        shape = slice_shape(g, spec, tp, moe_tp)
        count = g.count // ep if g.share == "expert" else g.count
        b = count * tensor_cost(shape, g.dtype, g.scaled, g.quantizable, spec, weights_dtype)
        n = count
        for x in shape:
            n *= x
        row = out.setdefault(g.place, [0.0] * 5)
        row[0] += b
        if g.share == "expert":
            row[1] += b
            row[4] += n
        elif g.role == "embed":
            row[2] += b
        else:
            row[3] += n
    return out


def stage_weights(spec: ModelSpec, places: dict[str, list[float]], layers: tuple[int, int], first: bool,
                  last: bool, include_mtp: bool = False) -> StageWeights:
    """Per-rank weights of the stage holding decoder layers [start, stop)."""
    kinds = spec.layer_kinds
    tot = [0.0] * 5
    n_kind = {k: kinds.count(k) for k in set(kinds)}
    for k in set(kinds[layers[0]:layers[1]]):
        frac = kinds[layers[0]:layers[1]].count(k) / n_kind[k]
        for i, v in enumerate(places.get(k, [0.0] * 5)):
            tot[i] += v * frac
    edge = []
    if first:
        edge.append("first")
    if last:
        edge.append("last")
        if include_mtp:
            edge.append("mtp")
    if first or last:
        edge.append("first+last")
    for p in edge:
        for i, v in enumerate(places.get(p, [0.0] * 5)):
            tot[i] += v
    return StageWeights(*tot)


def fp8_alignment(spec: ModelSpec, tp: int, ep: int, dp: int, weights_dtype: str | None) -> None:
    """FP8 block scales are sliced in whole blocks (``scale_slice``): each split of a natively FP8 tensor
    must be a multiple of the block size. Raises PlanError naming the tensor role and the arithmetic."""
    if spec.quant is None or weights_dtype not in (None, FP8):
        return
    moe_tp = tp * dp // ep
    for g in layout_groups(spec):
        if not g.scaled or g.share == "full" or g.tp_dim is None:
            continue
        shape = slice_shape(g, spec, tp, moe_tp)
        b = spec.quant.block_size[g.tp_dim]
        if shape[g.tp_dim] % b:
            parts = moe_tp if g.share == "expert" else tp
            raise PlanError(f"fp8 block alignment: {g.role} dim {g.tp_dim} is {g.shape[g.tp_dim]} / {parts} = "
                            f"{shape[g.tp_dim]} per rank, not a multiple of the {b}-wide scale blocks")


def reference_rank_bytes(layout: WeightLayout, plan, rank: int, weights_dtype: str | None) -> float:
    """The slow, literal sum over ``rank_tensors`` (the oracle of the closed form; used in tests)."""
    from adapt.plan import rank_tensors

    scaled = {t.scale_of for t in layout if t.scale_of is not None}
    total = 0.0
    for t, s in rank_tensors(layout, plan, rank):
        total += tensor_cost(s.shape(t.shape), t.dtype, t.name in scaled, is_quantizable(t), layout.spec,
                             weights_dtype)
    return total


__all__ = ["Group", "StageWeights", "layout_groups", "per_layer", "stage_weights", "fp8_alignment",
           "tensor_cost", "slice_shape", "reference_rank_bytes", "PlanError"]
