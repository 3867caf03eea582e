"""HardwareSpec: an accelerator's peak FLOP/s per dtype, memory, bandwidths, with the source noted.

Specs are YAML files in ``adapt/profile/hardware/`` (one per accelerator); ``--hardware`` takes one of
their names or the path of a user's own file (see ``template.yaml`` there).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


from adapt.errors import HardwareError
from adapt.fileio import read_yaml

HARDWARE_DIR = Path(__file__).parent / "profile" / "hardware"
_REQUIRED = ("name", "memory_bytes", "memory_bandwidth", "flops", "source")
_ALLOWED = set(_REQUIRED) | {"vendor", "intra_node_bandwidth", "inter_node_bandwidth", "intra_node_latency_s",
                             "inter_node_latency_s", "devices_per_node", "notes", "aliases"}


@dataclass(frozen=True)
class HardwareSpec:
    """One accelerator. Bandwidths are bytes/s (one direction, per device); flops are dense FLOP/s."""

    name: str
    memory_bytes: float
    memory_bandwidth: float
    flops: dict[str, float] = field(hash=False)  # dtype name -> dense peak FLOP/s
    source: str = ""
    vendor: str = ""
    intra_node_bandwidth: float = 0.0
    inter_node_bandwidth: float = 0.0
    intra_node_latency_s: float = 5e-6
    inter_node_latency_s: float = 1e-5
    devices_per_node: int = 8
    notes: str = ""

    def peak_flops(self, dtype: str) -> float:
        """Peak dense FLOP/s for a compute dtype; fp8 falls back to bf16 where the device has no fp8."""
        for key in (dtype, {"float8_e4m3fn": "bfloat16", "int8": "bfloat16"}.get(dtype, "bfloat16"), "bfloat16"):
            if key in self.flops:
                return self.flops[key]
        raise HardwareError(f"{self.name}: no peak FLOP/s for {dtype}")

    def ridge_point(self, dtype: str) -> float:
        """Arithmetic intensity (FLOP/byte) where the roofline turns from memory- to compute-bound."""
        return self.peak_flops(dtype) / self.memory_bandwidth


def _num(d: dict, key: str, where: str) -> float:
    v = d.get(key)
    if isinstance(v, str):  # YAML 1.1 (PyYAML) reads 1e12 and 6.7e13 (no exponent sign) as strings
        try:
            v = float(v.replace("_", ""))
        except ValueError:
            pass
    if isinstance(v, bool) or not isinstance(v, (int, float)) or v <= 0:
        raise HardwareError(f"{where}: '{key}' must be a positive number, got {v!r}")
    return float(v)


def hardware_from_dict(d: Any, where: str) -> HardwareSpec:
    """Check and build a HardwareSpec; errors name the file and the field."""
    if not isinstance(d, dict):
        raise HardwareError(f"{where}: expected a mapping")
    unknown = sorted(set(d) - _ALLOWED)
    if unknown:
        raise HardwareError(f"{where}: unknown key {unknown[0]!r} (allowed: {', '.join(sorted(_ALLOWED))})")
    for k in _REQUIRED:
        if k not in d:
            raise HardwareError(f"{where}: missing required key {k!r}")
    flops = d["flops"]
    if not isinstance(flops, dict) or not flops:
        raise HardwareError(f"{where}: 'flops' must map dtype names to FLOP/s")
    flops = {str(k): _num(flops, k, f"{where} flops") for k in flops}
    opt = {}
    for k in ("intra_node_bandwidth", "inter_node_bandwidth", "intra_node_latency_s", "inter_node_latency_s"):
        if k in d:
            opt[k] = _num(d, k, where)
    if "devices_per_node" in d:
        opt["devices_per_node"] = int(_num(d, "devices_per_node", where))
    return HardwareSpec(name=str(d["name"]), memory_bytes=_num(d, "memory_bytes", where),
                        memory_bandwidth=_num(d, "memory_bandwidth", where), flops=flops, source=str(d["source"]),
                        vendor=str(d.get("vendor", "")), notes=str(d.get("notes", "")), **opt)


def _load_file(path: Path) -> HardwareSpec:
    return hardware_from_dict(read_yaml(path, HardwareError, "hardware"), str(path))


def list_hardware() -> list[HardwareSpec]:
    """Every built-in hardware spec, sorted by name."""
    return sorted((_load_file(p) for p in HARDWARE_DIR.glob("*.yaml") if p.name != "template.yaml"),
                  key=lambda h: h.name)


def load_hardware(name_or_path: str) -> HardwareSpec:
    """A built-in spec by name (case-insensitive, file stem or name) or a user's YAML file."""
    p = Path(name_or_path).expanduser()
    if p.suffix in (".yaml", ".yml") or p.is_file():
        if not p.is_file():
            raise HardwareError(f"hardware file {p} does not exist")
        return _load_file(p)
    key = name_or_path.lower().replace("_", "-").replace(" ", "-")
    for f in HARDWARE_DIR.glob("*.yaml"):
        if f.name == "template.yaml":
            continue
        if f.stem.lower() == key:
            return _load_file(f)
    for h in list_hardware():
        if h.name.lower().replace(" ", "-") == key:
            return h
    names = ", ".join(f.stem for f in sorted(HARDWARE_DIR.glob("*.yaml")) if f.name != "template.yaml")
    raise HardwareError(f"unknown hardware {name_or_path!r}; built-in: {names}; or pass a YAML file")
