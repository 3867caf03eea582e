"""Metrics that compare a target's tensors against a reference's.

Every metric is computed in float64 on CPU copies, so the comparison itself adds no error of its own.
Argument order is always ``(target, reference)`` for element-wise metrics and ``(reference_logits,
target_logits)`` for distribution metrics, where the reference is the distribution KL is taken from.

Shapes: ``[..., V]`` logits (any leading dims are positions), ``[...]`` target ids matching the leading
dims of the logits.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

# max_rel = max |t - r| / (|r| + REL_EPS). The epsilon keeps exact zeros in the reference from dividing
# by zero; 1e-12 is far below fp32 resolution around 1 (1.2e-7), so it only matters where |r| ~ 0.
REL_EPS = 1e-12


def _pair(target: torch.Tensor, reference: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    if tuple(target.shape) != tuple(reference.shape):
        raise ValueError(f"shape mismatch: target {tuple(target.shape)} vs reference {tuple(reference.shape)}")
    return target.detach().to("cpu", torch.float64), reference.detach().to("cpu", torch.float64)


def max_abs(target: torch.Tensor, reference: torch.Tensor) -> float:
    """Largest element-wise absolute difference (0.0 for empty tensors)."""
    t, r = _pair(target, reference)
    return float((t - r).abs().max()) if t.numel() else 0.0


def max_rel(target: torch.Tensor, reference: torch.Tensor, eps: float = REL_EPS) -> float:
    """Largest ``|t - r| / (|r| + eps)``; see ``REL_EPS`` for the epsilon's reasoning."""
    t, r = _pair(target, reference)
    return float(((t - r).abs() / (r.abs() + eps)).max()) if t.numel() else 0.0


def cosine(target: torch.Tensor, reference: torch.Tensor) -> float:
    """Cosine similarity of the two tensors flattened, in float64.

    Two all-zero tensors are identical (1.0); one all-zero tensor against a non-zero one is 0.0.
    """
    t, r = _pair(target, reference)
    t, r = t.flatten(), r.flatten()
    nt, nr = float(t.norm()), float(r.norm())
    if nt == 0.0 and nr == 0.0:
        return 1.0
    if nt == 0.0 or nr == 0.0:
        return 0.0
    return float(torch.dot(t, r)) / (nt * nr)


def _logits_2d(reference_logits: torch.Tensor, target_logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    t, r = _pair(target_logits, reference_logits)
    if r.dim() == 0:
        raise ValueError("logits need a vocabulary dimension")
    return r.reshape(-1, r.shape[-1]), t.reshape(-1, t.shape[-1])  # [N, V] each


def kl_divergence(reference_logits: torch.Tensor, target_logits: torch.Tensor) -> dict[str, float]:
    """KL(P_reference || P_target) of next-token distributions, per position.

    Returns ``{"kl_mean": ..., "kl_max": ...}`` over positions, in nats.
    """
    r, t = _logits_2d(reference_logits, target_logits)
    lp_r = torch.log_softmax(r, dim=-1)
    lp_t = torch.log_softmax(t, dim=-1)
    # xlogy-style: terms where p_ref == 0 contribute 0, even if the target's logprob is -inf.
    p_r = lp_r.exp()
    terms = torch.where(p_r > 0, p_r * (lp_r - lp_t), torch.zeros_like(p_r))
    kl = terms.sum(dim=-1).clamp_min(0.0)  # [N]; clamp removes float64 round-off below zero
    return {"kl_mean": float(kl.mean()), "kl_max": float(kl.max())}


def top1_agreement(reference_logits: torch.Tensor, target_logits: torch.Tensor) -> float:
    """Fraction of positions whose argmax token is the same on both sides."""
    r, t = _logits_2d(reference_logits, target_logits)
    return float((r.argmax(-1) == t.argmax(-1)).double().mean())


def topk_overlap(reference_logits: torch.Tensor, target_logits: torch.Tensor, k: int = 5) -> float:
    """Mean over positions of ``|topk(ref) ∩ topk(target)| / k`` (order inside the top-k ignored)."""
    r, t = _logits_2d(reference_logits, target_logits)
    k = min(k, r.shape[-1])
    ir = r.topk(k, dim=-1).indices  # [N, k]
    it = t.topk(k, dim=-1).indices  # [N, k]
    hits = (ir.unsqueeze(-1) == it.unsqueeze(-2)).any(-1).sum(-1)  # [N]
    return float(hits.double().mean() / k)


def perplexity(logits: torch.Tensor, target_ids: torch.Tensor) -> float:
    """exp(mean negative log-likelihood) where ``logits[..., p, :]`` scores ``target_ids[..., p]``.

    The caller shifts (logits of position p predict the token at p + 1) before calling.
    """
    lp = torch.log_softmax(logits.detach().to("cpu", torch.float64), dim=-1)
    ids = target_ids.detach().to("cpu", torch.long)
    if tuple(lp.shape[:-1]) != tuple(ids.shape):
        raise ValueError(f"logits {tuple(lp.shape)} do not match target ids {tuple(ids.shape)}")
    nll = -lp.gather(-1, ids.unsqueeze(-1)).squeeze(-1)
    return math.exp(float(nll.mean()))


def perplexity_delta(
    reference_logits: torch.Tensor, target_logits: torch.Tensor, target_ids: torch.Tensor
) -> dict[str, float]:
    """Perplexity on both sides and ``ppl_delta = target - reference`` (absolute and relative)."""
    ppl_r = perplexity(reference_logits, target_ids)
    ppl_t = perplexity(target_logits, target_ids)
    return {
        "ppl_reference": ppl_r,
        "ppl_target": ppl_t,
        "ppl_delta": ppl_t - ppl_r,
        "ppl_delta_rel": (ppl_t - ppl_r) / ppl_r,
    }


def logits_metrics(
    reference_logits: torch.Tensor, target_logits: torch.Tensor, k: int = 5
) -> dict[str, float]:
    """The usual bundle for logits: max_abs, max_rel, cosine, KL, top-1 agreement, top-k overlap."""
    return {
        "max_abs": max_abs(target_logits, reference_logits),
        "max_rel": max_rel(target_logits, reference_logits),
        "cosine": cosine(target_logits, reference_logits),
        **kl_divergence(reference_logits, target_logits),
        "top1_agreement": top1_agreement(reference_logits, target_logits),
        "topk_overlap": topk_overlap(reference_logits, target_logits, k),
    }


@dataclass(frozen=True)
class TensorCompare:
    """One tensor checked against its reference, printing as llm.c does (``TENSOR OK, maxdiff = ...``)."""

    name: str
    max_abs: float
    max_rel: float
    cosine: float
    atol: float
    ok: bool

    def __str__(self) -> str:
        head = f"{self.name}: " if self.name else ""
        verdict = "TENSOR OK" if self.ok else "TENSOR NOT OK"
        return f"{head}{verdict}, maxdiff = {self.max_abs:.6e} (atol {self.atol:.1e}, cosine {self.cosine:.8f})"

    def metrics(self) -> dict[str, float]:
        return {"max_abs": self.max_abs, "max_rel": self.max_rel, "cosine": self.cosine}


def compare_tensors(
    target: torch.Tensor, reference: torch.Tensor, atol: float = 1e-5, name: str = ""
) -> TensorCompare:
    """Compare one tensor; ``ok`` when max_abs <= atol (default: the fp32 kernel-vs-twin bound, 1e-5).

    A non-finite difference (NaN or inf anywhere) is never ok.
    """
    d = max_abs(target, reference)
    ok = math.isfinite(d) and d <= atol
    return TensorCompare(name, d, max_rel(target, reference), cosine(target, reference), atol, ok)


@dataclass(frozen=True)
class LogprobCloseness:
    """Outcome of :func:`check_logprobs_close`.

    ``identical``: the common prefix matches token for token. ``diverged_at``: the first position where
    the tokens differ (or where one sequence ends, see ``length_mismatch``), None when identical.
    ``close``: identical, or at ``diverged_at`` each side's token is in the other side's top-N.
    """

    close: bool
    identical: bool
    diverged_at: int | None
    reference_token: int | None
    target_token: int | None
    length_mismatch: bool
    message: str


def _top_n(logprobs: Mapping[int, float], n: int | None) -> set[int]:
    if n is None:
        return set(logprobs)
    return {tok for tok, _ in sorted(logprobs.items(), key=lambda kv: kv[1], reverse=True)[:n]}


def check_logprobs_close(
    reference_tokens: Sequence[int],
    reference_logprobs: Sequence[Mapping[int, float]],
    target_tokens: Sequence[int],
    target_logprobs: Sequence[Mapping[int, float]],
    top_n: int | None = None,
) -> LogprobCloseness:
    """vLLM's ``check_logprobs_close`` rule for one pair of greedy generations.

    Tokens are compared position by position. At the first position where they differ, the sequences are
    close when the target's token is in the reference's top-N logprobs there and the reference's token is
    in the target's top-N; positions after that are not compared (the continuations legitimately differ).
    ``*_logprobs[p]`` maps token id -> logprob at position p; ``top_n`` restricts each dict to its N
    largest entries (None: use the dict as given).

    As in vLLM, only the common length is compared; an identical prefix with different lengths is close,
    and ``length_mismatch`` says so.
    """
    n = min(len(reference_tokens), len(target_tokens))
    if len(reference_logprobs) < n or len(target_logprobs) < n:
        raise ValueError("each generated token needs its logprobs dict")
    for p in range(n):
        r_tok, t_tok = int(reference_tokens[p]), int(target_tokens[p])
        if r_tok == t_tok:
            continue
        t_in_r = t_tok in _top_n(reference_logprobs[p], top_n)
        r_in_t = r_tok in _top_n(target_logprobs[p], top_n)
        close = t_in_r and r_in_t
        why = "both tokens in each other's top-N" if close else (
            f"target token {t_tok} {'in' if t_in_r else 'not in'} reference top-N, "
            f"reference token {r_tok} {'in' if r_in_t else 'not in'} target top-N"
        )
        return LogprobCloseness(close, False, p, r_tok, t_tok, False, f"diverged at position {p}: {why}")
    mismatch = len(reference_tokens) != len(target_tokens)
    if mismatch:
        msg = f"identical for {n} tokens, lengths differ ({len(reference_tokens)} vs {len(target_tokens)})"
        return LogprobCloseness(True, True, n, None, None, True, msg)
    return LogprobCloseness(True, True, None, None, None, False, f"identical ({n} tokens)")


def layer_error_growth(
    reference_layers: Sequence[torch.Tensor],
    target_layers: Sequence[torch.Tensor],
    names: Sequence[str] | None = None,
) -> list[dict[str, float | int | str]]:
    """Per-layer metrics of hidden states, and how the error grows from one layer to the next.

    Each entry: ``layer``, ``name``, ``max_abs``, ``max_rel``, ``cosine`` and ``growth`` (this layer's
    max_abs over the previous layer's; 1.0 for the first layer, inf after an exact zero).
    """
    if len(reference_layers) != len(target_layers):
        raise ValueError(f"{len(reference_layers)} reference layers vs {len(target_layers)} target layers")
    if names is not None and len(names) != len(reference_layers):
        raise ValueError(f"{len(names)} names for {len(reference_layers)} layers")
    curve: list[dict[str, float | int | str]] = []
    prev: float | None = None
    for i, (r, t) in enumerate(zip(reference_layers, target_layers)):
        d = max_abs(t, r)
        if prev is None:
            growth = 1.0
        elif prev == 0.0:
            growth = 1.0 if d == 0.0 else math.inf
        else:
            growth = d / prev
        curve.append({
            "layer": i,
            "name": names[i] if names is not None else f"layers.{i}",
            "max_abs": d,
            "max_rel": max_rel(t, r),
            "cosine": cosine(t, r),
            "growth": growth,
        })
        prev = d
    return curve


def first_divergence(
    curve: Sequence[Mapping[str, float | int | str]],
    cosine_min: float | None = None,
    max_abs_max: float | None = None,
) -> dict[str, int | str] | None:
    """The first entry of a per-layer curve that breaks a bound: ``{"layer": i, "module": name}``.

    NaN never satisfies a bound. Returns None when every layer is within the bounds given.
    """
    for e in curve:
        cos, d = float(e["cosine"]), float(e["max_abs"])
        bad_cos = cosine_min is not None and not cos >= cosine_min
        bad_abs = max_abs_max is not None and not d <= max_abs_max
        if bad_cos or bad_abs:
            return {"layer": int(e["layer"]), "module": str(e["name"])}
    return None
