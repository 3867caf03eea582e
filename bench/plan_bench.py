"""Time `adapt plan`'s search of every layout of Kimi-K2 up to 64 devices (8 nodes x 8 H200).

Prints JSON: the time from the config to the ranked result (spec, 140k-row layout, grouping, every layout),
the count of layouts, and as the peer the literal ``rank_tensors`` sum for one layout's 64 ranks, which the
closed form replaces (measured in the same run). Median of 3 runs after a warm-up of the imports.
"""

from __future__ import annotations

import json
import platform
import statistics
import sys
import time
from pathlib import Path

from adapt.plan import ParallelPlan, layout_of, layer_costs
from adapt.profile.planner import Workload, make_cluster, search
from adapt.profile.planner import weights as W
from adapt.spec import ModelSpec

CONFIG = Path(sys.argv[1] if len(sys.argv) > 1 else str(Path(__file__).resolve().parents[1].parent / "shared" / "configs" / "moonshotai__Kimi-K2-Instruct.json"))


def _clear():
    for f in (layout_of, layer_costs, W.layout_groups):
        f.cache_clear()


def once():
    _clear()
    t = time.perf_counter()
    spec = ModelSpec.from_hf_config(json.loads(CONFIG.read_text()), name=CONFIG.stem)
    res = search(spec, make_cluster("h200", max_nodes=8), Workload(context=32768, concurrency=64))
    return time.perf_counter() - t, res, spec


def main():
    runs = [once() for _ in range(3)]
    secs = statistics.median(r[0] for r in runs)
    _, res, spec = runs[-1]
    rec = res.recommended
    plan = ParallelPlan.build(spec, 8, 1, 8, 8, devices_per_node=8)
    layout = layout_of(spec)
    t = time.perf_counter()
    literal = [W.reference_rank_bytes(layout, plan, r, None) for r in range(0, 64, 8)]
    peer = (time.perf_counter() - t) * 8  # 8 of 64 ranks measured, scaled to the layout's 64 ranks
    places = W.per_layer(spec, 8, 8, 8, None)
    closed = W.stage_weights(spec, places, (0, spec.num_layers), True, True).bytes
    print(json.dumps({
        "bench": "plan_search", "model": CONFIG.stem, "max_devices": 64, "hardware": "H200 SXM",
        "search_s": round(secs, 3), "layouts": len(res.candidates) + len(res.rejected),
        "fits": len(res.candidates), "rejected": len(res.rejected),
        "recommended": rec.label if rec else None,
        "peer_rank_tensors_one_layout_s": round(peer, 3),
        "ratio_search_all_vs_peer_one_layout": round(secs / peer, 3),
        "closed_form_equals_literal": all(abs(x - closed) < 1e-6 * closed for x in literal),
        "limit_s": 5.0, "ok": secs < 5.0,
        "python": platform.python_version(), "machine": platform.machine(), "cpu": platform.processor(),
    }, indent=2))


if __name__ == "__main__":
    main()
