"""What a backend is: a named kernel set for one or more device types.

A backend maps op names (the fields of ``adapt.runtime.kernels.Kernels``, listed in ``OPS``) to
implementations. It may offer any subset of the ops: the runtime takes each op from the best backend
that offers it for the device and dtype and falls back, op by op, to the plain-torch forms (backend
``torch``), which run anywhere. A backend may also prepare the model's weights for its kernels once
they are loaded (``prepare``: packing, per-device layouts) and set itself up when chosen (``setup``:
building or loading native code).

Vendor packages register one through the ``adapt.backends`` entry-point group; the entry point names
a ``Backend`` or a no-argument callable returning one (see README, "Writing a backend plugin").
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import torch

# the ops a backend may implement: every kernel with a reference twin (adapt/runtime/kernels/__init__.py)
OPS = ("varlen_attention", "paged_decode_attention", "write_kv_cache", "mla_prefill", "mla_decode", "write_mla_cache",
       "rms_norm", "fused_add_rms_norm", "apply_rope", "softmax_topk", "router_softmax_topk", "deepseek_v2_topk",
       "sigmoid_grouped_topk", "moe_experts", "moe_experts_fused", "moe_experts_packed", "moe_experts_tiled",
       "linear_tiled", "quantize_int8", "dequantize_int8", "silu_and_mul")
FLOATS = frozenset({torch.float32, torch.bfloat16, torch.float16})


@dataclass(frozen=True)
class Impl:
    """One implementation of an op: the function (the twin's signature), the dtypes it computes in, and
    a few words on what it is (``form``: "C++ fused", "triton", "torch", ...), which ``adapt ops`` shows."""

    fn: Callable
    dtypes: frozenset = FLOATS
    form: str = ""


def as_impl(x, form: str = "") -> Impl:
    """An Impl, or a bare callable taken as one for every floating dtype (what a plugin may give)."""
    if isinstance(x, Impl):
        return x
    if not callable(x):
        raise TypeError(f"an op implementation must be callable or an Impl, got {type(x).__name__}")
    return Impl(x, FLOATS, form)


@dataclass
class Backend:
    """A named kernel set. ``devices``: the torch device types it runs on ("*": every one). ``priority``:
    ``auto`` takes each op from the highest-priority backend that offers it (plugins default above the
    built-ins). ``auto_devices``: the device types ``auto`` may pick it on (None: all of ``devices``).
    ``probe(device_type, dtype)``: None when it can run there, else the reason in a few words.
    ``setup()``: called once when chosen for at least one op. ``prepare(model, device, dtype, ops)``:
    called after the weights are loaded with the ops it was chosen for; returns nothing."""

    name: str
    ops: Mapping[str, Impl]
    devices: tuple[str, ...] = ("*",)
    priority: int = 100
    auto_devices: tuple[str, ...] | None = None
    probe: Callable[[str, torch.dtype], str | None] | None = None
    setup: Callable[[], None] | None = None
    prepare: Callable | None = None
    origin: str = "built-in"
    description: str = ""
    extra: dict = field(default_factory=dict)

    def __post_init__(self):
        unknown = sorted(set(self.ops) - set(OPS))
        if unknown:
            raise ValueError(f"backend {self.name!r} names unknown ops: {', '.join(unknown)} (known: {', '.join(OPS)})")
        self.ops = {k: as_impl(v, self.name) for k, v in self.ops.items()}

    def serves(self, device_type: str) -> bool:
        return "*" in self.devices or device_type in self.devices

    def unavailable(self, device_type: str, dtype: torch.dtype) -> str | None:
        """None when this backend can run on ``device_type`` in ``dtype``, else why not (one line)."""
        if not self.serves(device_type):
            return f"runs on {', '.join(self.devices)}, not {device_type}"
        return self.probe(device_type, dtype) if self.probe is not None else None

    def offers(self, op: str, dtype: torch.dtype) -> bool:
        impl = self.ops.get(op)
        return impl is not None and dtype in impl.dtypes
