"""The cluster and the workload a plan is searched for: parsed from CLI options or one ``--cluster`` YAML.

Cluster YAML (every key optional except ``hardware``; unknown keys are errors naming the field)::

    hardware: h200             # built-in name, a hardware YAML path, or an inline hardware mapping
    devices_per_node: 8        # default: the hardware's
    nodes: 2                   # use exactly this many nodes (all their devices)
    max_nodes: 8               # or: search every size up to this many nodes
    intra_node_bandwidth: 4.5e11   # bytes/s per device, one direction (default: the hardware's)
    inter_node_bandwidth: 5.0e10
    intra_node_latency_s: 3.0e-6
    inter_node_latency_s: 1.0e-5
    memory_utilization: 0.9    # fraction of device memory the plan may use
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any


from adapt.errors import HardwareError, PlanError
from adapt.fileio import read_yaml
from adapt.hardware import HardwareSpec, hardware_from_dict, load_hardware
from adapt.spec import normalize_dtype

CLUSTER_KEYS = ("hardware", "devices_per_node", "nodes", "max_nodes", "intra_node_bandwidth",
                "inter_node_bandwidth", "intra_node_latency_s", "inter_node_latency_s", "memory_utilization")
OBJECTIVES = ("min-devices", "latency", "throughput")


@dataclass(frozen=True)
class Cluster:
    """Devices and links. Bandwidths are bytes/s per device, one direction."""

    hardware: HardwareSpec
    devices_per_node: int
    nodes: int | None = 1  # exactly this many nodes; None: search up to max_nodes
    max_nodes: int | None = None
    intra_node_bandwidth: float = 0.0
    inter_node_bandwidth: float = 0.0
    intra_node_latency_s: float = 0.0
    inter_node_latency_s: float = 0.0
    memory_utilization: float = 0.9

    @property
    def usable_bytes(self) -> float:
        """Memory per device the plan may use: capacity x utilization (the rest is the reserve)."""
        return self.hardware.memory_bytes * self.memory_utilization

    def world_sizes(self) -> list[int]:
        """Device counts to search: all devices of ``nodes`` nodes, or with ``max_nodes`` every divisor of a
        node plus every whole number of nodes up to it."""
        dpn = self.devices_per_node
        if self.nodes is not None:
            return [self.nodes * dpn]
        small = [d for d in range(1, dpn) if dpn % d == 0]
        return small + [k * dpn for k in range(1, (self.max_nodes or 1) + 1)]

    def to_dict(self) -> dict[str, Any]:
        return {"hardware": self.hardware.name, "devices_per_node": self.devices_per_node, "nodes": self.nodes,
                "max_nodes": self.max_nodes, "intra_node_bandwidth": self.intra_node_bandwidth,
                "inter_node_bandwidth": self.inter_node_bandwidth,
                "intra_node_latency_s": self.intra_node_latency_s,
                "inter_node_latency_s": self.inter_node_latency_s, "memory_utilization": self.memory_utilization,
                "usable_bytes_per_device": self.usable_bytes}


@dataclass(frozen=True)
class Workload:
    """What the cluster must serve: ``concurrency`` sequences of ``context`` tokens resident at once."""

    context: int = 4096
    concurrency: int = 8
    weights_dtype: str | None = None  # None: the checkpoint's native dtype
    kv_dtype: str = "bfloat16"
    act_dtype: str = "bfloat16"  # activations and what collectives move
    max_ttft_s: float | None = None
    max_tpot_s: float | None = None
    objective: str = "min-devices"
    prefill_chunk: int = 8192  # chunked prefill: tokens per forward for activations (vLLM / SGLang default)
    include_mtp: bool = False  # load DeepSeek-V3 MTP layers (speculative decoding)

    def __post_init__(self):
        if self.context < 1 or self.concurrency < 1:
            raise PlanError(f"--context and --concurrency must be >= 1, got {self.context}, {self.concurrency}")
        if self.objective not in OBJECTIVES:
            raise PlanError(f"--objective must be one of {', '.join(OBJECTIVES)}; got {self.objective!r}")
        for k in ("max_ttft_s", "max_tpot_s"):
            v = getattr(self, k)
            if v is not None and v <= 0:
                raise PlanError(f"--{k.replace('_', '-')} must be positive, got {v}")
        object.__setattr__(self, "kv_dtype", normalize_dtype(self.kv_dtype))
        if self.weights_dtype is not None:
            object.__setattr__(self, "weights_dtype", normalize_dtype(self.weights_dtype))

    def to_dict(self) -> dict[str, Any]:
        return {"context": self.context, "concurrency": self.concurrency, "weights_dtype": self.weights_dtype,
                "kv_dtype": self.kv_dtype, "max_ttft_s": self.max_ttft_s, "max_tpot_s": self.max_tpot_s,
                "objective": self.objective, "include_mtp": self.include_mtp}


def _pos(v: Any, key: str, where: str, kind=float, upper: float | None = None) -> Any:
    if isinstance(v, str):  # YAML 1.1 reads 2.5e10 (no sign in the exponent) as a string
        try:
            v = float(v)
        except ValueError:
            pass
    ok = not isinstance(v, bool) and isinstance(v, (int, float)) and v > 0 and (kind is float or int(v) == v)
    if not ok or (upper is not None and v > upper):
        what = "a positive integer" if kind is int else "a positive number" + (f" <= {upper}" if upper else "")
        raise HardwareError(f"{where}: '{key}' must be {what}, got {v!r}")
    return kind(v)


def make_cluster(hardware: str | HardwareSpec | dict, devices_per_node: int | None = None, nodes: int | None = None,
                 max_nodes: int | None = None, intra_node_bandwidth: float | None = None,
                 inter_node_bandwidth: float | None = None, intra_node_latency_s: float | None = None,
                 inter_node_latency_s: float | None = None, memory_utilization: float = 0.9,
                 where: str = "cluster") -> Cluster:
    """A Cluster; link figures default to the hardware's. ``nodes`` and ``max_nodes`` exclude each other
    (neither: one node)."""
    if isinstance(hardware, dict):
        hw = hardware_from_dict(hardware, f"{where}: hardware")
    elif isinstance(hardware, HardwareSpec):
        hw = hardware
    elif isinstance(hardware, str):
        hw = load_hardware(hardware)
    else:
        raise HardwareError(f"{where}: 'hardware' must be a name, a file or a mapping, got {hardware!r}")
    if nodes is not None and max_nodes is not None:
        raise HardwareError(f"{where}: give 'nodes' (use exactly N nodes) or 'max_nodes' (search up to N), not both")
    def given(v, default):  # a value the caller gave, even 0 (then an error below), else the hardware's
        return default if v is None else v

    vals = dict(devices_per_node=given(devices_per_node, hw.devices_per_node),
                intra_node_bandwidth=given(intra_node_bandwidth, hw.intra_node_bandwidth or hw.memory_bandwidth / 4),
                inter_node_bandwidth=given(inter_node_bandwidth, hw.inter_node_bandwidth or 5e10),
                intra_node_latency_s=given(intra_node_latency_s, hw.intra_node_latency_s),
                inter_node_latency_s=given(inter_node_latency_s, hw.inter_node_latency_s))
    vals["devices_per_node"] = _pos(vals["devices_per_node"], "devices_per_node", where, int)
    for k in ("intra_node_bandwidth", "inter_node_bandwidth", "intra_node_latency_s", "inter_node_latency_s"):
        vals[k] = _pos(vals[k], k, where)
    if nodes is not None:
        nodes = _pos(nodes, "nodes", where, int)
    if max_nodes is not None:
        max_nodes = _pos(max_nodes, "max_nodes", where, int)
    util = _pos(memory_utilization, "memory_utilization", where, float, upper=1.0)
    if nodes is None and max_nodes is None:
        nodes = 1
    return Cluster(hw, nodes=nodes, max_nodes=max_nodes, memory_utilization=util, **vals)


def cluster_from_dict(d: Any, where: str = "cluster") -> Cluster:
    """Parse a cluster mapping strictly: an unknown key is an error naming it."""
    if not isinstance(d, dict):
        raise HardwareError(f"{where}: expected a mapping of {', '.join(CLUSTER_KEYS)}")
    unknown = sorted(set(d) - set(CLUSTER_KEYS))
    if unknown:
        raise HardwareError(f"{where}: unknown key {unknown[0]!r} (allowed: {', '.join(CLUSTER_KEYS)})")
    if "hardware" not in d:
        raise HardwareError(f"{where}: missing required key 'hardware'")
    return make_cluster(where=where, **d)


def load_cluster(path: str | Path, **overrides: Any) -> Cluster:
    """Read a cluster YAML; CLI options given alongside (not None) override its keys."""
    p = Path(path)
    data = read_yaml(p, HardwareError, "cluster")
    c = cluster_from_dict(data, str(p))
    over = {k: v for k, v in overrides.items() if v is not None}
    if not over:
        return c
    d = dict(data)
    if "nodes" in over:
        d.pop("max_nodes", None)
    if "max_nodes" in over:
        d.pop("nodes", None)
    d.update(over)
    return cluster_from_dict(d, str(p))


__all__ = ["Cluster", "Workload", "make_cluster", "cluster_from_dict", "load_cluster", "OBJECTIVES", "replace"]
