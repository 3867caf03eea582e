"""Collective bytes per step, and their comparison with the planner's estimate for the same plan.

Measured names are ``<collective>.<group>`` (DistributedContext); the planner
(adapt.profile.planner.comm.decode_collective_bytes) names kinds. Both count the bytes one rank sends
per step, ring all-reduce as ``2(n-1)/n x size``. Traffic the planner does not model is reported but not
compared: routing metadata of the all-to-all (``all_to_all_meta``) and the last stage's logits broadcast
to the other pp stages (``broadcast.pp``).
"""

from __future__ import annotations

PLANNER_KIND = {"all_reduce.tp": "tp_allreduce", "all_reduce.stage": "tp_allreduce",
                "all_gather.tp": "tp_allgather", "all_to_all.stage": "ep_alltoall", "send.pp": "pp_send"}
KINDS = ("tp_allreduce", "tp_allgather", "ep_alltoall", "pp_send")


def summarize_steps(steps: list[dict]) -> dict:
    """{kind: {"steps": n, "bytes_per_step": {collective: mean bytes}}} over the recorded steps."""
    out: dict = {}
    for st in steps:
        d = out.setdefault(st["kind"], {"steps": 0, "bytes": {}})
        d["steps"] += 1
        for name, n in st["bytes"].items():
            d["bytes"][name] = d["bytes"].get(name, 0) + n
    return {k: {"steps": d["steps"], "bytes_per_step": {n: v / d["steps"] for n, v in sorted(d["bytes"].items())}}
            for k, d in out.items()}


def compare_with_planner(spec, plan, rank: int, steps: list[dict], act_dtype: str) -> dict | None:
    """Measured vs estimated bytes per decode step of ``rank``, per planner kind, with their ratio.

    Each decode step is estimated with its own batch (sequences of this replica x dp), so finished
    sequences are accounted for. None when the planner's estimate is not available."""
    try:
        from adapt.profile.planner.comm import decode_collective_bytes
    except ImportError:
        return None
    dec = [s for s in steps if s["kind"] == "decode"]
    if not dec:
        return None
    meas = dict.fromkeys(KINDS, 0.0)
    est = dict.fromkeys(KINDS, 0.0)
    for st in dec:
        for name, n in st["bytes"].items():
            if name in PLANNER_KIND:
                meas[PLANNER_KIND[name]] += n
        e = decode_collective_bytes(spec, plan, st["batch"] * plan.dp, rank=rank, act_dtype=act_dtype).as_dict()
        for k in KINDS:
            est[k] += e[k]
    n = len(dec)
    meas_t, est_t = sum(meas.values()), sum(est.values())
    return {
        "decode_steps": n,
        "measured_per_step": {k: meas[k] / n for k in KINDS} | {"total": meas_t / n},
        "estimated_per_step": {k: est[k] / n for k in KINDS} | {"total": est_t / n},
        "ratio": {k: (meas[k] / est[k] if est[k] else (1.0 if not meas[k] else None)) for k in KINDS}
        | {"total": meas_t / est_t if est_t else (1.0 if not meas_t else None)},
    }
