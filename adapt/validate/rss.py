"""Resident memory of this process, measured: the baseline at a start and the peak since (Linux /proc).

The peak is the kernel's high-water mark (``VmHWM``), reset at ``reset_peak`` by writing 5 to
``/proc/self/clear_refs`` where the kernel allows it; elsewhere it is ``getrusage``'s lifetime peak, and the
record says so (``peak_since_reset``: false).
"""

from __future__ import annotations

import resource
import sys


def _status(field: str) -> int | None:
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def rss_bytes() -> int | None:
    """Resident set size now (None off Linux)."""
    return _status("VmRSS")


def peak_rss_bytes() -> int:
    """Peak resident set size: VmHWM, else getrusage's lifetime peak."""
    hwm = _status("VmHWM")
    if hwm is not None:
        return hwm
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * 1024)


class MemoryMeter:
    """Baseline and peak resident memory of one measured stretch."""

    def __init__(self):
        self.baseline = rss_bytes() or 0
        self.reset = False

    def reset_peak(self) -> None:
        self.baseline = rss_bytes() or 0
        try:
            with open("/proc/self/clear_refs", "w", encoding="ascii") as f:
                f.write("5")
            self.reset = True
        except OSError:
            self.reset = False

    def as_dict(self) -> dict:
        return {"baseline_bytes": self.baseline, "peak_bytes": peak_rss_bytes(), "peak_since_reset": self.reset}
