"""Model loading and runtime startup: manifest_verify, memory_vs_profile, staged_init.

Each asks a stage that lives elsewhere (``adapt.shard`` verify, ``adapt.profile`` memory estimate,
the runtime's own timings and byte counts) and is ``skip`` with the reason while that stage is absent.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from typing import Any

from adapt.validate.checklist import Outcome, Skip, register_check


def _find(module: str, *names: str):
    try:
        mod = importlib.import_module(module)
    except ImportError:
        return None
    for n in names:
        fn = getattr(mod, n, None)
        if callable(fn):
            return fn
    return None


def shard_verifier():
    """The shard stage's verify function, wherever it has landed; None while it has not."""
    return (_find("adapt.shard.verify", "verify_output", "verify_shard", "verify")
            or _find("adapt.shard", "verify_output", "verify_shard", "verify"))


def _problems(result: Any) -> list[str]:
    if result is None:
        return []
    if isinstance(result, (list, tuple)):
        return [str(x) for x in result]
    for attr in ("problems", "errors", "failures"):
        v = getattr(result, attr, None)
        if v is not None:
            return [x.line() if hasattr(x, "line") else str(x) for x in v]
    ok = getattr(result, "ok", None)
    return [] if ok in (None, True) else [str(result)]


@register_check("manifest_verify")
def manifest_verify(params: Mapping[str, Any], thresholds: Mapping[str, float], ctx) -> Outcome:
    if ctx.target.kind != "shard":
        raise Skip("TARGET is an HF checkpoint directory, not an `adapt shard` output: no manifest to verify")
    verify = shard_verifier()
    if verify is None:
        raise Skip("adapt.shard has no verify function yet")
    from adapt.errors import AdaptError

    try:
        src = ctx.reference.path if params.get("against_reference") and ctx.reference.kind == "transformers" else None
        problems = _problems(verify(ctx.target.path, src) if src is not None else verify(ctx.target.path))
    except AdaptError as e:
        problems = [str(e)]
    m = {"problems": len(problems)}
    if problems:
        return Outcome(m, status="fail", message="; ".join(problems[:5]))
    return Outcome(m, message="manifest digest, file checksums and sizes verified")


@register_check("memory_vs_profile")
def memory_vs_profile(params: Mapping[str, Any], thresholds: Mapping[str, float], ctx) -> Outcome:
    engine = ctx.target.engine
    if engine is None:
        raise Skip("measured memory comes from adapt's runtime, which did not run this target "
                   f"({ctx.target.reason or 'runtime ' + ctx.target.runtime})")
    from adapt.validate.profile_bridge import estimate_bytes, measured_bytes

    measured = measured_bytes(engine)
    est = estimate_bytes(ctx, engine)
    if est is None:
        raise Skip("adapt.profile has no memory estimate for this model yet")
    w, kv = float(measured.get("weights", 0)), float(measured.get("kv_cache", 0))
    m = {"measured_weights_bytes": w, "measured_kv_bytes": kv, "estimated_weights_bytes": est["weights"],
         "estimated_kv_bytes": est["kv_cache"]}
    total_est = est["weights"] + est["kv_cache"]
    m["measured_over_estimate"] = (w + kv) / total_est if total_est else float("inf")
    return Outcome(m, message=f"measured {(w + kv) / 2**20:.2f} MiB vs estimated {total_est / 2**20:.2f} MiB")


@register_check("staged_init")
def staged_init(params: Mapping[str, Any], thresholds: Mapping[str, float], ctx) -> Outcome:
    if ctx.target.engine is None:
        raise Skip("staged init times adapt's runtime, which did not run this target "
                   f"({ctx.target.reason or 'runtime ' + ctx.target.runtime})")
    stages = dict(ctx.target.stages)
    wanted = list(params.get("stages") or stages)
    missing = [s for s in wanted if s not in stages]
    m = {f"{k}_s": float(v) for k, v in stages.items()}
    m["total_s"] = float(sum(stages.values()))
    if missing:
        return Outcome(m, status="fail", message=f"stages not reported by the runtime: {', '.join(missing)}")
    return Outcome(m, message=", ".join(f"{k} {v:.3f}s" for k, v in stages.items()))
