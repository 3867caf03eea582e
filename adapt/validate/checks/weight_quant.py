"""weight_quant_impact: a quantized checkpoint (ModelSpec.quant: fp8 blocks, compressed-tensors int8 / int4)
against the same model unquantized.

Baseline, chosen from the reference's config.json before anything else: the unquantized source when
``--reference`` is one (no ``quantization_config``), which measures what the rounding costs. When the reference
is the quantized checkpoint itself (transformers reading the format, or, where transformers cannot, the
checkpoint dequantized at load by adapt: reference.py), or a golden directory (then adapt's runtime loads the
target with ``--weights-dtype`` of the validated dtype), both sides hold the same rounded values, so the item
measures the quantized kernels and not the rounding, and says so.

Metrics over the checklist's prompts (prefill logits, position p predicting the token at p + 1): next-token
KL(baseline || target), the perplexity delta, and top-1 agreement on the positions where the baseline's top-1
leads its second by at least ``top1_margin`` nats (a near tie flips under any rounding; agreement over every
position is reported beside it). Per hooked output (``layer_names``), in execution order, the relative error
against the baseline and its growth: that error over what its inputs and its own weights can explain,
``rel_err / (input rel_err + expected weight error + noise floor)``. The expected weight error is what round
to nearest on the held grid costs (validate/quant_error.py; zero against the dequantized self), the floor the
validated dtype's kernel noise. The first output whose growth exceeds ``layer_growth_max`` is
``first_broken_layer``: a broken scale shows there, where the next-token metrics only say that something broke.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from adapt.validate import compare
from adapt.validate.checklist import Outcome, Skip, apply_thresholds, register_check
from adapt.validate.quant_error import expected_errors
from adapt.validate.target import layer_names

_WEIGHTS_DTYPE = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}
NOISE_FLOOR = {"float32": 1e-5, "bfloat16": 1.6e-2, "float16": 2e-3}  # the checklist's params override these


def _quant_label(q: Any) -> str:
    if q.method == "fp8":
        return f"fp8 {q.block_size[0]}x{q.block_size[1]} blocks"
    if q.bits == 4:
        return f"int4 {'g' + str(q.group_size) if q.group_size else 'per channel'}"
    return "int8 per channel"


def reference_is_quantized(ref: Any) -> bool | None:
    """Whether the reference checkpoint's config.json has a quantization_config (None: not a checkpoint)."""
    path = getattr(ref, "path", None)
    cfg = Path(path) / "config.json" if path is not None else None
    if getattr(ref, "kind", "") != "transformers" or cfg is None or not cfg.is_file():
        return None
    try:
        return "quantization_config" in json.loads(cfg.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError):
        return None


class _Baseline:
    """prefill_logits / layer_outputs of the unquantized side, and what it is."""

    def __init__(self, ctx):
        ref = ctx.reference
        quantized = reference_is_quantized(ref)
        if quantized is False:
            self.kind, self.what = "source", f"the unquantized --reference ({ref.description})"
            self.logits, self.layers = ref.logits, ref.layers
            return
        self.kind = "dequantized"
        tail = "so this measures the quantized kernels, not the rounding: give --reference SOURCE for that"
        if quantized:  # transformers on the same checkpoint: the same rounded values, in float
            why = ref.dequantized_because
            how = (f"dequantized at load by adapt, since transformers could not load it quantized ({why})" if why
                   else "as transformers reads the format")
            self.what = f"the same checkpoint as --reference, {how}; {tail}"
            self.logits, self.layers = ref.logits, ref.layers
            return
        wdt = _WEIGHTS_DTYPE.get(ctx.dtype)
        if wdt is None:
            raise Skip(f"the dequantized baseline runs in float32 / bfloat16 / float16, not {ctx.dtype}")
        if not getattr(ref, "has_layers", True):
            raise Skip("the reference is not the unquantized source and keeps no layer outputs")
        from adapt.runtime.engine import Engine
        from adapt.validate.engine_runner import CPU_KV_BYTES, EngineRunner

        dev = str(ctx.target.engine.device)
        base = ctx.memo(("weight_quant_baseline",), lambda: Engine.from_pretrained(
            ctx.target.path, device=dev, dtype=ctx.dtype, weights_dtype=wdt,
            kv_cache_memory=CPU_KV_BYTES if dev.startswith("cpu") else None))
        run = EngineRunner(base, "dequantized")
        self.what = (f"the checkpoint dequantized at load by adapt's runtime (--weights-dtype {wdt}; the reference "
                     f"is a golden directory, not the source), {tail}")
        self.logits = lambda i: ctx.memo(("wq_logits", i), lambda: run.prefill_logits(ctx.prompts[i]))
        self.layers = lambda i: ctx.memo(("wq_layers", i), lambda: run.layer_outputs(ctx.prompts[i]))


def _rel(t: torch.Tensor, r: torch.Tensor) -> float:
    t, r = t.double(), r.double()
    n = float(r.norm())
    return float((t - r).norm()) / n if n > 0 else float((t - r).norm())


def _inputs(name: str, num_layers: int) -> tuple[list[str], tuple[int, str] | None]:
    """(the hooked outputs whose error flows into ``name``, the (layer, sub-module) whose weights it applies)."""
    if name == "embedding":
        return [], None
    if name == "final_norm":
        return [f"layers.{num_layers - 1}"], None
    parts = name.split(".")
    i = int(parts[1])
    prev = f"layers.{i - 1}" if i else "embedding"
    sub = parts[2] if len(parts) > 2 else None
    return {"input_norm": ([prev], None), "attention": ([f"layers.{i}.input_norm"], (i, "attention")),
            "post_attention_norm": ([prev, f"layers.{i}.attention"], None),
            "mlp": ([f"layers.{i}.post_attention_norm"], (i, "mlp")),
            None: ([prev, f"layers.{i}.attention", f"layers.{i}.mlp"], None)}[sub]


def layer_errors(ctx, base: _Baseline, n_prompts: int, expected: Mapping[tuple[int, str], float],
                 floor: float) -> list[dict[str, Any]]:
    """Per hooked output in execution order: name, cosine, rel_err, the error its inputs and its own weights
    explain (``explained``: max input rel_err + expected weight error + floor) and ``growth`` = rel_err /
    explained (over the first n_prompts prompts)."""
    tgt = [ctx.target_layers(i) for i in range(n_prompts)]
    ref = [base.layers(i) for i in range(n_prompts)]
    num_layers = ctx.target.engine.spec.num_layers
    rows, err = [], {}
    for name in layer_names(num_layers):
        if not all(name in t and name in r for t, r in zip(tgt, ref)):
            continue
        t = torch.cat([d[name] for d in tgt])
        r = torch.cat([d[name] for d in ref])
        if t.shape != r.shape:
            continue
        ins, own = _inputs(name, num_layers)
        e_in = max((err[x] for x in ins if x in err), default=0.0)
        w = expected.get(own, 0.0) if own is not None else 0.0
        e = err[name] = _rel(t, r)
        explained = e_in + w + floor
        rows.append({"name": name, "cosine": compare.cosine(t, r), "rel_err": e, "input_rel_err": e_in,
                     "weight_rel_err_expected": w, "explained": explained, "growth": e / explained})
    return rows


def _top1(r: torch.Tensor, t: torch.Tensor, margin: float) -> dict[str, Any]:
    """top-1 agreement on the positions whose baseline top-1 logprob leads the second by >= margin nats."""
    lp = torch.log_softmax(r.double(), dim=-1)
    top2 = lp.topk(2, dim=-1).values
    keep = (top2[:, 0] - top2[:, 1]) >= margin
    same = r.argmax(-1) == t.argmax(-1)
    out: dict[str, Any] = {"top1_agreement_all": float(same.double().mean()), "top1_positions": int(keep.sum()),
                           "top1_margin": margin}
    if keep.any():
        out["top1_agreement"] = float(same[keep].double().mean())
    return out


@register_check("weight_quant_impact")
def weight_quant_impact(params: Mapping[str, Any], thresholds: Mapping[str, float], ctx) -> Outcome:
    engine = ctx.target.engine
    if engine is None:
        raise Skip("quantized weights run on adapt's runtime, which did not run this target "
                   f"({ctx.target.reason or 'runtime ' + ctx.target.runtime})")
    q = engine.spec.quant
    if q is None:
        raise Skip("the model is not quantized (its config has no quantization_config)")
    base = _Baseline(ctx)
    n = min(len(ctx.prompts), int(params.get("max_prompts", len(ctx.prompts))))
    refs, tgts, ids = [], [], []
    for i in range(n):
        refs.append(base.logits(i)[:-1])
        tgts.append(ctx.target_logits(i)[:-1])
        ids.append(torch.tensor(ctx.prompts[i][1:]))
    r, t = torch.cat(refs), torch.cat(tgts)
    margin = float(params.get("top1_margin", 0.0))
    m: dict[str, Any] = {**_top1(r, t, margin), **compare.kl_divergence(r, t),
                         **compare.perplexity_delta(r, t, torch.cat(ids)), "baseline": base.kind}
    expected, linears = expected_errors(engine.model)
    if base.kind == "dequantized":  # both sides hold the same rounded values
        expected = {}
    else:
        m["weight_rel_err_expected"] = max((x["expected_rel_err"] for x in linears), default=0.0)
    floor = float(dict(NOISE_FLOOR, **(params.get("noise_floor") or {})).get(ctx.dtype, 1e-5))
    rows = layer_errors(ctx, base, n, expected, floor)
    if rows:
        m["layer_cosine"] = min(x["cosine"] for x in rows)
        m["layer_rel_err"] = max(x["rel_err"] for x in rows)
        m["layer_growth"] = max(x["growth"] for x in rows)
        m["layers"] = rows
    bound = thresholds.get("layer_growth_max")
    first = next((x for x in rows if bound is not None and not x["growth"] <= bound), None)
    if first is not None:
        m["first_broken_layer"] = first["name"]
    judged = (f"top-1 on {m['top1_positions']} of {r.shape[0]} positions whose baseline top-1 leads by "
              f">= {margin:g} nats ({m['top1_agreement_all']:.3g} over all)")
    msg = f"{_quant_label(q)} weights vs {base.what}; {r.shape[0]} positions over {n} prompts, {judged}"
    usable = {k: v for k, v in thresholds.items() if k[:-4] in m}
    broken = apply_thresholds(m, usable)
    if first is not None:
        broken.append(f"first layer that breaks: {first['name']} (relative error {first['rel_err']:.3g}, "
                      f"{first['growth']:.3g}x what its inputs ({first['input_rel_err']:.3g}) and its weights' "
                      f"rounding ({first['weight_rel_err_expected']:.3g}) explain, bound {bound:g}x)")
    elif rows:
        worst = max(rows, key=lambda x: x["growth"])
        msg += (f"; largest error growth {worst['growth']:.3g}x at {worst['name']} (relative error "
                f"{worst['rel_err']:.3g})")
    if not rows:
        msg += "; no hooked layer outputs to compare"
    return Outcome(m, status="fail" if broken else "pass", message="; ".join(broken + [msg]))
