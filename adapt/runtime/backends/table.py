"""The operator-mapping table (``adapt ops``): for every op a model needs, the layers that run it, the
backend ``--kernels`` picks on a device and dtype, the backends that offer it there, and whether it falls
back to the plain-torch form. ``adapt day0`` puts the same table in its report.
"""

from __future__ import annotations

import torch

from adapt.runtime.backends.registry import backends, choose, plugin_errors
from adapt.spec import ModelSpec


def model_ops(spec: ModelSpec) -> dict[str, list[int]]:
    """op -> the decoder layers that call it, in the order a layer runs them (models/*.py)."""
    out: dict[str, list[int]] = {}

    def add(op: str, i: int) -> None:
        out.setdefault(op, []).append(i)

    a, moe = spec.attention, spec.moe
    for i, kind in enumerate(spec.layer_kinds):
        if i == 0 or a.kind == "mla" or a.qk_norm:  # the first layer's input norm, q/k norms, MLA's latent norms
            add("rms_norm", i)
        add("fused_add_rms_norm", i)
        add("apply_rope", i)
        if a.kind == "mla":
            for op in ("write_mla_cache", "mla_prefill", "mla_decode"):
                add(op, i)
        else:
            for op in ("write_kv_cache", "varlen_attention", "paged_decode_attention"):
                add(op, i)
        if kind == "moe":
            if spec.family != "deepseek":
                add("router_softmax_topk", i)
            else:
                add("sigmoid_grouped_topk" if moe.scoring == "sigmoid" else "deepseek_v2_topk", i)
            add("moe_experts_fused", i)
            if moe.num_shared_experts and moe.shared_intermediate_size:
                add("silu_and_mul", i)
        else:
            add("silu_and_mul", i)
    return out


def op_table(spec: ModelSpec, device: str, dtype: torch.dtype, kernels: str = "auto") -> dict:
    """{"model", "device", "dtype", "kernels", "ops": [{"op", "layers", "impl", "form", "candidates",
    "fallback"}], "backends": [{"name", "origin", "available", "why", "ops"}], "plugin_errors": [...]}."""
    dev = device.split(":")[0]  # a device type this torch build may not know (npu, musa): only its name matters
    used = model_ops(spec)
    picked = choose(kernels, dev, dtype, tuple(used))
    rows = [{"op": op, "layers": layers, "impl": picked[op].backend, "form": picked[op].form,
             "candidates": list(picked[op].candidates), "fallback": picked[op].fallback}
            for op, layers in used.items()]
    infos = [{"name": b.name, "origin": b.origin, "available": b.unavailable(dev, dtype) is None,
              "why": b.unavailable(dev, dtype), "ops": len(b.ops)} for b in backends()]
    return {"model": spec.name, "device": device, "dtype": str(dtype).replace("torch.", ""), "kernels": kernels,
            "ops": rows, "backends": infos, "plugin_errors": plugin_errors()}


def layer_ranges(layers: list[int]) -> str:
    """[0, 1, 2, 5] -> "0-2, 5"."""
    out, start = [], None
    for j, x in enumerate(layers):
        if start is None:
            start = x
        if j + 1 == len(layers) or layers[j + 1] != x + 1:
            out.append(str(start) if start == x else f"{start}-{x}")
            start = None
    return ", ".join(out)


def to_markdown(table: dict) -> str:
    """The table as GitHub markdown (``adapt ops --format md`` and the day0 report)."""
    head = (f"Operator mapping of {table['model']} on {table['device']} in {table['dtype']} "
            f"(--kernels {table['kernels']})\n\n| op | layers | impl | form | candidates | fallback |\n"
            "|---|---|---|---|---|---|\n")
    body = "".join(f"| {r['op']} | {layer_ranges(r['layers'])} | {r['impl']} | {r['form']} | "
                   f"{', '.join(r['candidates'])} | {'yes' if r['fallback'] else ''} |\n" for r in table["ops"])
    off = [f"- {b['name']}: {b['why']}" for b in table["backends"] if not b["available"]]
    tail = ("\nBackends not available here:\n" + "\n".join(off) + "\n") if off else ""
    errs = "".join(f"- {e}\n" for e in table["plugin_errors"])
    return head + body + tail + (f"\nPlugins that failed to load:\n{errs}" if errs else "")
