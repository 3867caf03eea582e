"""ModuleRow: one module in one phase, with its FLOPs, bytes and roofline verdict.

Roofline (Williams, Waterman, Patterson, CACM 2009): a kernel doing F FLOPs and moving Q bytes takes
at least max(F / peak, Q / bandwidth); its arithmetic intensity I = F / Q is compared with the ridge
point peak / bandwidth: below it the kernel is memory-bound, above it compute-bound. Each row is one
kernel-sized piece of work; rows run one after another (no overlap between rows is modelled).
"""

from __future__ import annotations

from dataclasses import dataclass

from adapt.hardware import HardwareSpec

OPS = ("gemm", "attention", "norm", "rope", "router", "expert_gemm", "embedding", "lm_head")


@dataclass(slots=True)
class ModuleRow:
    """FLOPs and bytes of one module in one phase. Byte fields are split by what is moved."""

    name: str  # e.g. layers.3.mlp.experts
    phase: str  # prefill | decode | vision
    op: str  # one of OPS
    module: str  # name without the layer prefix: mlp.experts
    layer: int | None
    layer_kind: str  # dense | moe | "" (embedding, final norm, lm_head) | vision
    flops: float
    weight_bytes: float = 0.0  # weights read (MoE: only the experts a batch is expected to touch)
    act_read_bytes: float = 0.0
    act_write_bytes: float = 0.0
    kv_read_bytes: float = 0.0
    kv_write_bytes: float = 0.0
    input_shape: tuple = ()
    output_shape: tuple = ()
    compute_dtype: str = "bfloat16"
    note: str = ""
    intensity: float = 0.0
    bound: str = ""  # memory | compute
    time_s: float = 0.0

    @property
    def bytes(self) -> float:
        return (self.weight_bytes + self.act_read_bytes + self.act_write_bytes + self.kv_read_bytes
                + self.kv_write_bytes)

    def roofline(self, hw: HardwareSpec) -> "ModuleRow":
        """Fill intensity, bound and time_s against ``hw`` (in place; returns self)."""
        peak = hw.peak_flops(self.compute_dtype)
        nbytes = self.bytes
        self.intensity = self.flops / nbytes if nbytes else float("inf")
        self.bound = "compute" if self.intensity >= peak / hw.memory_bandwidth else "memory"
        self.time_s = max(self.flops / peak, nbytes / hw.memory_bandwidth)
        return self

    def as_dict(self) -> dict:
        return {
            "name": self.name, "phase": self.phase, "op": self.op, "module": self.module, "layer": self.layer,
            "layer_kind": self.layer_kind, "flops": int(self.flops), "bytes": int(self.bytes),
            "weight_bytes": int(self.weight_bytes), "act_read_bytes": int(self.act_read_bytes),
            "act_write_bytes": int(self.act_write_bytes), "kv_read_bytes": int(self.kv_read_bytes),
            "kv_write_bytes": int(self.kv_write_bytes), "input_shape": list(self.input_shape),
            "output_shape": list(self.output_shape), "compute_dtype": self.compute_dtype,
            "intensity": self.intensity if self.intensity != float("inf") else None, "bound": self.bound,
            "time_s": self.time_s, "note": self.note,
        }


def with_layer(row: ModuleRow, layer: int, prefix: str = "layers") -> ModuleRow:
    """A copy of a layer-template row placed at decoder layer ``layer``."""
    return ModuleRow(f"{prefix}.{layer}.{row.module}", row.phase, row.op, row.module, layer, row.layer_kind,
                     row.flops, row.weight_bytes, row.act_read_bytes, row.act_write_bytes, row.kv_read_bytes,
                     row.kv_write_bytes, row.input_shape, row.output_shape, row.compute_dtype, row.note,
                     row.intensity, row.bound, row.time_s)
