"""Row gathers shared by the kernels."""

import torch

# index_select of floating rows, copied as integers of the same width: bitwise the same result, and
# several times faster on CPU for bfloat16 (torch 2.13, [2560, 512] rows: 0.40 -> 0.08 ms one thread)
_SAME_WIDTH_INT = {2: torch.int16, 4: torch.int32, 8: torch.int64}


def take_rows(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """x.index_select(0, index)."""
    it = _SAME_WIDTH_INT.get(x.element_size())
    if it is None or not x.is_floating_point():
        return x.index_select(0, index)
    return x.view(it).index_select(0, index).view(x.dtype)


# oneDNN JIT-compiles a GEMM primitive per (M, N, K) and caches it; a new M costs far more than the
# GEMM itself (2-core AMX Xeon, torch 2.13, [M, 512] x [512, 512]: 33 us with a cached bfloat16 packed
# primitive, ~2.9 ms when M is new; float32 packed 0.1 vs 0.6 ms; batched bf16 [32, C, 512] x [32, 512,
# 512] 1.5 vs 5.9 ms). Row counts that vary per call (prefill lengths, tokens per expert) are therefore
# rounded up to a few buckets, keeping the set of shapes, and so of compilations, small.
BUCKET_EXACT = 16  # up to here every count is its own shape (decode batch sizes, busy experts' few rows)


def bucket_rows(n: int) -> int:
    """The row count a oneDNN GEMM of n rows runs at: n up to 16, else n rounded up to a multiple of
    16 up to 256, and of 64 beyond (at most 15 / 64 padding rows: <= 6% beyond 256 rows)."""
    if n <= BUCKET_EXACT:
        return n
    step = 16 if n <= 256 else 64
    return -(-n // step) * step


def pad_rows(x: torch.Tensor, m: int) -> torch.Tensor:
    """x [n, K] with m - n zero rows appended ([m, K]); x itself when m == n. Only the appended rows are
    zeroed (F.pad fills all m rows, then copies n over them: [581, 512] bfloat16 22 -> 12 us, float32
    [581, 1408] 187 -> 129 us, 2-core Xeon)."""
    n = x.shape[0]
    if m == n:
        return x
    out = x.new_empty(m, *x.shape[1:])
    out[:n].copy_(x)
    out[n:].zero_()
    return out
