"""Human-readable numbers for tables: SI prefixes for FLOPs, binary-free decimal bytes, seconds."""

from __future__ import annotations


def si(x: float | None, unit: str = "") -> str:
    """1.23e12 -> '1.23 T' (+ unit)."""
    if x is None:
        return "-"
    x = float(x)
    for p, s in ((1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "K")):
        if abs(x) >= p:
            return f"{x / p:.3g} {s}{unit}".rstrip()
    return f"{x:.3g} {unit}".rstrip()


def nbytes(x: float) -> str:
    """Bytes in decimal units: 70272 -> '70.3 KB'."""
    return si(x, "B")


def seconds(x: float) -> str:
    if x >= 1:
        return f"{x:.3g} s"
    if x >= 1e-3:
        return f"{x * 1e3:.3g} ms"
    if x >= 1e-6:
        return f"{x * 1e6:.3g} us"
    return f"{x * 1e9:.3g} ns"


def shape(s) -> str:
    return "[" + ", ".join(str(int(v)) for v in s) + "]"
