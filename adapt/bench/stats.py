"""Latency statistics of a load run: percentiles, SLO parsing, goodput."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from adapt.errors import AdaptError

SLO_KEYS = ("ttft", "itl", "tpot", "e2e")


class BenchInputError(AdaptError):
    """A bad bench serve argument (SLO spec, dataset file, endpoint URL)."""

    exit_code = 2


def percentile(xs: Sequence[float], q: float) -> float:
    """The q-th percentile (0-100) by linear interpolation between closest ranks (numpy's default)."""
    if not xs:
        return math.nan
    s = sorted(xs)
    pos = (len(s) - 1) * q / 100.0
    lo, hi = math.floor(pos), math.ceil(pos)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def summary(xs: Sequence[float]) -> dict[str, float]:
    """mean, p50, p90, p99 (NaN when there are none) and the sample count."""
    return {"mean": sum(xs) / len(xs) if xs else math.nan, "p50": percentile(xs, 50), "p90": percentile(xs, 90),
            "p99": percentile(xs, 99), "n": len(xs)}


def parse_slo(text: str | None) -> dict[str, float]:
    """``ttft=0.5,itl=0.05`` -> {"ttft": 0.5, "itl": 0.05} (seconds; keys ttft, itl, tpot, e2e)."""
    out: dict[str, float] = {}
    for part in (text or "").split(","):
        if not part.strip():
            continue
        k, sep, v = part.partition("=")
        k = k.strip()
        if not sep or k not in SLO_KEYS:
            raise BenchInputError(f"--slo {text!r}: each part is KEY=SECONDS with KEY one of {', '.join(SLO_KEYS)}")
        try:
            out[k] = float(v)
        except ValueError:
            raise BenchInputError(f"--slo {text!r}: {v.strip()!r} is not a number of seconds") from None
        if not out[k] > 0:
            raise BenchInputError(f"--slo {text!r}: {k} must be > 0 seconds")
    return out


def meets_slo(rec: dict[str, Any], slo: dict[str, float]) -> bool:
    """A completed request meets the SLO when its TTFT, TPOT and e2e are within bounds and every one of its
    inter-token latencies is (vLLM's goodput definition is per request, the same way)."""
    for k, bound in slo.items():
        if k == "itl":
            if any(x > bound for x in rec.get("itl", [])):
                return False
        elif rec.get(k) is not None and rec[k] > bound:
            return False
    return True
