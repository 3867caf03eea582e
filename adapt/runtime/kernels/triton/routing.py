"""Triton MoE routers (twins: moe_routing.softmax_topk_ref, router_softmax_topk_ref, sigmoid_grouped_topk_ref).

# Legend: T tokens, E experts, K top-k, NG expert groups, EG = E // NG experts per group.

One program per token. Top-k is K rounds of (max, lowest index holding it, mask it out), so ties go to
the lower expert id as torch.topk's do. The DeepSeek-V3 / Kimi-K2 router holds the row as [NG, EG]:
group score = the sum of each group's two best bias-corrected scores, the topk_group best groups are
kept, then top-k among their experts; the weights are the uncorrected sigmoid scores.
"""

import torch
import triton
import triton.language as tl

from ..moe_routing import router_logits
from . import pow2


@triton.jit
def _softmax_topk(l_ptr, w_ptr, id_ptr, e, sl, K: tl.constexpr, RENORM: tl.constexpr, BLOCK_E: tl.constexpr,
                  BLOCK_K: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    ei = tl.arange(0, BLOCK_E)
    em = ei < e
    x = tl.load(l_ptr + t * sl + ei, mask=em, other=float("-inf")).to(tl.float32)
    p = tl.exp(x - tl.max(x, axis=0))
    p = p / tl.sum(p, axis=0)
    p = tl.where(em, p, -1.0)
    ki = tl.arange(0, BLOCK_K)
    ws = tl.zeros([BLOCK_K], tl.float32)
    ids = tl.zeros([BLOCK_K], tl.int64)
    for j in tl.static_range(K):
        best = tl.max(p, axis=0)
        idx = tl.min(tl.where(p == best, ei, BLOCK_E), axis=0)
        ws = tl.where(ki == j, best, ws)
        ids = tl.where(ki == j, idx, ids)
        p = tl.where(ei == idx, -1.0, p)
    if RENORM:
        ws = ws / tl.sum(ws, axis=0)
    tl.store(w_ptr + t * K + ki, ws, mask=ki < K)
    tl.store(id_ptr + t * K + ki, ids, mask=ki < K)


def softmax_topk(logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax over E in float32, top-k, optional renormalization: (weights [T, K] float32, ids [T, K])."""
    t, e = logits.shape
    logits = logits if logits.stride(-1) == 1 else logits.contiguous()
    w = torch.empty(t, top_k, dtype=torch.float32, device=logits.device)
    ids = torch.empty(t, top_k, dtype=torch.int64, device=logits.device)
    if t:
        _softmax_topk[(t,)](logits, w, ids, e, logits.stride(0), K=top_k, RENORM=renormalize,
                            BLOCK_E=pow2(e, 2), BLOCK_K=pow2(top_k, 1))
    return w, ids


def router_softmax_topk(x, weight, panels, top_k, renormalize):
    """(logits [T, E], weights, ids): the router GEMM (F.linear: a vendor GEMM is the fastest there is), then
    the Triton softmax top-k. ``panels`` is the CPU backend's packed router; unused here."""
    logits = router_logits(x, weight, False)
    return (logits, *softmax_topk(logits, top_k, renormalize))


@triton.jit
def _sigmoid_grouped(l_ptr, b_ptr, w_ptr, id_ptr, sl, ng, eg, scale, K: tl.constexpr, TOPK_GROUP: tl.constexpr,
                     NORM: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_EG: tl.constexpr, BLOCK_K: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    gi = tl.arange(0, BLOCK_G)
    ei = tl.arange(0, BLOCK_EG)
    ok = (gi < ng)[:, None] & (ei < eg)[None, :]
    big = BLOCK_G * BLOCK_EG
    idx = tl.where(ok, gi[:, None] * eg + ei[None, :], big)  # [BLOCK_G, BLOCK_EG] expert ids (padding: big)
    s = tl.where(ok, tl.sigmoid(tl.load(l_ptr + t * sl + idx, mask=ok, other=0.0).to(tl.float32)), 0.0)
    c = tl.where(ok, s + tl.load(b_ptr + idx, mask=ok, other=0.0).to(tl.float32), float("-inf"))
    m1 = tl.max(c, axis=1)
    first = tl.min(tl.where(c == m1[:, None], ei[None, :], BLOCK_EG), axis=1)
    m2 = tl.max(tl.where(ei[None, :] == first[:, None], float("-inf"), c), axis=1)
    gs = tl.where(gi < ng, m1 + m2, float("-inf"))  # [BLOCK_G]
    keep = gi < 0
    for _ in tl.static_range(TOPK_GROUP):
        best = tl.max(gs, axis=0)
        gbest = tl.min(tl.where(gs == best, gi, BLOCK_G), axis=0)
        keep = keep | (gi == gbest)
        gs = tl.where(gi == gbest, float("-inf"), gs)
    c = tl.where(keep[:, None], c, float("-inf"))
    ki = tl.arange(0, BLOCK_K)
    ws = tl.zeros([BLOCK_K], tl.float32)
    ids = tl.zeros([BLOCK_K], tl.int64)
    for j in tl.static_range(K):
        best = tl.max(tl.max(c, axis=1), axis=0)
        pick = tl.min(tl.min(tl.where(c == best, idx, big), axis=1), axis=0)
        ws = tl.where(ki == j, tl.sum(tl.sum(tl.where(idx == pick, s, 0.0), axis=1), axis=0), ws)
        ids = tl.where(ki == j, pick, ids)
        c = tl.where(idx == pick, float("-inf"), c)
    if NORM:
        ws = ws / (tl.sum(ws, axis=0) + 1e-20)
    tl.store(w_ptr + t * K + ki, ws * scale, mask=ki < K)
    tl.store(id_ptr + t * K + ki, ids, mask=ki < K)


def sigmoid_grouped_topk(logits, top_k, e_score_correction_bias, n_group=1, topk_group=1, norm_topk_prob=True,
                         routed_scaling_factor=1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V3 / Kimi-K2 routing (moe_routing.sigmoid_grouped_topk): (weights [T, K] float32, ids [T, K])."""
    t, e = logits.shape
    logits = logits if logits.stride(-1) == 1 else logits.contiguous()
    w = torch.empty(t, top_k, dtype=torch.float32, device=logits.device)
    ids = torch.empty(t, top_k, dtype=torch.int64, device=logits.device)
    if t:
        _sigmoid_grouped[(t,)](logits, e_score_correction_bias.contiguous(), w, ids, logits.stride(0), n_group,
                               e // n_group, float(routed_scaling_factor), K=top_k, TOPK_GROUP=topk_group,
                               NORM=norm_topk_prob, BLOCK_G=pow2(n_group, 1), BLOCK_EG=pow2(e // n_group, 2),
                               BLOCK_K=pow2(top_k, 1))
    return w, ids
