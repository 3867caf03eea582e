"""How much memory the float32 CPU reference needs for a long prefill, and how much the host has free now."""

from __future__ import annotations

import os
from typing import Any


def available_memory() -> float:
    """Bytes free for a new allocation now (MemAvailable), else the physical memory, else unbounded."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return float(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        return float("inf")


def long_prefill_bytes(config: Any, length: int) -> float:
    """Peak extra bytes of a float32 transformers prefill of ``length`` tokens on CPU. Its attention (eager, and SDPA
    with the explicit causal mask it passes) materializes every head's scores, the mask and the softmax at once:
    3 x heads x L x L x 4 bytes. Measured on tiny-k2 (4 heads): 8K tokens +2.6 GB (formula 3.2), 16K +10.5 GB
    (formula 12.9); 32K would need ~52 GB, which killed `adapt validate dump` on a 24 GB host."""
    cfg = getattr(config, "text_config", None) or config
    heads = int(getattr(cfg, "num_attention_heads", 1) or 1)
    return 3.0 * heads * float(length) ** 2 * 4
