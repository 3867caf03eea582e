"""MoE expert execution: grouped SiLU-gated MLPs over token slots sorted by expert.

# Legend: T tokens, H hidden size, I expert intermediate size, K top-k, S = T * K token slots,
# E local experts held by this rank (global ids expert_offset .. expert_offset + E - 1).

Each (token, k) pair is a slot. Slots are sorted by expert (stable argsort), counted with bincount,
and each expert runs one GEMM chain over its contiguous segment of gathered tokens (a Python loop
over experts, never over tokens); results are weighted and scatter-added back per token in
float32, then cast to x.dtype. Under expert parallelism a rank passes only its stacked experts and
their first global id; slots routed elsewhere contribute zero, so summing every rank's output
(all-reduce) gives the full MoE output.
"""

import torch
import torch.nn.functional as F


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
    t, h = x.shape
    k = ids.shape[1]
    e = w_gate.shape[0]
    local = ids.reshape(-1).to(torch.long) - expert_offset  # [S]
    slots = torch.nonzero((local >= 0) & (local < e)).squeeze(1)  # [S'] slots this rank serves
    order = torch.argsort(local[slots], stable=True)
    slots = slots[order]  # [S'] grouped by expert
    counts = torch.bincount(local[slots], minlength=e).tolist()  # [E]
    tokens = slots // k  # [S'] source token of each slot
    slot_w = weights.reshape(-1)[slots].float()  # [S']
    out = torch.zeros(t, h, dtype=torch.float32, device=x.device)
    start = 0
    for ei, n in enumerate(counts):
        if n == 0:
            continue
        seg = slice(start, start + n)
        start += n
        xs = x[tokens[seg]]  # [n, H]
        hs = F.silu(F.linear(xs, w_gate[ei])) * F.linear(xs, w_up[ei])  # [n, I]
        ys = F.linear(hs, w_down[ei])  # [n, H]
        out.index_add_(0, tokens[seg], ys.float() * slot_w[seg, None])
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
