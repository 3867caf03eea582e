"""Round-to-nearest weight quantization into the formats checkpoints ship (``QuantSpec``), and their configs.

- fp8 blocks (DeepSeek-V3 / Kimi-K2): ``weight`` float8_e4m3fn, ``weight_scale_inv`` float32 per block,
  amax(block) / 448 (448 is e4m3's largest finite value);
- compressed-tensors int-quantized: ``weight`` int8, ``weight_scale`` [N, 1] = amax(row) / 127, symmetric;
- compressed-tensors pack-quantized: int4 in [-8, 7], ``weight_scale`` [N, ceil(K / group)] (amax / 7, or with
  zero points (max - min) / 15), eight values to an int32 ``weight_packed`` [N, ceil(K / 8)] (value i at bits
  4i, stored as value + 8), ``weight_shape`` [N, K] int64, ``weight_zero_point`` packed the same way along N.

Used by ``adapt shard --quantize`` and by the tests that build quantized checkpoints; the runtime reads the
same tensors (adapt/runtime/quant/).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from adapt.spec import ceil_div

if TYPE_CHECKING:
    import torch

FP8_MAX = 448.0


def _tiny(dtype) -> float:
    import torch

    return torch.finfo(dtype).tiny


def quantize_fp8_blocks(w: "torch.Tensor", block: tuple[int, int] = (128, 128)) -> tuple["torch.Tensor", "torch.Tensor"]:
    """(q float8_e4m3fn [N, K], scale_inv float32 [ceil(N / bm), ceil(K / bn)]) with w ~ q * scale_inv."""
    import torch

    bm, bn = block
    n, k = w.shape
    rb, cb = ceil_div(n, bm), ceil_div(k, bn)
    pad = torch.zeros(rb * bm, cb * bn, dtype=torch.float32)
    pad[:n, :k] = w.float()
    blocks = pad.view(rb, bm, cb, bn)
    scale = (blocks.abs().amax(dim=(1, 3)) / FP8_MAX).clamp_min(_tiny(torch.float32))  # [rb, cb]
    q = (blocks / scale.view(rb, 1, cb, 1)).clamp(-FP8_MAX, FP8_MAX).view(rb * bm, cb * bn)[:n, :k]
    return q.to(torch.float8_e4m3fn).contiguous(), scale.contiguous()


def quantize_int8_channel(w: "torch.Tensor") -> tuple["torch.Tensor", "torch.Tensor"]:
    """(q int8 [N, K], scale float32 [N, 1]), symmetric per output channel."""
    import torch

    wf = w.float()
    scale = (wf.abs().amax(dim=1, keepdim=True) / 127.0).clamp_min(_tiny(torch.float32))
    return torch.round(wf / scale).clamp(-128, 127).to(torch.int8), scale


def quantize_int4_groups(w: "torch.Tensor", group: int | None, symmetric: bool = True
                         ) -> tuple["torch.Tensor", "torch.Tensor", "torch.Tensor | None"]:
    """(q int8 values in [-8, 7] [N, K], scale float32 [N, G], zero int8 [N, G] or None); G = ceil(K / group)
    (one group per row when group is None)."""
    import torch

    n, k = w.shape
    g = group or k
    groups = ceil_div(k, g)
    wf = w.float()
    pad = torch.zeros(n, groups * g, dtype=torch.float32)
    pad[:, :k] = wf
    v = pad.view(n, groups, g)
    if k % g:  # the last group's padding must not widen its range
        last = wf[:, (groups - 1) * g:]
        v[:, -1, k - (groups - 1) * g:] = last[:, :1]
    if symmetric:
        scale = (v.abs().amax(dim=2) / 7.0).clamp_min(_tiny(torch.float32))
        q = torch.round(v / scale[..., None]).clamp(-8, 7)
        zero = None
    else:
        lo, hi = v.amin(dim=2).clamp(max=0), v.amax(dim=2).clamp(min=0)
        scale = ((hi - lo) / 15.0).clamp_min(_tiny(torch.float32))
        zero = torch.round(-8 - lo / scale).clamp(-8, 7)
        q = (torch.round(v / scale[..., None]) + zero[..., None]).clamp(-8, 7)
        zero = zero.to(torch.int8)
    return q.view(n, groups * g)[:, :k].to(torch.int8).contiguous(), scale, zero


def pack_int4(q: "torch.Tensor", dim: int = 1) -> "torch.Tensor":
    """int8 values in [-8, 7] [R, C] -> int32 words, eight values each along ``dim`` (value i of a word at bits
    4i, stored as value + 8; the last word zero-padded): compressed-tensors' pack_to_int32 for 4 bits."""
    import torch

    v = (q.to(torch.int32) + 8)
    if dim == 0:
        v = v.t()
    r, c = v.shape
    words = ceil_div(c, 8)
    pad = torch.zeros(r, words * 8, dtype=torch.int32)
    pad[:, :c] = v
    shifts = torch.arange(0, 32, 4, dtype=torch.int32)
    packed = (pad.view(r, words, 8) << shifts).sum(dim=2, dtype=torch.int64)  # < 2^32: no carries between nibbles
    packed = torch.where(packed >= 2 ** 31, packed - 2 ** 32, packed).to(torch.int32)
    return (packed.t() if dim == 0 else packed).contiguous()


def quantized_parts(scheme: str, name: str, w: "torch.Tensor", *, block: tuple[int, int] = (128, 128),
                    group: int | None = 128, symmetric: bool = True, scale_dtype=None) -> dict[str, "torch.Tensor"]:
    """The stored tensors of linear weight ``name`` (``...proj.weight``) quantized by ``scheme`` (fp8 | int8 |
    int4), named as WeightLayout names them; int8 / int4 scales in ``scale_dtype`` (default float32)."""
    import torch

    base = name[: -len("weight")]
    sd = scale_dtype or torch.float32
    if scheme == "fp8":
        q, s = quantize_fp8_blocks(w, block)
        return {name: q, name + "_scale_inv": s}
    if scheme == "int8":
        q, s = quantize_int8_channel(w)
        return {name: q, base + "weight_scale": s.to(sd)}
    q, s, z = quantize_int4_groups(w, group, symmetric)
    out = {base + "weight_packed": pack_int4(q), base + "weight_scale": s.to(sd),
           base + "weight_shape": torch.tensor(list(w.shape), dtype=torch.int64)}
    if z is not None:
        out[base + "weight_zero_point"] = pack_int4(z, dim=0)
    return out


def quantization_config(scheme: str, *, block: tuple[int, int] = (128, 128), group: int | None = 128,
                        symmetric: bool = True, ignore: list[str] | None = None,
                        activations: str | None = None) -> dict:
    """The config.json ``quantization_config`` of a checkpoint written by :func:`quantized_parts`;
    ``activations="int8"`` (int8 / int4 only) declares the linears' inputs quantized dynamically per token (W8A8,
    W4A8)."""
    if scheme == "fp8":
        return {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                "weight_block_size": list(block)}
    weights = {"num_bits": 8 if scheme == "int8" else 4, "type": "int", "symmetric": symmetric,
               "strategy": "channel" if scheme == "int8" or group is None else "group",
               "group_size": None if scheme == "int8" or group is None else group, "dynamic": False,
               "actorder": None, "observer": "minmax"}
    fmt = "int-quantized" if scheme == "int8" else "pack-quantized"
    inputs = None
    if activations == "int8":
        inputs = {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "token", "group_size": None,
                  "dynamic": True, "actorder": None, "observer": None}
    return {"quant_method": "compressed-tensors", "format": fmt, "quantization_status": "compressed",
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": inputs,
                                          "output_activations": None, "format": fmt}},
            "ignore": list(ignore if ignore is not None else ["lm_head"]), "kv_cache_scheme": None}
