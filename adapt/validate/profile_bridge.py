"""Memory the runtime holds against the profile's estimate of it.

Measured: the bytes of every parameter and buffer of the engine's model plus its KV pool. Estimated:
the WeightLayout's parameters at the engine's dtype (``adapt.profile``'s weight bytes) plus
``adapt.profile.memory.kv_bytes_per_token`` times the pool's capacity in tokens.
"""

from __future__ import annotations

from typing import Any


def measured_bytes(engine: Any) -> dict[str, float]:
    model = engine.model
    w = sum(t.numel() * t.element_size() for t in list(model.parameters()) + list(model.buffers()))
    return {"weights": float(w), "kv_cache": float(engine.pool.total_bytes)}


def estimate_bytes(ctx: Any, engine: Any) -> dict[str, float] | None:
    """{"weights": bytes, "kv_cache": bytes} estimated by adapt.profile, or None when it cannot say."""
    try:
        from adapt.profile import memory
    except ImportError:
        return None
    from adapt.layout import WeightLayout

    spec = engine.spec
    itemsize = engine.dtype.itemsize
    weights = sum(t.numel * itemsize for t in WeightLayout.from_spec(spec).main() if t.is_param)
    pool = engine.pool
    kv_dtype = "int8" if pool.spec.quant == "int8" else str(pool.spec.dtype).removeprefix("torch.")
    tokens = pool.num_blocks * pool.block_size
    return {"weights": float(weights), "kv_cache": float(memory.kv_bytes_per_token(spec, kv_dtype) * tokens)}
