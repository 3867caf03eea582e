"""Expert-parallel MoE: tokens dispatched to the ranks holding their experts with all-to-all, combined back.

# Legend: T tokens of this dp replica, t this rank's share (T split over tp), K top-k, H hidden,
# n ranks of the stage (tp x dp), P (token, expert) pairs this rank dispatches, R rows it receives.

The scheme is the planner's (adapt.profile.planner.comm): the tp ranks of a replica split its tokens;
each (token, expert) pair goes, as one hidden row, to the ``moe_tp`` ranks that hold slices of that
expert (stage-local ranks ``s`` with ``s % ep == expert // (E/ep)``); they return the unweighted partial
expert outputs on the same rows; the source weights and sums them. One tp all-reduce then reassembles
the replica's tokens and adds the shared expert's row-parallel partial. ``install`` puts this forward
on every MoE layer of a model built for a context whose stage spans more than its tp group
(ep > 1 or dp > 1), by making the layer an ``ExpertParallelMoE`` (runtime modules call their class's
forward: adapt/runtime/module.py). With tensor-parallel experts only (ep = dp = 1, tp > 1) and a shared expert,
``tp_forward`` sums the routed and shared partial outputs before one tp all-reduce (the planner's one
all-reduce per MoE layer) instead of one each. Otherwise the model's own MoE forward stays.
"""

from __future__ import annotations

import torch

from adapt.runtime.models.layers import linear
from adapt.runtime.models.moe import MoE

from .context import DistributedContext


def install(model: torch.nn.Module, ctx: DistributedContext) -> int:
    """Route every MoE layer of ``model`` through all-to-all dispatch; returns how many were patched."""
    if ctx.plan is None or ctx.world_size == 1:
        return 0
    n = 0
    for m in model.modules():
        if type(m) is not MoE:
            continue
        if ctx.ep_size > 1 or ctx.dp_size > 1:
            m.__class__ = ExpertParallelMoE
        elif ctx.tp_size > 1 and m.shared is not None and m.split:
            m.__class__ = TensorParallelMoE
        else:
            continue
        n += 1
    return n


def _experts(self, k, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """The routed experts this rank holds on x (the model's own choice of kernel)."""
    return self.run_experts(k, x, weights, ids)


def _shared_partial(self, x: torch.Tensor, k) -> torch.Tensor | None:
    """The shared expert's output before its row-parallel all-reduce (bias not yet added)."""
    if self.shared is None:
        return None
    sh = self.shared
    s = linear(k.silu_and_mul(sh.gate_up(x)), sh.down.weight)  # [T, H] tp partial
    if self.shared_gate is not None:
        s = torch.sigmoid(linear(x, self.shared_gate.weight)) * s
    return s


def _shared_bias(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    bias = self.shared.down.bias if self.shared is not None else None
    if bias is None:
        return out
    if self.shared_gate is not None:
        return out + torch.sigmoid(linear(x, self.shared_gate.weight)) * bias
    return out + bias


def tp_forward(self, x: torch.Tensor, batch) -> torch.Tensor:
    """MoE.forward with experts split over tp only: routed + shared partials, one all-reduce."""
    weights, ids = self.route(x, batch)
    if not self.deepseek:
        weights = weights.to(x.dtype)
    k = batch.kernels
    y = _experts(self, k, x, weights, ids)
    y = self.ctx.all_reduce(y + _shared_partial(self, x, k), group="tp")
    return _shared_bias(self, x, y)


def _exchange(self, rows: torch.Tensor, pair_ids: torch.Tensor, counts: list[int], k) -> torch.Tensor:
    """Dispatch rows (with their expert ids) to the stage ranks, run the experts on what this rank
    receives, combine: the unweighted partial outputs of our rows, in our send order."""
    ctx: DistributedContext = self.ctx
    recv_x, recv_counts = ctx.all_to_all(rows, counts, "stage")
    recv_ids, _ = ctx.all_to_all(pair_ids, counts, "stage", tag="all_to_all_meta")
    ones = torch.ones(recv_x.shape[0], 1, dtype=torch.float32, device=rows.device)
    y = _experts(self, k, recv_x, ones, recv_ids[:, None])
    back, _ = ctx.all_to_all(y, recv_counts, "stage")
    return back


def ep_idle(self, kernels, dtype: torch.dtype, device: torch.device) -> None:
    """This MoE layer's share of a step for a dp replica with no tokens: send nothing, but receive the
    other replicas' rows for the experts this rank holds, compute them and send them back (the stage's
    all-to-alls must match on every rank)."""
    n, h = self.ctx.group_size("stage"), self.hidden_size
    _exchange(self, torch.empty(0, h, dtype=dtype, device=device), torch.empty(0, dtype=torch.long, device=device),
              [0] * n, kernels)


def ep_forward(self, x: torch.Tensor, batch) -> torch.Tensor:
    """MoE.forward under expert parallelism (bound to a MoE module by ``install``)."""
    ctx: DistributedContext = self.ctx
    plan, k = ctx.plan, batch.kernels
    weights, ids = self.route(x, batch)  # [T, K] float32, [T, K] global ids
    T, H = x.shape
    K = ids.shape[1]
    chunk = torch.tensor_split(torch.arange(T, device=x.device), ctx.tp_size)[ctx.tp_rank]  # [t]
    ids_c, w_c = ids[chunk], weights[chunk].float()  # [t, K]
    n, ep = ctx.group_size("stage"), plan.ep
    per = plan.num_experts // ep
    flat = ids_c.reshape(-1).long()  # [t*K]
    owner = flat // per  # ep index of each pair's expert
    # destination s holds slice s // ep of experts with ep index s % ep
    order, counts = [], []
    for s in range(n):
        sel = torch.nonzero(owner == s % ep).squeeze(1)
        order.append(sel)
        counts.append(int(sel.numel()))
    order_t = torch.cat(order)  # [P * moe_tp / ...] pair index of each sent row
    rows = x[chunk][order_t // K]  # [P, H]
    back = _exchange(self, rows, flat[order_t], counts, k)  # [P, H] partial outputs, in our send order
    out_c = torch.zeros(chunk.numel(), H, dtype=torch.float32, device=x.device)
    w_rows = w_c.reshape(-1)[order_t]
    out_c.index_add_(0, order_t // K, back.float() * w_rows[:, None])
    shared = _shared_partial(self, x, k)
    if ctx.tp_size == 1:
        out = out_c.to(x.dtype)
        if shared is not None:
            out = out + shared
    else:
        out = torch.zeros(T, H, dtype=x.dtype, device=x.device)
        out[chunk] = out_c.to(x.dtype)
        if shared is not None:
            out = out + shared
        out = ctx.all_reduce(out, "tp")
    return _shared_bias(self, x, out)


class TensorParallelMoE(MoE):
    """A MoE layer whose routed and shared experts are split over tp only: one all-reduce (tp_forward)."""

    forward = tp_forward


class ExpertParallelMoE(MoE):
    """A MoE layer whose stage spans more than its tp group: all-to-all dispatch (ep_forward, ep_idle)."""

    forward = ep_forward
    idle = ep_idle
