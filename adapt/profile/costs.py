"""Cost helpers shared by every module: weight bytes at a dtype, and the row builders for GEMM and norm.

FLOP conventions: a [M, K] x [K, N] matmul is 2*M*K*N FLOPs (one multiply and one add per term; bias
adds are not counted, as torch.utils.flop_counter does not count them). Each GEMM row reads its input
activations and its weights and writes its output; elementwise activations (SiLU * up) are assumed
fused into a neighbouring kernel and have no row.
"""

from __future__ import annotations

from dataclasses import dataclass

from adapt.profile.rows import ModuleRow
from adapt.spec import ModelSpec, ceil_div, dtype_bytes, normalize_dtype

# RMSNorm / LayerNorm: about 4 FLOPs per element (square, accumulate, scale by rsqrt, multiply by weight).
NORM_FLOPS_PER_ELEMENT = 4
# Rotary embedding with cached cos/sin: x*cos + rotate_half(x)*sin = 2 multiplies + 1 add per element.
ROPE_FLOPS_PER_ELEMENT = 3


@dataclass(frozen=True)
class Dtypes:
    """The dtypes a profile costs with, and the byte sizes derived from them."""

    weights: str  # dtype of the quantizable matrices (attention / MLP / expert projections)
    other: str  # dtype of embeddings, norms, routers, biases (the checkpoint's torch_dtype)
    act: str
    kv: str
    block: tuple[int, int] = (128, 128)  # FP8 scale block

    @classmethod
    def for_spec(cls, spec: ModelSpec, weights_dtype: str | None, kv_dtype: str, act_dtype: str) -> "Dtypes":
        w = normalize_dtype(weights_dtype) if weights_dtype else spec.weight_dtype
        return cls(weights=w, other=spec.dtype, act=normalize_dtype(act_dtype), kv=normalize_dtype(kv_dtype),
                   block=spec.quant.block_size if spec.quant else (128, 128))

    @property
    def a(self) -> float:
        return dtype_bytes(self.act)

    @property
    def gemm_compute(self) -> str:
        """Compute dtype of the quantizable GEMMs: FP8 and INT8 weights run on those units (W8A8);
        int4 is weight-only and computes in the activation dtype."""
        return self.weights if self.weights in ("float8_e4m3fn", "int8", "float32") else self.act

    def matrix(self, rows: int, cols: int) -> float:
        """Bytes of one quantizable [rows, cols] matrix, FP8 block scales (float32) included."""
        b = rows * cols * dtype_bytes(self.weights)
        if self.weights == "float8_e4m3fn":
            b += ceil_div(rows, self.block[0]) * ceil_div(cols, self.block[1]) * 4
        return b

    def plain(self, numel: int) -> float:
        """Bytes of a tensor kept in the checkpoint's own dtype (norms, embeddings, routers, biases)."""
        return numel * dtype_bytes(self.other)


def gemm(module: str, phase: str, kind: str, m: int, k: int, n: int, weight_bytes: float, dt: Dtypes,
         op: str = "gemm", note: str = "", compute: str | None = None) -> ModuleRow:
    """[m, k] x [k, n]: 2mkn FLOPs; reads [m, k] activations and the weights, writes [m, n]."""
    a = dt.a
    return ModuleRow(module, phase, op, module, None, kind, 2.0 * m * k * n, weight_bytes, m * k * a, m * n * a,
                     input_shape=(m, k), output_shape=(m, n), compute_dtype=compute or dt.gemm_compute, note=note)


def linear(module: str, phase: str, kind: str, tokens: int, in_f: int, out_f: int, dt: Dtypes,
           bias: bool = False, quantizable: bool = True, op: str = "gemm", note: str = "") -> ModuleRow:
    """An nn.Linear(in_f, out_f) applied to ``tokens`` rows."""
    w = dt.matrix(out_f, in_f) if quantizable else dt.plain(out_f * in_f)
    if bias:
        w += dt.plain(out_f)
    return gemm(module, phase, kind, tokens, in_f, out_f, w, dt, op, note,
                compute=None if quantizable else dt.act)


def norm(module: str, phase: str, kind: str, tokens: int, size: int, dt: Dtypes, groups: int = 1) -> ModuleRow:
    """RMSNorm over ``size`` features for ``tokens`` x ``groups`` vectors (groups: heads for q/k norm)."""
    n = tokens * groups * size
    return ModuleRow(module, phase, "norm", module, None, kind, float(NORM_FLOPS_PER_ELEMENT * n), dt.plain(size),
                     n * dt.a, n * dt.a, input_shape=(tokens, groups * size), output_shape=(tokens, groups * size),
                     compute_dtype=dt.act)


def rope(module: str, phase: str, kind: str, tokens: int, q_heads: int, k_heads: int, rotary_dim: int,
         dt: Dtypes) -> ModuleRow:
    """Rotary embedding of the rotating dims of q (q_heads) and k (k_heads)."""
    n = tokens * (q_heads + k_heads) * rotary_dim
    cos_sin = 2 * tokens * rotary_dim * dt.a
    return ModuleRow(module, phase, "rope", module, None, kind, float(ROPE_FLOPS_PER_ELEMENT * n), 0.0,
                     n * dt.a + cos_sin, n * dt.a, input_shape=(tokens, q_heads + k_heads, rotary_dim),
                     output_shape=(tokens, q_heads + k_heads, rotary_dim), compute_dtype=dt.act)
