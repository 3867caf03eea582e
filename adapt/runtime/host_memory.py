"""glibc malloc settings for CPU inference: keep freed tensor memory for reuse instead of returning it.

By default glibc serves blocks above a dynamic threshold (128 KiB at start) with fresh mmap pages and
trims freed heap memory back to the OS, so every large temporary of a forward pass (activations,
scores, GEMM outputs of several MB) is page-faulted in again on first touch. Measured on a 2-core Xeon
VM, torch 2.13, bench dense model, bfloat16 4 x 256-token prefill: 1890-3136 tok/s by default,
4618-4928 with the settings below (an elementwise SiLU over [1024, 2048] took 3.5 ms inside the
model against 0.56 ms alone; RMSNorm's pow 1.3 vs 0.13 ms); decode, whose tensors are small, is
unchanged. The settings are what PyTorch CPU guides get from tcmalloc / jemalloc: blocks up to 32 MiB
(glibc's maximum) come from the heap, and up to 1 GiB of freed heap stays mapped, as a GPU caching
allocator keeps its pool. ``ADAPT_MALLOC_TUNING=0`` leaves malloc alone.
"""

from __future__ import annotations

import ctypes
import os
import sys

_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # mallopt parameters, glibc malloc.h
MMAP_THRESHOLD = 32 << 20
TRIM_THRESHOLD = 1 << 30
_done: list[bool] = []


def tune_malloc() -> bool:
    """Apply the settings once per process (Linux with glibc); whether they are in effect."""
    if not _done:
        _done.append(_apply())
    return _done[0]


def _apply() -> bool:
    if sys.platform != "linux" or os.environ.get("ADAPT_MALLOC_TUNING", "1") == "0":
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # not glibc (musl, ...): nothing to tune
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return bool(mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD))
