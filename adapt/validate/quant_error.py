"""What correct round-to-nearest weight quantization is expected to cost, read from the held weights alone.

Rounding to nearest on a grid of step ``d`` leaves an error uniform in [-d/2, d/2] per element: standard
deviation d / sqrt(12) (the usual quantization-noise model). The step of each element is known from what
the checkpoint holds: int8 / int4 ``d = scale`` of its channel or group; fp8 e4m3 ``d = scale * ulp(q)``,
with ulp(q) = 2^(floor(log2 |q|) - 3) for normals (3 mantissa bits) and 2^-9 below the smallest normal
2^-6. So a linear's expected relative error ``sqrt(sum d^2 / 12) / ||W||`` does not depend on the scale's
magnitude: a scale multiplied by 50 leaves it unchanged and the layer's output error then exceeds it.

Per decoder layer and sub-module (``attention``, ``mlp``) the expected error is the root sum of squares of
the largest expected error of each role (q_proj, kv_b_proj, gate_proj, down_proj, ...; over experts and
fused rows): sequential linears' independent noises add in quadrature.
"""

from __future__ import annotations

import math
import re
from typing import Any

import torch

from adapt.runtime.kernels.quant_linear import unpack_int4
from adapt.runtime.quant.weight import QuantizedWeight

_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.(self_attn|mlp)\.(?:.*\.)?([A-Za-z_0-9]+)\.weight(?:_packed)?$")
_FP8_MIN_NORMAL_EXP = -6  # float8_e4m3fn: smallest normal 2^-6, 3 mantissa bits


def _steps(w: QuantizedWeight) -> tuple[torch.Tensor, torch.Tensor]:
    """(the dequantized weight [N, K], each element's grid step [N, K]) in float64."""
    v = unpack_int4(w.q, w.k) if w.kind == "int4" else w.q
    v = v.to(torch.float64)
    if w.zero is not None:
        v = v - w.zero.to(torch.float64).repeat_interleave(w.bk, dim=1)[:, : w.k]
    s = w.scale.to(torch.float64).repeat_interleave(w.rb, dim=0)[: w.n].repeat_interleave(w.bk, dim=1)[:, : w.k]
    if w.kind == "fp8":
        e = torch.floor(torch.log2(v.abs().clamp_min(2.0 ** _FP8_MIN_NORMAL_EXP)))
        step = s * torch.exp2(e - 3)
    else:
        step = s
    return v * s, step


def expected_rel_error(w: QuantizedWeight, row: int = 0, rows: int | None = None) -> float:
    """Expected ||W_q - W|| / ||W|| of rows [row, row + rows) of a held weight under round to nearest."""
    deq, step = _steps(w)
    rows = w.n - row if rows is None else rows
    deq, step = deq[row: row + rows], step[row: row + rows]
    n = float(deq.norm())
    return math.sqrt(float(step.square().sum()) / 12.0) / n if n > 0 else 0.0


def expected_errors(model: torch.nn.Module) -> tuple[dict[tuple[int, str], float], list[dict[str, Any]]]:
    """({(layer, "attention" | "mlp"): expected relative error of its output from its own weights},
    [{"name": checkpoint weight, "expected_rel_err": ...} per quantized source])."""
    roles: dict[tuple[int, str], dict[str, float]] = {}
    linears = []
    for m in model.modules():
        if not isinstance(m, QuantizedWeight):
            continue
        for name, row, rows in m.sources:
            e = expected_rel_error(m, row, rows)
            linears.append({"name": name, "expected_rel_err": e})
            hit = _LAYER.search(name)
            if hit is None:
                continue
            key = (int(hit.group(1)), "attention" if hit.group(2) == "self_attn" else "mlp")
            per = roles.setdefault(key, {})
            per[hit.group(3)] = max(per.get(hit.group(3), 0.0), e)
    return {k: math.sqrt(sum(x * x for x in per.values())) for k, per in roles.items()}, linears
