"""The registry of backends and the per-op choice for a device and dtype.

``choose(kernels, device_type, dtype)`` returns a ``Choice`` per op: the backend that runs it, the
backends that could (``candidates``, best first) and whether it fell back to the plain-torch form.
``kernels``: "auto" takes each op from the highest-priority backend offering it for the device and dtype;
a backend's name takes every op it offers from it and the rest from ``torch``; "reference" is the twins.
Plugins come from the ``adapt.backends`` entry-point group (importlib.metadata), loaded on first use.
"""

from __future__ import annotations

from dataclasses import dataclass
from importlib import metadata

import torch

from adapt.errors import RuntimeConfigError
from adapt.runtime.backends.base import OPS, Backend

GROUP = "adapt.backends"
ALIASES = {"adapt": "auto"}  # the flag's value before backends existed: the best kernels for the device
_plugins: list[Backend] | None = None
_plugin_errors: list[str] = []


@dataclass(frozen=True)
class Choice:
    op: str
    backend: str
    form: str
    candidates: tuple[str, ...]
    fallback: bool


def builtins() -> list[Backend]:
    from adapt.runtime.backends.builtin import CPU, REFERENCE, TORCH
    from adapt.runtime.backends.triton_backend import TRITON

    return [TRITON, CPU, TORCH, REFERENCE]


def plugins(refresh: bool = False) -> list[Backend]:
    """The backends registered by installed packages (entry-point group ``adapt.backends``). A plugin that
    fails to load is left out and its error kept for ``plugin_errors()``."""
    global _plugins
    if _plugins is not None and not refresh:
        return _plugins
    found, _plugin_errors[:] = [], []
    taken = {b.name for b in builtins()}
    for ep in metadata.entry_points(group=GROUP):
        where = f"{ep.name} = {ep.value}" + (f" ({ep.dist.name} {ep.dist.version})" if ep.dist else "")
        try:
            obj = ep.load()
            b = obj if isinstance(obj, Backend) else obj()
            if not isinstance(b, Backend):
                raise TypeError(f"gave {type(b).__name__}, not an adapt.runtime.backends.Backend")
        except Exception as e:  # a broken plugin must not take the runtime down: it is reported instead
            _plugin_errors.append(f"backend plugin {where}: {type(e).__name__}: {e}")
            continue
        if b.name in taken or b.name in ALIASES or b.name == "auto":
            _plugin_errors.append(f"backend plugin {where}: the name {b.name!r} is taken")
            continue
        taken.add(b.name)
        if b.origin == "built-in":
            b.origin = f"plugin {ep.dist.name} {ep.dist.version}" if ep.dist else f"plugin {ep.value}"
        found.append(b)
    _plugins = found
    return found


def plugin_errors() -> list[str]:
    plugins()
    return list(_plugin_errors)


def backends(refresh: bool = False) -> list[Backend]:
    """Every backend, best first (by priority)."""
    return sorted(builtins() + plugins(refresh), key=lambda b: -b.priority)


def get_backend(name: str) -> Backend | None:
    return next((b for b in backends() if b.name == name), None)


def names() -> list[str]:
    return ["auto"] + [b.name for b in backends()]


def choose(kernels: str, device_type: str, dtype: torch.dtype, ops=OPS) -> dict[str, Choice]:
    """The backend of every op in ``ops`` for ``kernels`` on ``device_type`` in ``dtype``; one-line
    RuntimeConfigError for an unknown name or a backend that cannot run there."""
    kernels = ALIASES.get(kernels, kernels)
    every = backends()
    usable = [b for b in every if b.unavailable(device_type, dtype) is None]
    if kernels != "auto":
        b = next((x for x in every if x.name == kernels), None)
        if b is None:
            raise RuntimeConfigError(f"--kernels must be one of {', '.join(names())}; got {kernels!r}")
        why = b.unavailable(device_type, dtype)
        if why is not None:
            raise RuntimeConfigError(f"--kernels {kernels}: unavailable on {device_type} in "
                                     f"{str(dtype).replace('torch.', '')}: {why}")
    torch_ = next(x for x in every if x.name == "torch")
    out = {}
    for op in ops:
        cands = tuple(b.name for b in usable if b.offers(op, dtype) and b.name != "reference")
        if kernels == "auto":
            picks = [b for b in usable if b.offers(op, dtype) and _auto(b, device_type)]
            pick = picks[0] if picks else torch_
        else:
            pick = b if b.offers(op, dtype) else torch_
        out[op] = Choice(op, pick.name, pick.ops[op].form, cands, pick.name == "torch" and kernels != "torch")
    return out


def _auto(b: Backend, device_type: str) -> bool:
    allowed = b.auto_devices if b.auto_devices is not None else b.devices
    return "*" in allowed or device_type in allowed
