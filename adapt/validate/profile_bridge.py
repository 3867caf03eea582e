"""The profile's memory estimate for what the runtime loaded: weights from the WeightLayout, KV from
``adapt.profile.memory`` for the runtime's KV capacity in tokens."""

from __future__ import annotations

from typing import Any


def estimate_bytes(ctx: Any, engine: Any) -> dict[str, float] | None:
    """{"weights": bytes, "kv_cache": bytes} estimated by adapt.profile, or None when it cannot say."""
    try:
        from adapt.profile import memory
    except ImportError:
        return None
    from adapt.layout import WeightLayout

    spec = getattr(engine, "spec", None)
    tokens = getattr(engine, "kv_capacity_tokens", None)
    if spec is None or tokens is None:
        return None
    layout = WeightLayout(spec) if not hasattr(WeightLayout, "for_spec") else WeightLayout.for_spec(spec)
    kv_dtype = str(getattr(engine, "kv_dtype", "bfloat16")).removeprefix("torch.")
    weights = float(sum(t.nbytes for t in layout.tensors if t.is_param))
    return {"weights": weights, "kv_cache": float(memory.kv_bytes_per_token(spec, kv_dtype) * tokens)}
