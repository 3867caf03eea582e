"""Accelerator backends: one kernel registry per device type (cpu, triton, torch, reference, plugins).

    k = select_kernels("auto", torch.device("cuda"), torch.bfloat16)   # a Kernels set
    k.backends["paged_decode_attention"]                                # "triton"

See base.py (what a backend is), registry.py (how ``--kernels`` chooses per op), builtin.py and
triton_backend.py (the built-in sets), table.py (``adapt ops``).
"""

from __future__ import annotations

import torch

from adapt.runtime.backends.base import FLOATS, OPS, Backend, Impl
from adapt.runtime.backends.registry import (Choice, backends, choose, get_backend, names, plugin_errors,
                                             plugins)


def select_kernels(kernels: str, device: torch.device | str, dtype: torch.dtype):
    """The Kernels set for ``--kernels`` on ``device`` in ``dtype``: each op from the backend ``choose``
    picks (the shared configuration math from adapt.runtime.kernels), the backends set up; ``backends``
    on the result maps each op to its backend's name."""
    from adapt.runtime.kernels import Kernels, shared_functions

    dev = torch.device(device)
    picked = choose(kernels, dev.type, dtype)
    by_name = {b.name: b for b in backends()}
    for name in dict.fromkeys(c.backend for c in picked.values()):
        if by_name[name].setup is not None:
            by_name[name].setup()
    fns = {op: by_name[c.backend].ops[op].fn for op, c in picked.items()}
    impl = "auto" if kernels == "adapt" else kernels
    return Kernels(impl=impl, **fns, **shared_functions(), backends={op: c.backend for op, c in picked.items()})


def prepare_weights(kernels, model, device: torch.device, dtype: torch.dtype, **options) -> None:
    """Let every backend chosen for some op prepare the model's weights for its ops (packing, layouts)."""
    by_name = {b.name: b for b in backends()}
    ops: dict[str, list[str]] = {}
    for op, name in kernels.backends.items():
        ops.setdefault(name, []).append(op)
    for name, its in ops.items():
        b = by_name.get(name)
        if b is not None and b.prepare is not None:
            b.prepare(model, device, dtype, tuple(its), **options)


__all__ = ["FLOATS", "OPS", "Backend", "Choice", "Impl", "backends", "choose", "get_backend", "names",
           "plugin_errors", "plugins", "prepare_weights", "select_kernels"]
