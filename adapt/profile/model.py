"""profile_model: the compute and memory profile of a model on one accelerator.

Phases: ``prefill`` runs ``batch`` sequences of ``context`` tokens (logits only for the last position
of each, as generation needs); ``decode`` produces one token for each of ``batch`` sequences that
already hold ``context`` tokens. TTFT is the prefill's roofline time; TPOT one decode step's.
Identical layers are costed once per layer kind and copied, so a 61-layer model costs two layers.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from adapt.errors import AdaptError
from adapt.hardware import HardwareSpec
from adapt.layout import WeightLayout
from adapt.profile.attention import attention_rows
from adapt.profile.costs import Dtypes, linear, norm
from adapt.profile.memory import activation_peak_bytes, kv_bytes, kv_bytes_by_context, kv_bytes_per_token
from adapt.profile.mlp import mlp_rows
from adapt.profile.rows import ModuleRow, with_layer
from adapt.profile.vision import vision_rows
from adapt.profile.weights import weight_summary
from adapt.spec import ModelSpec, ceil_div

PHASES = ("prefill", "decode", "both")


@dataclass
class Profile:
    """A model's profile. ``modules`` holds every row; the dict form is the JSON contract."""

    model: dict
    hardware: dict
    settings: dict
    params: dict
    memory: dict
    modules: list[ModuleRow] = field(repr=False)
    totals: dict

    def rows(self, phase: str | None = None) -> list[ModuleRow]:
        return [r for r in self.modules if phase is None or r.phase == phase]

    def to_dict(self) -> dict:
        return {"model": self.model, "hardware": self.hardware, "settings": self.settings, "params": self.params,
                "memory": self.memory, "totals": self.totals, "modules": [r.as_dict() for r in self.modules]}


def _layer_rows(spec: ModelSpec, phase: str, batch: int, context: int, dt: Dtypes, absorb: bool) -> list[ModuleRow]:
    templates = {k: attention_rows(spec, phase, k, batch, context, dt, absorb) + mlp_rows(spec, phase, k, batch, context, dt)
                 for k in set(spec.layer_kinds)}
    prefix = "language_model.model.layers" if spec.family == "llava" else "layers"
    return [with_layer(r, i, prefix) for i, k in enumerate(spec.layer_kinds) for r in templates[k]]


def phase_rows(spec: ModelSpec, phase: str, batch: int, context: int, dt: Dtypes, absorb: bool = True) -> list[ModuleRow]:
    """Every row of one phase (prefill | decode), in execution order, before the roofline is applied."""
    h, v = spec.hidden_size, spec.vocab_size
    t = batch * (context if phase == "prefill" else 1)
    pre = "language_model.model." if spec.family == "llava" else ""
    emb = ModuleRow(f"{pre}embed_tokens", phase, "embedding", f"{pre}embed_tokens", None, "", 0.0, dt.plain(t * h),
                    0.0, t * h * dt.a, input_shape=(t,), output_shape=(t, h), compute_dtype=dt.act,
                    note=f"gathers {t} rows of the [{v}, {h}] table")
    rows = [emb] + _layer_rows(spec, phase, batch, context, dt, absorb)
    final = norm(f"{pre}norm", phase, "", batch, h, dt)  # only the positions whose logits are needed
    head = linear("language_model.lm_head" if pre else "lm_head", phase, "", batch, h, v, dt, quantizable=False,
                  op="lm_head", note=("tied to embed_tokens; " if spec.tie_word_embeddings else "")
                  + ("last position of each sequence" if phase == "prefill" else "one token per sequence"))
    if phase == "prefill":
        final.note = "last position of each sequence (the per-layer rows carry all positions)"
    return rows + [final, head]


def _totals(rows: list[ModuleRow], phase: str, batch: int, context: int) -> dict:
    flops = sum(r.flops for r in rows)
    time_s = sum(r.time_s for r in rows)
    out = {
        "flops": int(flops), "bytes": int(sum(r.bytes for r in rows)),
        "weight_bytes": int(sum(r.weight_bytes for r in rows)),
        "activation_bytes": int(sum(r.act_read_bytes + r.act_write_bytes for r in rows)),
        "kv_bytes": int(sum(r.kv_read_bytes + r.kv_write_bytes for r in rows)),
        "time_s": time_s,
        "memory_bound_time_s": sum(r.time_s for r in rows if r.bound == "memory"),
        "compute_bound_time_s": sum(r.time_s for r in rows if r.bound == "compute"),
        "num_modules": len(rows),
    }
    if phase == "prefill":
        out.update(tokens=batch * context, ttft_s=time_s, tokens_per_s=batch * context / time_s if time_s else 0.0)
    elif phase == "decode":
        out.update(tokens=batch, tpot_s=time_s, tokens_per_s=batch / time_s if time_s else 0.0,
                   flops_per_token=flops / batch)
    else:
        out.update(images=1, time_per_image_s=time_s)
    return out


def profile_model(spec: ModelSpec, hardware: HardwareSpec, phase: str = "both", batch: int = 1,
                  context: int = 4096, weights_dtype: str | None = None, kv_dtype: str = "bfloat16",
                  act_dtype: str = "bfloat16", mla_absorb: bool = True,
                  layout: WeightLayout | None = None) -> Profile:
    """Profile ``spec`` on ``hardware``.

    phase: prefill | decode | both. batch: sequences. context: tokens per sequence (prefill length;
    tokens already cached at decode). weights_dtype: None for the checkpoint's native dtype, else
    bfloat16 | float16 | float32 | fp8 | int8 | int4 for the quantizable matrices. mla_absorb: MLA
    decode in the weight-absorbed form (False: transformers' decompress-every-step form). layout: the
    full WeightLayout if the caller has one (else params and weight bytes come from a one-layer-per-kind
    layout, exactly equal and much faster).
    """
    if phase not in PHASES:
        raise AdaptError(f"--phase must be one of {', '.join(PHASES)}; got {phase!r}")
    if batch < 1 or context < 1:
        raise AdaptError(f"batch and context must be >= 1; got batch={batch} context={context}")
    dt = Dtypes.for_spec(spec, weights_dtype, kv_dtype, act_dtype)
    phases = ("prefill", "decode") if phase == "both" else (phase,)
    rows: list[ModuleRow] = []
    totals: dict = {}
    for ph in phases:
        rs = [r.roofline(hardware) for r in phase_rows(spec, ph, batch, context, dt, mla_absorb)]
        rows += rs
        totals[ph] = _totals(rs, ph, batch, context)
    if spec.vision is not None and "prefill" in phases:
        rs = [r.roofline(hardware) for r in vision_rows(spec, dt)]
        rows += rs
        totals["vision"] = _totals(rs, "vision", batch, context)
    ws = weight_summary(spec, dt.weights if weights_dtype else None, layout)
    p = ws.params
    params = dict(p.as_dict(), active_non_embedding=p.active - p.embedding)
    weights = ws.weights_bytes
    kv_ctx = kv_bytes(spec, context, batch, dt.kv)
    act = activation_peak_bytes(spec, batch, context, dt.act)
    need = weights + kv_ctx + act
    memory = {
        "weights_dtype": dt.weights, "kv_dtype": dt.kv, "act_dtype": dt.act,
        "weights_bytes": weights, "weights_bytes_mtp": ws.mtp_bytes,
        "kv_bytes_per_token": kv_bytes_per_token(spec, dt.kv), "kv_bytes_by_context": kv_bytes_by_context(spec, dt.kv),
        "kv_bytes_at_context": kv_ctx, "activation_peak_bytes": act, "total_bytes_at_context": need,
        "min_devices_for_memory": ceil_div(int(need), int(hardware.memory_bytes)),
    }
    model = {"name": spec.name, "model_type": spec.model_type, "family": spec.family,
             "text_model_type": spec.text_model_type, "num_layers": spec.num_layers, "hidden_size": spec.hidden_size,
             "vocab_size": spec.vocab_size, "attention": spec.attention.kind, "layer_kinds": {
                 k: spec.layer_kinds.count(k) for k in sorted(set(spec.layer_kinds))},
             "num_experts": spec.moe.num_experts if spec.moe else 0, "top_k": spec.moe.top_k if spec.moe else 0,
             "num_mtp_layers": spec.num_mtp_layers, "native_weight_dtype": spec.weight_dtype,
             "vision": spec.vision.kind if spec.vision else None}
    hw = {"name": hardware.name, "vendor": hardware.vendor, "memory_bytes": hardware.memory_bytes,
          "memory_bandwidth": hardware.memory_bandwidth, "flops": dict(hardware.flops),
          "ridge_point": {d: hardware.ridge_point(d) for d in sorted({dt.gemm_compute, dt.act})},
          "source": hardware.source}
    settings = {"phase": phase, "batch": batch, "context": context, "weights_dtype": dt.weights,
                "kv_dtype": dt.kv, "act_dtype": dt.act, "mla_decode": "absorbed" if mla_absorb else "decompressed"}
    return Profile(model, hw, settings, params, memory, rows, totals)
