"""Time `adapt profile` of Kimi-K2 (both phases, JSON document) end to end in the library.

Each run: read the config, parse the ModelSpec, profile prefill and decode (params and weight bytes
from a one-layer-per-kind layout), serialize the JSON document. The peer measured in the same run is
what a stage pays to build Kimi-K2's full WeightLayout (139,583 tensors). Prints JSON; the acceptance
bound is 2 s.
"""

from __future__ import annotations

import json
import platform
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from adapt.cli.output import to_json  # noqa: E402
from adapt.hardware import load_hardware  # noqa: E402
from adapt.layout import WeightLayout  # noqa: E402
from adapt.profile import profile_model  # noqa: E402
from adapt.source import resolve_model  # noqa: E402

CONFIG = Path(__file__).resolve().parents[1].parent / "shared" / "configs" / "moonshotai__Kimi-K2-Instruct.json"
RUNS = 5


def _profile() -> int:
    spec = resolve_model(str(CONFIG)).spec()
    prof = profile_model(spec, load_hardware("h100-sxm"), phase="both", batch=1, context=4096)
    return len(to_json(prof.to_dict()))


def _layout() -> int:
    return len(WeightLayout.from_spec(resolve_model(str(CONFIG)).spec()))


def _median(fn) -> tuple[float, int]:
    fn()  # warm-up (imports, caches)
    times, out = [], 0
    for _ in range(RUNS):
        t = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times), out


def main() -> None:
    t_prof, nbytes = _median(_profile)
    t_layout, ntensors = _median(_layout)
    import torch

    print(json.dumps({
        "benchmark": "profile Kimi-K2-Instruct, both phases, JSON", "runs": RUNS,
        "median_s": round(t_prof, 4), "limit_s": 2.0, "ok": t_prof < 2.0, "json_bytes": nbytes,
        "peer": "spec + full WeightLayout build", "peer_median_s": round(t_layout, 4), "layout_tensors": ntensors,
        "ratio_to_peer": round(t_prof / t_layout, 3),
        "python": platform.python_version(), "torch": torch.__version__, "machine": platform.machine(),
        "processor": platform.processor() or platform.machine(),
    }, indent=2))


if __name__ == "__main__":
    main()
