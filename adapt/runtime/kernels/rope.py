"""Rotary position embeddings, matching transformers' modeling_rope_utils in float32.

# Legend: T tokens, H heads, D head dim, Dr rotary dims (Dr <= D, even), F = Dr // 2 frequencies.

`rope_inv_freq` mirrors transformers' ROPE_INIT_FUNCTIONS ("default", "linear", "llama3", "yarn")
operation by operation, so inv_freq and the attention factor are bit-identical. `rope_cos_sin`
mirrors the models' RotaryEmbedding.forward (cos/sin laid out as cat(freqs, freqs), scaled by the
attention factor). Three application layouts:
  "rotate_half"      llama / neox: x * cos + rotate_half(x) * sin
  "interleave"       DeepSeek-V3 in transformers (rope_interleave=True): pairs (x0, x1), (x2, x3), ...
                     are rotated and the result is written de-interleaved: [evens' | odds']
  "interleave_pairs" DeepSeek-V2 in transformers (complex form): pairs rotated, kept interleaved
"""

import math
from collections.abc import Mapping

import torch

from . import fused

LAYOUTS = ("rotate_half", "interleave", "interleave_pairs")


def _base_inv_freq(dim: int, base: float) -> torch.Tensor:
    # [F]; int64 arange then float, as in transformers (identical values to a float arange)
    return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).to(dtype=torch.float) / dim))


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    if scale <= 1:
        return 1.0
    return 0.1 * mscale * math.log(scale) + 1.0


def _llama3(dim: int, base: float, p: Mapping) -> torch.Tensor:
    inv_freq = _base_inv_freq(dim, base)
    factor, low, high = p["factor"], p["low_freq_factor"], p["high_freq_factor"]
    old_context_len = p["original_max_position_embeddings"]
    low_freq_wavelen = old_context_len / low
    high_freq_wavelen = old_context_len / high
    wavelen = 2 * math.pi / inv_freq
    inv_freq_llama = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth_factor = (old_context_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth_factor) * inv_freq_llama / factor + smooth_factor * inv_freq_llama
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, inv_freq_llama)


def _yarn(dim: int, base: float, p: Mapping, max_position_embeddings: int | None) -> tuple[torch.Tensor, float]:
    factor = p.get("factor")
    original = p["original_max_position_embeddings"]
    if factor is None:
        if max_position_embeddings is None:
            raise ValueError("yarn without 'factor' needs max_position_embeddings")
        factor = max_position_embeddings / original
    attention_factor = p.get("attention_factor")
    mscale, mscale_all_dim = p.get("mscale"), p.get("mscale_all_dim")
    if attention_factor is None:
        if mscale and mscale_all_dim:  # DeepSeek variant
            attention_factor = float(_yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim))
        else:
            attention_factor = _yarn_mscale(factor)
    beta_fast = p.get("beta_fast") or 32
    beta_slow = p.get("beta_slow") or 1

    def correction_dim(num_rotations: float) -> float:
        return (dim * math.log(original / (num_rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if p.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # avoid a zero-width ramp, as transformers does
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)  # [F]

    pos_freqs = base ** (torch.arange(0, dim, 2).to(dtype=torch.float) / dim)  # [F]
    inv_extrapolation = 1.0 / pos_freqs
    inv_interpolation = 1.0 / (factor * pos_freqs)
    extrapolation_factor = 1 - ramp
    inv_freq = inv_interpolation * (1 - extrapolation_factor) + inv_extrapolation * extrapolation_factor
    return inv_freq, attention_factor


def rope_inv_freq(
    rotary_dim: int,
    base: float,
    scaling: Mapping | None = None,
    max_position_embeddings: int | None = None,
) -> tuple[torch.Tensor, float]:
    """Inverse frequencies [Dr // 2] float32 and the attention factor applied to cos/sin.

    rotary_dim: Dr, e.g. int(head_dim * partial_rotary_factor), or qk_rope_head_dim for DeepSeek.
    scaling: transformers' rope_parameters / rope_scaling dict; its "rope_type" (or legacy "type")
    selects "default", "linear" (factor), "llama3" (factor, low_freq_factor, high_freq_factor,
    original_max_position_embeddings) or "yarn" (factor, original_max_position_embeddings, optional
    beta_fast, beta_slow, mscale, mscale_all_dim, attention_factor, truncate). Other keys are ignored.
    max_position_embeddings: only used by yarn when factor is None.
    """
    p = dict(scaling or {})
    rope_type = p.get("rope_type", p.get("type", "default"))
    if rope_type == "default":
        # the models' compute_default_rope_parameters uses a float arange: same values
        return 1.0 / (base ** (torch.arange(0, rotary_dim, 2, dtype=torch.float) / rotary_dim)), 1.0
    if rope_type == "linear":
        inv_freq = _base_inv_freq(rotary_dim, base)
        inv_freq /= p["factor"]
        return inv_freq, 1.0
    if rope_type == "llama3":
        return _llama3(rotary_dim, base, p), 1.0
    if rope_type == "yarn":
        return _yarn(rotary_dim, base, p, max_position_embeddings)
    raise ValueError(f"unsupported rope_type {rope_type!r}; supported: default, linear, llama3, yarn")


def rope_cos_sin(
    inv_freq: torch.Tensor,
    positions: torch.Tensor,
    attention_factor: float = 1.0,
    dtype: torch.dtype = torch.float32,
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [T, Dr] (= cat(freqs, freqs) layout) for integer positions [T], times attention_factor."""
    freqs = positions[..., None].float() * inv_freq.to(device=positions.device, dtype=torch.float)  # [T, F]
    emb = torch.cat((freqs, freqs), dim=-1)  # [T, Dr]
    cos = emb.cos() * attention_factor
    sin = emb.sin() * attention_factor
    return cos.to(dtype=dtype), sin.to(dtype=dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, layout: str = "rotate_half") -> torch.Tensor:
    """Rotate x [T, H, D] by cos/sin [T, Dr]. The first Dr dims are rotated and the remaining D - Dr
    pass through (partial rotary, neox convention); for DeepSeek pass only the rope slice q[..., Dn:]."""
    rd = cos.shape[-1]
    ext = fused.vectorized()
    if (ext is not None and layout == "rotate_half" and rd == x.shape[-1] and x.dim() == 3 and x.device.type == "cpu"
            and x.dtype in (torch.float32, torch.bfloat16) and cos.dtype == sin.dtype == x.dtype and x.stride(-1) == 1
            and x.numel() and cos.shape == (x.shape[0], rd) and sin.shape == cos.shape and not x.requires_grad):
        return ext.rope_rotate_half(x, cos.contiguous(), sin.contiguous())  # one pass, bitwise the torch form
    if rd < x.shape[-1]:
        return torch.cat((apply_rope(x[..., :rd], cos, sin, layout), x[..., rd:]), dim=-1)
    c, s = cos.unsqueeze(-2), sin.unsqueeze(-2)  # [T, 1, Dr]
    if layout == "rotate_half":
        return (x * c) + (_rotate_half(x) * s)
    half = rd // 2
    c, s = c[..., :half], s[..., :half]  # [T, 1, F]: the per-pair angle
    x1, x2 = x[..., 0::2], x[..., 1::2]  # [T, H, F]
    if layout == "interleave":
        return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1)
    if layout == "interleave_pairs":
        return torch.stack([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1).flatten(-2)
    raise ValueError(f"unknown rope layout {layout!r}; expected one of {LAYOUTS}")


def apply_rope_ref(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, layout: str = "rotate_half") -> torch.Tensor:
    """Reference twin: rotate each frequency pair explicitly, one frequency at a time."""
    rd = cos.shape[-1]
    half = rd // 2
    out = x.clone()
    rot = torch.empty_like(x[..., :rd])
    for i in range(half):
        c = cos[:, i].unsqueeze(-1)  # [T, 1]; cos[:, i] == cos[:, i + half]
        s = sin[:, i].unsqueeze(-1)
        if layout == "rotate_half":
            a, b = x[..., i], x[..., i + half]
            rot[..., i], rot[..., i + half] = a * c - b * s, b * c + a * s
        elif layout in ("interleave", "interleave_pairs"):
            a, b = x[..., 2 * i], x[..., 2 * i + 1]
            j, k = (i, i + half) if layout == "interleave" else (2 * i, 2 * i + 1)
            rot[..., j], rot[..., k] = a * c - b * s, b * c + a * s
        else:
            raise ValueError(f"unknown rope layout {layout!r}; expected one of {LAYOUTS}")
    out[..., :rd] = rot
    return out
