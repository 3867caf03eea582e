"""MoE routers: which K experts each token uses and with what weight, as transformers computes them.

# Legend: T tokens, H hidden size, E experts, K top-k, NG expert groups, EG = E // NG experts per group.

All routers take router logits [T, E] and return (weights [T, K] float32, ids [T, K] int64).
Where transformers computes the logits (`router_logits` below reproduces both):
  Mixtral, Qwen2-MoE, Qwen3-MoE: F.linear(x, W) in the model dtype; softmax in float32.
    (Qwen2/3-MoE then cast the weights back to the logits' dtype; we return float32.)
  DeepSeek-V2, DeepSeek-V3 / Kimi-K2: F.linear(x.float(), W.float()), everything in float32.
Id order within a row follows torch.topk exactly as the transformers router calls it (sorted for
softmax top-k, sorted=False for the DeepSeek routers), so outputs compare equal elementwise.
"""

import torch
import torch.nn.functional as F

from . import fused
from .moe_experts import onednn_packs


def router_logits(x: torch.Tensor, weight: torch.Tensor, float32: bool) -> torch.Tensor:
    """x [T, H], gate weight [E, H] -> logits [T, E]; float32=True for the DeepSeek routers. A 16-bit router
    on a CPU without native 16-bit dot products (oneDNN cannot pack bfloat16 or float16 there: AMD Zen 3) sums
    in float32 and rounds once, as F.linear's bfloat16 path does, on float32's faster GEMM: [512, 512] x
    [512, 32] on a 2-core EPYC, bfloat16 1.02 -> 0.23 ms, float16 1.88 -> 0.20 ms."""
    if float32:
        return F.linear(x.float(), weight.float())
    if x.dtype in (torch.bfloat16, torch.float16) and x.device.type == "cpu" and not onednn_packs(x.dtype):
        return F.linear(x.float(), weight.float()).to(x.dtype)
    return F.linear(x, weight)


def softmax_topk(logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax over E (float32), top-k, optional renormalization over the K chosen.
    Mixtral: renormalize=True. Qwen2-MoE / Qwen3-MoE: renormalize=config.norm_topk_prob."""
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)  # [T, E]
    weights, ids = _topk_sorted(probs, top_k)  # [T, K]
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def _topk_sorted(probs: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """torch.topk(probs, k, dim=-1) (sorted), float32 [T, E]: on the CPU by the fused kernels' one-pass
    selection for every row whose result is decided without a tie (the same values and ids); torch.topk on
    the other rows (torch.topk works row by row), so that ties keep torch's order."""
    ext = fused.module()
    if (ext is not None and probs.device.type == "cpu" and probs.dim() == 2 and 0 < k <= probs.shape[1]
            and not probs.requires_grad):
        probs = probs.contiguous()
        values, ids, undecided = ext.topk_rows(probs, k)
        if undecided.numel():
            values[undecided], ids[undecided] = torch.topk(probs[undecided], k, dim=-1)
        return values, ids
    return torch.topk(probs, k, dim=-1)


def router_panel(num_experts: int, dtype: torch.dtype) -> int:
    """Columns per panel of the router weight packed for ``router_softmax_topk`` here (0: it does not run):
    where a linear of ``dtype`` runs on the FMA GEMM's panels (float32; 16-bit on a CPU without native 16-bit
    dot products: linear_tiled.fma_panels), the build's width (64 with AVX-512) or a narrower one (32, 16)
    that pads E least, the wider on a tie (32 experts: 32; 8: 16; 60 or 128: 64)."""
    from .linear_tiled import fma_panels

    ext = fused.installed()
    widths = [int(w) for w in getattr(ext, "ROUTER_PANELS", ())] if ext is not None else []
    if not widths or num_experts < 1 or not fma_panels(dtype):
        return 0
    return min(widths, key=lambda w: (-(-num_experts // w) * w, -w))


def router_vnni(hidden: int, dtype: torch.dtype) -> bool:
    """Whether a router of ``dtype`` runs ``router_softmax_topk`` here on the vnni layout and the AVX512-BF16
    GEMM: bfloat16, H a multiple of 32, on a CPU with AVX512-BF16 (AMX hosts too)."""
    ext = fused.installed()
    return dtype == torch.bfloat16 and ext is not None and hidden % 32 == 0 and bool(getattr(ext, "ROUTER_VNNI", 0))


def pack_router(weight: torch.Tensor, panel: int | None = None) -> torch.Tensor | None:
    """The router weight [E, H], zero-padded past E, packed for ``router_softmax_topk``: in ``panel``-column
    panels [ceil(E / panel), H, panel]; with ``panel`` None, in this host's form: vnni [EP / 16, H / 32, 16, 32]
    (EP: E rounded up to 32) where ``router_vnni``, else the panels of ``router_panel``; None where the fused
    router does not run here."""
    from .linear_tiled import pack_linear
    from .moe_tiled import pack_tiled

    e, h = weight.shape
    vnni = panel is None and router_vnni(h, weight.dtype)
    if panel is None and not vnni:
        panel = router_panel(e, weight.dtype)
        if not panel:
            return None
    width = 32 if vnni else panel
    padded = weight.new_zeros(-(-e // width) * width, h)
    padded[:e] = weight.detach()
    return pack_tiled(padded[None], 16, vnni=True)[0] if vnni else pack_linear(padded, panel)


def router_softmax_topk(x: torch.Tensor, weight: torch.Tensor, panels: torch.Tensor | None, top_k: int,
                        renormalize: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(logits [T, E] x.dtype, weights [T, K] float32, ids [T, K]): ``router_logits`` (16-bit or float32, not the
    DeepSeek routers) then ``softmax_topk``, in one call of the fused CPU kernel on the router weight packed by
    ``pack_router`` (``panels``): its logits sum in k order (not bitwise with F.linear; within the dtype's
    tolerance). Rows with a tie or a NaN among the chosen take torch.topk's choice and order. Elsewhere (no
    panels, another device, autograd, no fused module) the two kernels run on ``weight``."""
    ext = fused.module()
    if (panels is not None and ext is not None and x.is_cpu and x.dtype == panels.dtype
            and not (torch.is_grad_enabled() and x.requires_grad)):
        logits, weights, ids, _ = ext.router_softmax_topk(x.contiguous(), panels, weight.shape[0], top_k, renormalize)
        return logits, weights, ids
    logits = router_logits(x, weight, False)
    return (logits, *softmax_topk(logits, top_k, renormalize))


def _group_mask(group_scores: torch.Tensor, topk_group: int, num_experts: int) -> torch.Tensor:
    # group_scores [T, NG] -> bool [T, E], True for experts in the topk_group best groups
    t, ng = group_scores.shape
    group_idx = torch.topk(group_scores, k=topk_group, dim=-1, sorted=False)[1]  # [T, topk_group]
    mask = torch.zeros_like(group_scores).scatter_(1, group_idx, 1)  # [T, NG]
    return mask.unsqueeze(-1).expand(t, ng, num_experts // ng).reshape(t, num_experts).bool()


def deepseek_v2_topk(
    logits: torch.Tensor,
    top_k: int,
    method: str = "greedy",
    n_group: int = 1,
    topk_group: int = 1,
    routed_scaling_factor: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V2 softmax routing. method "greedy": plain top-k of the softmax; "group_limited_greedy":
    group score = max softmax score in the group, keep the topk_group best groups (other experts'
    scores set to 0), then top-k. Weights are not renormalized, then times routed_scaling_factor."""
    t, e = logits.shape
    scores = torch.softmax(logits, dim=-1, dtype=torch.float32)  # [T, E]
    if method == "group_limited_greedy":
        group_scores = scores.view(t, n_group, e // n_group).max(dim=-1).values  # [T, NG]
        scores = scores.masked_fill(~_group_mask(group_scores, topk_group, e), 0.0)
    elif method != "greedy":
        raise ValueError(f"unknown DeepSeek-V2 topk_method {method!r}; expected greedy or group_limited_greedy")
    weights, ids = torch.topk(scores, k=top_k, dim=-1, sorted=False)
    return weights * routed_scaling_factor, ids


def sigmoid_grouped_topk(
    logits: torch.Tensor,
    top_k: int,
    e_score_correction_bias: torch.Tensor,
    n_group: int = 1,
    topk_group: int = 1,
    norm_topk_prob: bool = True,
    routed_scaling_factor: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V3 / Kimi-K2 routing: s = sigmoid(logits); choice = s + bias [E] (selection only);
    group score = sum of the top-2 choice scores in each group; keep the topk_group best groups;
    top-k of choice among them; weights = s at those ids, divided by (their sum + 1e-20) when
    norm_topk_prob, times routed_scaling_factor."""
    t, e = logits.shape
    scores = logits.float().sigmoid()  # [T, E]
    choice = scores + e_score_correction_bias.float()  # [T, E]
    group_scores = choice.view(t, n_group, e // n_group).topk(2, dim=-1)[0].sum(dim=-1)  # [T, NG]
    choice = choice.masked_fill(~_group_mask(group_scores, topk_group, e), float("-inf"))
    ids = torch.topk(choice, k=top_k, dim=-1, sorted=False)[1]  # [T, K]
    weights = scores.gather(1, ids)
    if norm_topk_prob:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * routed_scaling_factor, ids


# ---- reference twins: one token at a time, plain Python selection; ids in descending score order


def _top(values: list[float], k: int, among: list[int]) -> list[int]:
    return sorted(among, key=lambda i: -values[i])[:k]


def softmax_topk_ref(logits, top_k, renormalize):
    """Reference twin of softmax_topk."""
    ws, ids = [], []
    for row in logits.float():
        p = (row - row.max()).exp()
        p = p / p.sum()
        chosen = _top(p.tolist(), top_k, list(range(len(p))))
        w = p[chosen]
        ws.append(w / w.sum() if renormalize else w)
        ids.append(torch.tensor(chosen))
    return torch.stack(ws).to(logits.device), torch.stack(ids).to(logits.device)


def router_softmax_topk_ref(x, weight, panels, top_k, renormalize):
    """Reference twin of router_softmax_topk: F.linear on the plain weight, then softmax_topk_ref."""
    logits = router_logits(x, weight, False)
    return (logits, *softmax_topk_ref(logits, top_k, renormalize))


def deepseek_v2_topk_ref(logits, top_k, method="greedy", n_group=1, topk_group=1, routed_scaling_factor=1.0):
    """Reference twin of deepseek_v2_topk."""
    e = logits.shape[1]
    eg = e // n_group
    ws, ids = [], []
    for row in logits.float():
        p = torch.softmax(row, dim=-1)
        vals = p.tolist()
        among = list(range(e))
        if method == "group_limited_greedy":
            gs = [max(vals[g * eg : (g + 1) * eg]) for g in range(n_group)]
            groups = _top(gs, topk_group, list(range(n_group)))
            vals = [v if i // eg in groups else 0.0 for i, v in enumerate(vals)]
        chosen = _top(vals, top_k, among)
        ws.append(torch.tensor([vals[i] for i in chosen]) * routed_scaling_factor)
        ids.append(torch.tensor(chosen))
    return torch.stack(ws).to(logits.device), torch.stack(ids).to(logits.device)


def sigmoid_grouped_topk_ref(
    logits, top_k, e_score_correction_bias, n_group=1, topk_group=1, norm_topk_prob=True, routed_scaling_factor=1.0
):
    """Reference twin of sigmoid_grouped_topk."""
    e = logits.shape[1]
    eg = e // n_group
    ws, ids = [], []
    for row in logits.float():
        s = torch.sigmoid(row)
        choice = (s + e_score_correction_bias.float()).tolist()
        gs = [sum(sorted(choice[g * eg : (g + 1) * eg], reverse=True)[:2]) for g in range(n_group)]
        groups = _top(gs, topk_group, list(range(n_group)))
        chosen = _top(choice, top_k, [i for i in range(e) if i // eg in groups])
        w = s[chosen]
        if norm_topk_prob:
            w = w / (w.sum() + 1e-20)
        ws.append(w * routed_scaling_factor)
        ids.append(torch.tensor(chosen))
    return torch.stack(ws).to(logits.device), torch.stack(ids).to(logits.device)
