"""Byte sizes as users type them: '5GB', '500MiB', '20KB', '2g' or a plain byte count."""

from __future__ import annotations

import math

# decimal (KB = 1000), binary (KiB = 1024), and the bare letters as binary (k, m, g, t, as docker and -Xmx read them)
_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40,
          "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


def size_number(text: str | int | float) -> tuple[float, str] | None:
    """(number, lower-case unit) of a size such as '2.5GiB', or None when it is not a positive finite number
    followed by a known unit."""
    s = str(text).strip().lower().replace(" ", "")
    num = s.rstrip("abcdefghijklmnopqrstuvwxyz")
    unit = s[len(num):]
    try:
        x = float(num)
    except ValueError:
        return None
    if unit not in _UNITS or not math.isfinite(x) or x <= 0:
        return None
    return x, unit


def parse_bytes(text: str | int | float) -> int | None:
    """Bytes of a size such as '5GB' or '500MiB' (at least 1), or None when it is not one."""
    got = size_number(text)
    if got is None:
        return None
    n = int(got[0] * _UNITS[got[1]])
    return n if n >= 1 else None
