"""MoE expert execution: grouped SiLU-gated MLPs over token slots sorted by expert.

# Legend: T tokens, H hidden size, I expert intermediate size, K top-k, S = T * K token slots,
# E local experts held by this rank (global ids expert_offset .. expert_offset + E - 1).

Each (token, k) pair is a slot. Slots are sorted by expert (stable argsort), counted with bincount,
and each expert runs one GEMM chain over its contiguous segment of gathered tokens (a Python loop
over experts, never over tokens); results are weighted and scatter-added back per token in
float32, then cast to x.dtype. Under expert parallelism a rank passes only its stacked experts and
their first global id; slots routed elsewhere contribute zero, so summing every rank's output
(all-reduce) gives the full MoE output.

``moe_experts_fused`` takes gate|up concatenated once at load time (w_gate_up [E, 2I, H], gate rows
then up rows, transformers' ``gate_up_proj`` layout), so each expert runs two GEMMs instead of three.
Three paths serve the sorted slots, every one computing the same sums:

- the loop: the routed rows gathered once (index_select), one GEMM chain per expert segment into one
  preallocated [S', H] buffer, weighted and combined with one index_add_;
- grouped: ``torch._grouped_mm``, one call per projection, where the build has it;
- padded: every expert's rows padded to the busiest expert's count C and two ``torch.bmm`` over
  [E, C, *], the experts stored transposed by the model so the right-hand sides are contiguous (no
  token dropped: C is the maximum, not a capacity factor); offered while it pads at most 4x.

Which one runs is the caller's ``choose``: the runtime times them per call class on this host
(adapt/runtime/tactics.py; the winner flips between CPUs). Ranks' foreign slots are pushed past the
last local expert by the sort instead of filtered with nonzero. On CPU, low-precision GEMMs (oneDNN)
run at bucketed row counts (rows.bucket_rows) so that varying expert loads reuse compiled primitives.

``moe_experts_packed`` is the CPU form with each expert's gate|up and down packed once into oneDNN's
blocked layout, one packed GEMM pair per expert segment; cpu_layouts.pack_experts switches a model to it at
load where a timed trial says it wins, after the fused moe_experts_tiled (moe_tiled.py), tried first
(1.25-1.6x over the stacked form from 4 to 1024 tokens, float32 on a 2-core AMD EPYC).
"""

import torch
import torch.nn.functional as F

from . import fused
from .activation import silu_and_mul
from .rows import bucket_rows, pad_rows
from .rows import take_rows as _take_rows


def moe_experts(
    x: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    w_gate: torch.Tensor,
    w_up: torch.Tensor,
    w_down: torch.Tensor,
    expert_offset: int = 0,
) -> torch.Tensor:
    """x [T, H], routing weights [T, K], global expert ids [T, K], w_gate / w_up [E, I, H],
    w_down [E, H, I] for experts expert_offset .. expert_offset + E - 1 -> out [T, H] (x.dtype):
    out[t] = sum over k with a local id of weights[t, k] * down(silu(gate x[t]) * up x[t])."""
    e = w_gate.shape[0]

    def expert(ei: int, xs: torch.Tensor, out: torch.Tensor) -> None:
        hs = F.silu(F.linear(xs, w_gate[ei])) * F.linear(xs, w_up[ei])  # [n, I]
        torch.matmul(hs, w_down[ei].t(), out=out)  # [n, H]

    return _grouped(x, weights, ids, e, expert_offset, expert)


def moe_experts_fused(
    x: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    expert_offset: int = 0,
    choose=None,
) -> torch.Tensor:
    """moe_experts with w_gate_up [E, 2I, H] = cat(w_gate, w_up, dim=1): out [T, H] (x.dtype). ``choose``
    picks the path (see _grouped)."""
    e, i2, _ = w_gate_up.shape
    inter = i2 // 2

    def expert(ei: int, xs: torch.Tensor, out: torch.Tensor) -> None:
        n = xs.shape[0]
        m = bucket_rows(n) if xs.dtype in _LOWP and xs.device.type == "cpu" else n  # oneDNN: bucketed rows
        act = silu_and_mul(F.linear(pad_rows(xs, m), w_gate_up[ei]))  # [m, I]
        if m == n:
            torch.matmul(act, w_down[ei].t(), out=out)  # [n, H]
        else:
            out.copy_(torch.matmul(act, w_down[ei].t())[:n])

    def grouped(xs: torch.Tensor, counts: list[int]) -> torch.Tensor:
        # torch._grouped_mm, one call per projection (offered only where this build has it)
        offs = torch.tensor(counts[:e], dtype=torch.int32).cumsum(0, dtype=torch.int32)
        gu = torch._grouped_mm(xs, w_gate_up.transpose(1, 2), offs=offs)  # [S', 2I]
        return torch._grouped_mm(silu_and_mul(gu), w_down.transpose(1, 2), offs=offs)

    padded = (lambda x, s, counts: _padded_ok(x, s, counts, e, w_gate_up, w_down),
              lambda x, weights, tokens, order, local, counts: _padded_experts(
                  x, weights, tokens, order, local, counts, w_gate_up, w_down))
    return _grouped(x, weights, ids, e, expert_offset, expert, grouped if _GROUPED_MM else None, padded,
                    ("fused", inter), choose)


def moe_experts_packed(
    x: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    w_gate_up: list[torch.Tensor],
    w_down: list[torch.Tensor],
    expert_offset: int = 0,
    choose=None,
) -> torch.Tensor:
    """moe_experts_fused with each expert's weights packed once for oneDNN (CPU): w_gate_up[e] [2I, H] and
    w_down[e] [H, I], from ``pack_expert_weights``. One packed GEMM pair per expert segment (the loop
    path only); the model takes it where a trial at load says it beats the stacked paths (cpu_layouts.pack_experts)."""
    e = len(w_gate_up)
    inter = w_gate_up[0].shape[0] // 2 if e else 0

    def expert(ei: int, xs: torch.Tensor, out: torch.Tensor) -> None:
        n = xs.shape[0]
        gu = torch.ops.mkldnn._linear_pointwise(pad_rows(xs, bucket_rows(n)), w_gate_up[ei], None, "none", [],
                                                "")  # [m, 2I], rows bucketed
        y = torch.ops.mkldnn._linear_pointwise(silu_and_mul(gu), w_down[ei], None, "none", [], "")  # [m, H]
        out.copy_(y[:n])

    return _grouped(x, weights, ids, e, expert_offset, expert, shape=("packed", inter), choose=choose)


def onednn_packs(dtype: torch.dtype) -> bool:
    """Whether this CPU and torch build pack (and run) oneDNN linears in ``dtype`` (probed once): float16
    needs AVX512-FP16 or AVX-NE-CONVERT, which e.g. AMD EPYC Zen 4 lacks."""
    if dtype not in _PACKS:
        ok = torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")
        try:
            if ok:
                w = torch.ops.mkldnn._reorder_linear_weight(torch.zeros(16, 16, dtype=dtype), 1)
                torch.ops.mkldnn._linear_pointwise(torch.zeros(1, 16, dtype=dtype), w, None, "none", [], "")
        except RuntimeError:
            ok = False
        _PACKS[dtype] = ok
    return _PACKS[dtype]


_PACKS: dict[torch.dtype, bool] = {}


def pack_expert_weights(w: torch.Tensor, rows_hint: int = 64) -> list[torch.Tensor]:
    """Stacked expert weights [E, N, K] -> E oneDNN-packed [N, K] weights (what moe_experts_packed reads)."""
    return [torch.ops.mkldnn._reorder_linear_weight(w[i].contiguous(), rows_hint) for i in range(w.shape[0])]


_GROUPED_MM = hasattr(torch, "_grouped_mm")
_LOWP = (torch.bfloat16, torch.float16)
# The padded path is a candidate while E * C <= this x the real rows (beyond, its memory and FLOPs
# outgrow any saving); which eligible path runs is the caller's ``choose`` (the runtime measures them:
# adapt/runtime/tactics.py). Without one, or off CPU, the padded path runs while it wastes at most
# _PAD_STATIC_WASTE, else the loop.
_PAD_MAX_WASTE = 4.0
_PAD_STATIC_WASTE = 1.5


def _pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def _padded_ok(x, s, counts, e, w_gate_up, w_down) -> bool:
    """Whether the padded path can serve s slots: stored transposed, padding at most _PAD_MAX_WASTE x."""
    c = max(counts[:e])
    max_waste = _PAD_MAX_WASTE if x.device.type == "cpu" else _PAD_STATIC_WASTE
    return (0 < c and s > e and e * c <= max_waste * s and w_gate_up.transpose(1, 2).stride(-1) == 1
            and w_down.transpose(1, 2).stride(-1) == 1)


def _padded_experts(x, weights, tokens, order, local, counts, w_gate_up, w_down) -> torch.Tensor | None:
    """The routed experts as two batched GEMMs over every expert's rows padded to the busiest count C:
    [E, C, H] @ [E, H, 2I] and [E, C, I] @ [E, I, H], the experts stored transposed so the right-hand
    sides are contiguous. Padding rows read token 0 and carry weight 0. None when _padded_ok says no.
    When every slot is served here the combine gathers each token's K rows and sums them in float32
    (one batched [1, K] @ [K, H] product per token: 0.48 -> 0.26 ms at 512 tokens bf16 against a
    broadcast multiply and sum); under expert parallelism it scatter-adds the served rows."""
    e, i2, h = w_gate_up.shape
    inter, s = i2 // 2, tokens.shape[0]
    if not _padded_ok(x, s, counts, e, w_gate_up, w_down):
        return None
    c = max(counts[:e])
    if x.dtype in _LOWP and x.device.type == "cpu":  # oneDNN's batched GEMM: bucketed rows (rows.py)
        c = bucket_rows(c)
    dev = x.device
    t, k = weights.shape
    ext = fused.module()
    if ext is not None and s == t * k and dev.type == "cpu" and x.dtype in (torch.float32, torch.bfloat16):
        # fused CPU kernels: the padded rows and each slot's row in one pass, the combine in another
        cnt = torch.tensor(counts[:e])
        xp, pos = ext.moe_pad_gather(x.contiguous(), order, cnt, k, c)  # [E*C, H], [S]
        gu = torch.bmm(xp.view(e, c, h), w_gate_up.transpose(1, 2)).view(e * c, i2)  # [E*C, 2I]
        act = ext.silu_and_mul(gu, cnt, c) if fused.vectorized() else silu_and_mul(gu)  # [E*C, I]
        hp = torch.bmm(act.view(e, c, inter), w_down.transpose(1, 2))  # [E, C, H]
        return ext.moe_combine(hp.view(e * c, h), pos, weights.float().contiguous())
    local_sorted = local.index_select(0, order)  # [S'] expert of each sorted slot
    starts = [0] * e  # first sorted slot of each expert
    for j in range(1, e):
        starts[j] = starts[j - 1] + counts[j - 1]
    starts = torch.tensor(starts, device=dev)  # [E]
    dest = local_sorted * c + torch.arange(s, device=dev) - starts.index_select(0, local_sorted)  # [S']
    src = torch.zeros(e * c, dtype=torch.long, device=dev).index_copy_(0, dest, tokens)  # [E*C] token per row
    xp = _take_rows(x, src).view(e, c, h)  # [E, C, H]
    act = silu_and_mul(torch.bmm(xp, w_gate_up.transpose(1, 2)))  # [E, C, I]
    hp = torch.bmm(act, w_down.transpose(1, 2))  # [E, C, H]
    if s == t * k:  # every slot is served here: gather each token's K rows and sum them, no scatter
        pos = torch.empty_like(dest).index_copy_(0, order, dest)  # [T*K] padded row of slot (t, k)
        rows = _take_rows(hp.view(e * c, h), pos).view(t, k, h).float()
        return torch.bmm(weights.float()[:, None, :], rows).view(t, h).to(x.dtype)  # float32 weighted combine
    wp = torch.zeros(e * c, dtype=torch.float32, device=dev).index_copy_(
        0, dest, weights.reshape(-1).index_select(0, order).float())  # [E*C], 0 on padding rows
    out = torch.zeros(x.shape, dtype=torch.float32, device=dev)
    out.index_add_(0, src, hp.view(e * c, h) * wp[:, None])  # float32 weighted combine
    return out.to(x.dtype)


def _grouped(x, weights, ids, e, expert_offset, expert, grouped=None, padded=None, shape=(),
             choose=None) -> torch.Tensor:
    """Sort the slots by expert, then run the experts by one of the paths the caller offers (the
    per-expert ``expert`` loop always; ``grouped`` and ``padded`` where given and eligible):
    ``choose(key, {name: thunk})`` picks on CPU (key: the call's class, ``shape`` naming the expert
    weights), else the static rule above."""
    t, h = x.shape
    k = ids.shape[1]
    local = ids.reshape(-1).to(torch.long) - expert_offset  # [S]
    local = torch.where((local >= 0) & (local < e), local, e)  # slots served elsewhere -> sentinel e
    order = torch.argsort(local, stable=True)  # [S] grouped by expert, sentinels last
    counts = torch.bincount(local, minlength=e + 1).tolist()  # [E + 1]
    served = len(order) - counts[e]
    order = order[:served]  # [S'] slots this rank serves
    tokens = order // k  # [S'] source token of each slot
    xs_cache: list[torch.Tensor] = []

    def gathered() -> torch.Tensor:
        if not xs_cache:
            xs_cache.append(_take_rows(x, tokens))  # [S', H]
        return xs_cache[0]

    def combine(ys: torch.Tensor) -> torch.Tensor:  # ys [S', H] -> out [T, H]
        ext = fused.module()
        if ext is not None and served == t * k and x.device.type == "cpu" and ys.dtype in (torch.float32,
                                                                                          torch.bfloat16):
            pos = torch.empty_like(order).index_copy_(0, order, torch.arange(served, device=x.device))  # [S]
            return ext.moe_combine(ys.contiguous(), pos, weights.float().contiguous())  # fused, float32 sums
        slot_w = weights.reshape(-1).index_select(0, order).float()  # [S']
        out = torch.zeros(t, h, dtype=torch.float32, device=x.device)
        out.index_add_(0, tokens, ys.float().mul_(slot_w[:, None]))
        return out.to(x.dtype)

    def loop() -> torch.Tensor:
        xs = gathered()
        ys = torch.empty(served, h, dtype=x.dtype, device=x.device)
        start = 0
        for ei in range(e):
            n = counts[ei]
            if n:
                expert(ei, xs[start:start + n], ys[start:start + n])
                start += n
        return combine(ys)

    cands = {}
    cpu = x.device.type == "cpu"
    if padded is not None and padded[0](x, served, counts):
        cands["padded"] = lambda: padded[1](x, weights, tokens, order, local, counts)
    if grouped is not None and cpu and e < served:
        cands["grouped"] = lambda: combine(grouped(gathered(), counts))
    cands["loop"] = loop
    waste = round(2 * e * max(counts[:e]) / served) / 2 if "padded" in cands else 0.0  # in steps of 0.5
    if choose is None or not cpu:  # the static rule: padded while it pads little, else the loop
        return cands["padded" if "padded" in cands and waste <= _PAD_STATIC_WASTE else "loop"]()
    return choose((x.dtype, e, h, shape, _pow2(served), waste, tuple(cands)), cands)


def moe_experts_ref(x, weights, ids, w_gate, w_up, w_down, expert_offset=0):
    """Reference twin: for each token, for each of its K experts held here, the plain MLP."""
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    e = w_gate.shape[0]
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            ei = int(ids[t, j]) - expert_offset
            if not 0 <= ei < e:
                continue
            g = x[t] @ w_gate[ei].t()
            u = x[t] @ w_up[ei].t()
            y = (g * torch.sigmoid(g) * u) @ w_down[ei].t()
            out[t] += weights[t, j].float() * y.float()
    return out.to(x.dtype)


def moe_experts_fused_ref(x, weights, ids, w_gate_up, w_down, expert_offset=0, choose=None):
    """Reference twin of moe_experts_fused: split gate|up and run the per-token loop."""
    inter = w_gate_up.shape[1] // 2
    return moe_experts_ref(x, weights, ids, w_gate_up[:, :inter], w_gate_up[:, inter:], w_down, expert_offset)


def moe_experts_packed_ref(x, weights, ids, w_gate_up, w_down, expert_offset=0, choose=None):
    """Reference twin of moe_experts_packed: unpack the weights and run the per-token loop."""
    gu = torch.stack([w.to_dense() for w in w_gate_up])
    return moe_experts_fused_ref(x, weights, ids, gu, torch.stack([w.to_dense() for w in w_down]), expert_offset)
