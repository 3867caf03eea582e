"""Measure the largest tensor allocation made while running a function, by intercepting aten ops.

A TorchDispatchMode sees every op's outputs; an output whose storage is not one of the op's
inputs' storages is a fresh allocation (views and in-place results are skipped). This counts what
was allocated, independent of timing, of the caching allocator and of the device.
"""

from collections.abc import Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


class _Largest(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        flat_in = tree_flatten((args, kwargs))[0]
        inputs = {t.untyped_storage().data_ptr() for t in flat_in if isinstance(t, torch.Tensor)}
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in inputs:
                self.largest = max(self.largest, t.untyped_storage().nbytes())
        return out


def largest_allocation(fn: Callable[[], object]) -> int:
    """Bytes of the largest single tensor storage allocated while fn() runs."""
    mode = _Largest()
    with mode:
        fn()
    return mode.largest
