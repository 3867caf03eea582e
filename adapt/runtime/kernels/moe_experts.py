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
Both kernels gather the routed rows once (index_select), write every expert's output into one
preallocated [S', H] buffer, weight it and combine with one index_add_; ranks' foreign slots are
pushed past the last local expert by the sort instead of filtered with nonzero. On CPU builds with
``torch._grouped_mm`` the fused kernel runs each projection as one grouped GEMM once there are more
slots than experts and at most 64 per expert on average (measured on a 2-core Xeon, torch 2.13, 32
experts top-4, H 512, I 256: 16 tokens 1.26 vs 1.56 ms for the loop, 512 tokens 9.4 vs 10.4 ms,
but 1024 tokens 27.6 vs 17.5 ms, and slower at 1 token).

Before both, the fused kernel tries padded batched GEMMs (``_padded_experts``): every expert's rows
padded to the busiest expert's count C and two ``torch.bmm`` over [E, C, *], the experts stored
transposed by the model so the right-hand sides are contiguous (no tokens dropped: C is the maximum,
not a capacity factor). Same machine, 512 tokens: bfloat16 3.4 ms against 5.3-7.0 for transformers'
grouped_mm, float32 7.3-8.8 against 9.5-9.8; when the padding would waste too much it declines.
On a 2-core AMD EPYC float32 loses to the per-expert loop beyond ~16 rows per expert, so float32
takes the padded and grouped paths only up to that (measurements by the constants below).

``moe_experts_packed`` is the CPU float32 form the model switches to at load (MoE.pack_experts): each
expert's gate|up and down packed once into oneDNN's blocked layout, one packed GEMM pair per expert
segment; 1.25-1.6x faster than the stacked form from 4 to 1024 tokens on the 2-core AMD EPYC.
"""

import torch
import torch.nn.functional as F

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
) -> torch.Tensor:
    """moe_experts with w_gate_up [E, 2I, H] = cat(w_gate, w_up, dim=1): out [T, H] (x.dtype)."""
    e, i2, _ = w_gate_up.shape
    inter = i2 // 2

    def expert(ei: int, xs: torch.Tensor, out: torch.Tensor) -> None:
        gu = F.linear(xs, w_gate_up[ei])  # [n, 2I]
        torch.matmul(F.silu(gu[:, :inter]) * gu[:, inter:], w_down[ei].t(), out=out)  # [n, H]

    def grouped(xs: torch.Tensor, counts: list[int]) -> torch.Tensor | None:
        # torch._grouped_mm (one call per projection) where this build has a CPU kernel: it saves the
        # per-expert dispatch once most experts are busy, but falls behind the per-expert GEMMs beyond
        # ~64 rows per expert (measured, see the module docstring); None falls back to the loop
        max_rows = _GROUPED_MAX_ROWS if xs.dtype in _LOWP else _GROUPED_MAX_ROWS_FP32
        if not (_GROUPED_MM and xs.device.type == "cpu" and e < xs.shape[0] <= max_rows * e):
            return None
        offs = torch.tensor(counts[:e], dtype=torch.int32).cumsum(0, dtype=torch.int32)
        try:
            gu = torch._grouped_mm(xs, w_gate_up.transpose(1, 2), offs=offs)  # [S', 2I]
            return torch._grouped_mm(F.silu(gu[:, :inter]) * gu[:, inter:], w_down.transpose(1, 2), offs=offs)
        except (RuntimeError, NotImplementedError):  # no kernel for this dtype / layout
            return None

    def padded(x, weights, tokens, order, local, counts) -> torch.Tensor | None:
        return _padded_experts(x, weights, tokens, order, local, counts, w_gate_up, w_down)

    return _grouped(x, weights, ids, e, expert_offset, expert, grouped, padded)


def moe_experts_packed(
    x: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    w_gate_up: list[torch.Tensor],
    w_down: list[torch.Tensor],
    expert_offset: int = 0,
) -> torch.Tensor:
    """moe_experts_fused with each expert's weights packed once for oneDNN (CPU): w_gate_up[e] [2I, H] and
    w_down[e] [H, I], from ``pack_expert_weights``. One packed GEMM pair per expert segment: on CPU the
    blocked layout beats both the per-expert F.linear and the padded batched GEMMs of the stacked form
    (measured in moe.py, where the model chooses it)."""
    e = len(w_gate_up)
    inter = w_gate_up[0].shape[0] // 2 if e else 0

    def expert(ei: int, xs: torch.Tensor, out: torch.Tensor) -> None:
        gu = torch.ops.mkldnn._linear_pointwise(xs, w_gate_up[ei], None, "none", [], "")  # [n, 2I]
        out.copy_(torch.ops.mkldnn._linear_pointwise(F.silu(gu[:, :inter]).mul_(gu[:, inter:]), w_down[ei],
                                                     None, "none", [], ""))  # [n, H]

    return _grouped(x, weights, ids, e, expert_offset, expert)


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
_GROUPED_MAX_ROWS = 64  # mean rows per expert up to which torch._grouped_mm beats the loop on CPU
# padded batched GEMMs while E * C <= this x the real rows: float32 pays for the padding rows' FLOPs;
# bfloat16 / float16 batched GEMMs (AMX here) are bound by reading the weights, so padding is nearly free
# (measured, 32 experts top-4: 16 tokens bf16 1.94 -> 1.16 ms at 4x, float32 1.44 -> 1.65 ms, worse)
_PAD_MAX_WASTE = 1.5
_PAD_MAX_WASTE_LOWP = 4.0
# float32 on a 2-core AMD EPYC (torch 2.13, 32 experts top-4, H 512, I 256; ms for the MoE block):
# 128 tokens padded 11.4 / grouped_mm 11.9 / loop 12.8, 512 tokens 30.4 / 26.0 / 22.0, 1024 tokens
# padded 61.5 / loop 35.5. So float32 takes the batched paths only up to 16 rows per expert on average
_PAD_MAX_ROWS_FP32 = 16
# bfloat16: beyond 32 rows per expert the padded bmm only pays while it pads little (balanced routing,
# 512 tokens: 9.7 vs 10.5 ms for the grouped path) and loses beyond 64 (1024 tokens 30 vs 16.5 ms); real
# routing is skewed (the bench MoE model's prefill padded 1.7-5x when 4x was allowed, and its bf16
# 4 x 256-token prefill ran at 2061 tok/s with the padded path, 3919-4080 without it, same process)
_PAD_MAX_ROWS_LOWP = 64
_PAD_FREE_ROWS_LOWP = 32  # up to here the 4x waste above; beyond, at most _PAD_MAX_WASTE_BUSY
_PAD_MAX_WASTE_BUSY = 1.5
_GROUPED_MAX_ROWS_FP32 = 16
_LOWP = (torch.bfloat16, torch.float16)


def _padded_experts(x, weights, tokens, order, local, counts, w_gate_up, w_down) -> torch.Tensor | None:
    """The routed experts as two batched GEMMs over every expert's rows padded to the busiest count C:
    [E, C, H] @ [E, H, 2I] and [E, C, I] @ [E, I, H], the experts stored transposed so the right-hand
    sides are contiguous. Padding rows read token 0 and carry weight 0. None when the padding would
    waste more than _PAD_MAX_WASTE(_LOWP) x the real rows, or the weights are not stored transposed.
    When every slot is served here the combine gathers each token's K rows and sums them in float32;
    under expert parallelism it scatter-adds the served rows."""
    e, i2, h = w_gate_up.shape
    inter, s, c = i2 // 2, tokens.shape[0], max(counts[:e])
    max_waste = _PAD_MAX_WASTE_LOWP if x.dtype in _LOWP else _PAD_MAX_WASTE
    if s > (_PAD_MAX_ROWS_LOWP if x.dtype in _LOWP else _PAD_MAX_ROWS_FP32) * e:
        return None
    if x.dtype in _LOWP and s > _PAD_FREE_ROWS_LOWP * e:  # bigger per-expert GEMMs: pad only a little
        max_waste = _PAD_MAX_WASTE_BUSY
    if (c == 0 or e * c > max_waste * s or w_gate_up.transpose(1, 2).stride(-1) != 1
            or w_down.transpose(1, 2).stride(-1) != 1):
        return None
    dev = x.device
    local_sorted = local.index_select(0, order)  # [S'] expert of each sorted slot
    starts = [0] * e  # first sorted slot of each expert
    for j in range(1, e):
        starts[j] = starts[j - 1] + counts[j - 1]
    starts = torch.tensor(starts, device=dev)  # [E]
    dest = local_sorted * c + torch.arange(s, device=dev) - starts.index_select(0, local_sorted)  # [S']
    src = torch.zeros(e * c, dtype=torch.long, device=dev).index_copy_(0, dest, tokens)  # [E*C] token per row
    xp = _take_rows(x, src).view(e, c, h)  # [E, C, H]
    gu = torch.bmm(xp, w_gate_up.transpose(1, 2))  # [E, C, 2I]
    act = F.silu(gu[..., :inter]).mul_(gu[..., inter:])  # [E, C, I]
    t, k = weights.shape
    hp = torch.bmm(act, w_down.transpose(1, 2))  # [E, C, H]
    if s == t * k:  # every slot is served here: gather each token's K rows and sum them, no scatter
        pos = torch.empty_like(dest).index_copy_(0, order, dest)  # [T*K] padded row of slot (t, k)
        rows = _take_rows(hp.view(e * c, h), pos).view(t, k, h)
        return (rows * weights.float()[:, :, None]).sum(1).to(x.dtype)  # float32 weighted combine
    wp = torch.zeros(e * c, dtype=torch.float32, device=dev).index_copy_(
        0, dest, weights.reshape(-1).index_select(0, order).float())  # [E*C], 0 on padding rows
    out = torch.zeros(x.shape, dtype=torch.float32, device=dev)
    out.index_add_(0, src, hp.view(e * c, h) * wp[:, None])  # float32 weighted combine
    return out.to(x.dtype)


def _grouped(x, weights, ids, e, expert_offset, expert, grouped=None, padded=None) -> torch.Tensor:
    t, h = x.shape
    k = ids.shape[1]
    local = ids.reshape(-1).to(torch.long) - expert_offset  # [S]
    local = torch.where((local >= 0) & (local < e), local, e)  # slots served elsewhere -> sentinel e
    order = torch.argsort(local, stable=True)  # [S] grouped by expert, sentinels last
    counts = torch.bincount(local, minlength=e + 1).tolist()  # [E + 1]
    served = len(order) - counts[e]
    order = order[:served]  # [S'] slots this rank serves
    tokens = order // k  # [S'] source token of each slot
    if padded is not None and served > e:
        out = padded(x, weights, tokens, order, local, counts)
        if out is not None:
            return out
    xs = _take_rows(x, tokens)  # [S', H]
    ys = None  # [S', H]
    if grouped is not None:
        ys = grouped(xs, counts)
    if ys is None:
        ys = torch.empty(served, h, dtype=x.dtype, device=x.device)
        start = 0
        for ei in range(e):
            n = counts[ei]
            if n:
                expert(ei, xs[start:start + n], ys[start:start + n])
                start += n
    slot_w = weights.reshape(-1).index_select(0, order).float()  # [S']
    out = torch.zeros(t, h, dtype=torch.float32, device=x.device)
    out.index_add_(0, tokens, ys.float().mul_(slot_w[:, None]))
    return out.to(x.dtype)


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


def moe_experts_fused_ref(x, weights, ids, w_gate_up, w_down, expert_offset=0):
    """Reference twin of moe_experts_fused: split gate|up and run the per-token loop."""
    inter = w_gate_up.shape[1] // 2
    return moe_experts_ref(x, weights, ids, w_gate_up[:, :inter], w_gate_up[:, inter:], w_down, expert_offset)


def moe_experts_packed_ref(x, weights, ids, w_gate_up, w_down, expert_offset=0):
    """Reference twin of moe_experts_packed: unpack the weights and run the per-token loop."""
    gu = torch.stack([w.to_dense() for w in w_gate_up])
    return moe_experts_fused_ref(x, weights, ids, gu, torch.stack([w.to_dense() for w in w_down]), expert_offset)
