"""Dtype transforms applied per slice: keep, cast, and FP8 e4m3 block dequantization on the CPU.

FP8 block layout (DeepSeek-V3 / Kimi-K2): weight ``W`` [R, C] in float8_e4m3fn, ``W_scale_inv``
[ceil(R/bm), ceil(C/bn)] in float32; the real weight is ``W.float() * scale_inv`` broadcast over each
bm x bn block (edge blocks are partial when R or C is not a multiple of the block).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from adapt.errors import ShardError
from adapt.spec import QuantSpec, ceil_div

if TYPE_CHECKING:  # torch is imported where a tensor is made: a pure-slicing run never loads it (~0.8 s)
    import torch

DTYPE_CHOICES = ("keep", "bf16", "fp16", "fp32")
QUANTIZE_CHOICES = ("int8", "int4", "fp8")


def activations_of(value: str | None) -> str | None:
    """``--activations``: none (or None) -> None, weight-only; int8 -> "int8"; anything else an error."""
    if value in (None, "none"):
        return None
    if value != "int8":
        raise ShardError(f"--activations must be none or int8; got {value!r}")
    return value


@dataclass(frozen=True)
class Quantize:
    """``--quantize``: round-to-nearest int8 per output channel, int4 in groups of ``group_size`` (symmetric,
    compressed-tensors), or fp8 in 128 x 128 blocks (DeepSeek's layout); ``spec``: the output's QuantSpec.
    ``lm_head`` (``--quantize-lm-head``, int8 / int4): lm_head is quantized too (the config's ``ignore`` is
    empty); a head tied to the embedding is untied: lm_head.weight is written quantized from the embedding,
    which stays as it is for the lookup, and the output config says ``tie_word_embeddings: false``.
    ``activations`` (``--activations int8``, int8 / int4): the config declares the quantized linears' inputs
    quantized dynamically per token (W8A8, W4A8); the weights are written the same."""

    scheme: str
    group_size: int
    spec: QuantSpec
    lm_head: bool = False
    activations: str | None = None

    @classmethod
    def make(cls, scheme: str, group_size: int = 128, lm_head: bool = False,
             activations: str | None = None) -> "Quantize":
        from adapt.hf_config import _quant

        if scheme not in QUANTIZE_CHOICES:
            raise ShardError(f"--quantize must be one of {', '.join(QUANTIZE_CHOICES)}; got {scheme!r}")
        if group_size < 1:
            raise ShardError(f"--group-size must be a positive number of columns; got {group_size}")
        if lm_head and scheme == "fp8":
            raise ShardError("--quantize-lm-head needs --quantize int8 or int4 (DeepSeek's fp8 layout keeps "
                             "lm_head unquantized)")
        activations = activations_of(activations)
        if activations and scheme == "fp8":
            raise ShardError("--activations int8 needs --quantize int8 or int4 (W8A8 / W4A8, compressed-tensors)")
        cfg = cls.config_of(scheme, group_size, lm_head, activations)
        return cls(scheme, group_size, _quant({"quantization_config": cfg}), lm_head, activations)

    @staticmethod
    def config_of(scheme: str, group_size: int, lm_head: bool = False, activations: str | None = None) -> dict:
        from adapt.quantize import quantization_config

        return quantization_config(scheme, group=group_size, ignore=[] if lm_head else None, activations=activations)

    @property
    def config(self) -> dict:
        """The output config.json's quantization_config."""
        return self.config_of(self.scheme, self.group_size, self.lm_head, self.activations)

    @property
    def transform(self) -> str:
        """The manifest's transform: quantize:int8 | quantize:int4:g128 | quantize:fp8."""
        return f"quantize:{self.scheme}" + (f":g{self.group_size}" if self.scheme == "int4" else "")


_TARGET = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}
_FLOATS = ("float64", "float32", "float16", "bfloat16")
_CHUNK_BYTES = 64 << 20  # rows of a dequantized slice processed at once


def target_dtype(choice: str) -> str | None:
    """The torch dtype name for --dtype, None for keep."""
    return _TARGET.get(choice)


def plan_transform(src_dtype: str, choice: str, quantized: bool) -> tuple[str, str]:
    """(transform, output dtype) for a source tensor: transform is none | cast | fp8_block_dequant."""
    target = target_dtype(choice)
    if target is None:
        return "none", src_dtype
    if quantized:
        return "fp8_block_dequant", target
    if src_dtype in _FLOATS and src_dtype != target:
        return "cast", target
    return "none", src_dtype


def cast(t: "torch.Tensor", dtype: str) -> "torch.Tensor":
    import torch

    return t.to(getattr(torch, dtype))


def dequant_slice(w: "torch.Tensor", scale_rows: "torch.Tensor", block: tuple[int, int], dim: int | None,
                  start: int, dtype: str) -> "torch.Tensor":
    """Dequantize a slice of an FP8 weight, vectorized in row chunks.

    ``w`` is the slice ([start, start + w.shape[dim]) along dim, or the whole weight when dim is None);
    ``scale_rows`` the scale blocks covering it: along dim the blocks from ``start // block[dim]``.
    """
    import torch

    bm, bn = block
    rows, cols = w.shape
    r0 = start if dim == 0 else 0
    c0 = start if dim == 1 else 0
    row_off, col_off = r0 - (r0 // bm) * bm, c0 - (c0 // bn) * bn
    out = torch.empty((rows, cols), dtype=getattr(torch, dtype))
    # one scale per column of the slice, for every scale row
    col_scale = scale_rows.repeat_interleave(bn, dim=1)[:, col_off:col_off + cols]  # [rb, cols]
    step = max(bm, (_CHUNK_BYTES // max(1, cols * 4)) // bm * bm)
    i = 0
    while i < rows:
        # rows [i, j) of the slice: the first chunk ends at a block edge so that later ones are aligned
        j = min(rows, i + step - ((row_off + i) % bm))
        g0 = (row_off + i) // bm
        g1 = ceil_div(row_off + j, bm)
        s = col_scale[g0:g1].repeat_interleave(bm, dim=0)
        lo = (row_off + i) - g0 * bm
        out[i:j] = (w[i:j].float() * s[lo:lo + (j - i)]).to(out.dtype)
        i = j
    return out


def reference_dequant(w: "torch.Tensor", scale: "torch.Tensor", block: tuple[int, int], dtype: str
                      ) -> "torch.Tensor":
    """The reference formula on a whole weight: pad to whole blocks, multiply per block, crop, cast."""
    import torch

    bm, bn = block
    rows, cols = w.shape
    rb, cb = ceil_div(rows, bm), ceil_div(cols, bn)
    padded = torch.zeros(rb * bm, cb * bn, dtype=torch.float32)
    padded[:rows, :cols] = w.float()
    blocks = padded.view(rb, bm, cb, bn) * scale.float().view(rb, 1, cb, 1)
    return blocks.view(rb * bm, cb * bn)[:rows, :cols].to(getattr(torch, dtype))


def shape_value(t) -> "torch.Tensor":
    """The tensor a ``shape:NxK`` transform writes (output tensor ``t``: a sliced int4 weight's weight_shape)."""
    import torch

    dims = [int(d) for d in t.transform.split(":", 1)[1].split("x")]
    return torch.tensor(dims, dtype=getattr(torch, t.dtype))


def quantize_part(w: "torch.Tensor", transform: str, weight: str, part: str, scale_dtype: str) -> "torch.Tensor":
    """Output tensor ``part`` of weight slice ``w`` (float) under a ``quantize:...`` transform. ``weight``: the
    source tensor; a part of another name (lm_head.weight_packed from a tied embedding) names its own weight."""
    import torch

    from adapt.quantize import quantized_parts

    bits = transform.split(":")
    group = int(bits[2][1:]) if len(bits) > 2 else None
    sd = getattr(torch, scale_dtype)  # a scale part's dtype; the other parts' scales are not kept
    if not part.startswith(weight[: -len("weight")]) and ".weight" in part:
        weight = part[: part.rindex(".weight")] + ".weight"
    parts = quantized_parts(bits[1], weight, w, group=group, scale_dtype=sd if sd.is_floating_point else None)
    if part not in parts:
        raise ShardError(f"{weight}: {transform} makes no tensor {part!r}")
    return parts[part]
