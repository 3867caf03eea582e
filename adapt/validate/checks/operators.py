"""operator_alignment: every kernel of ``get_kernels("adapt")`` against its twin in ``get_kernels("reference")``.

float32: the kernel and the twin on the same float32 inputs; ``max_abs`` is the largest difference over
all kernels ([twin] ~1e-5). Low precision (FlashAttention's rule): the kernel on inputs cast to the dtype
against the twin on float32 inputs, divided by the twin itself run in the dtype against float32
(``max_abs_vs_torch_ratio``; <= 2 passes). Integer outputs (routing ids, int8 codes) count as their
numeric difference. Kernels without a case are listed, never silently passed. The MoE expert kernel
has several paths, and the runtime runs whichever is fastest on the host (adapt/runtime/tactics.py),
so each path is checked on its own too (``moe_experts_fused[padded]``, ``[grouped]``, ``[loop]``); a
path the case does not offer here is listed. Likewise the kernels with a fused CPU form
(adapt/runtime/cpu_kernels.py, which this check builds or loads as the runtime does): the plain name is
the form the runtime runs here (fused where it is built), ``name[torch]`` the torch form it falls back to.
Every other registered backend (adapt/runtime/backends/: plugins, and ``triton`` where it runs here, i.e.
under TRITON_INTERPRET=1 in float32) has each op it offers checked against the same twin as
``name[backend]``; ``backends_checked`` counts them per backend, and a backend that cannot run here is named
with the reason.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from adapt.validate import compare
from adapt.validate.checklist import Outcome, Skip, register_check

_DT = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
SHARED = ("rope_inv_freq", "rope_cos_sin", "mla_softmax_scale", "router_logits")  # no twin: one function
# kernels with a fused CPU form (kernels/csrc/cpu_kernels.cpp) beside their torch form
FUSED = ("paged_decode_attention", "write_kv_cache", "rms_norm", "fused_add_rms_norm", "apply_rope", "silu_and_mul",
         "moe_experts_tiled", "linear_tiled", "router_softmax_topk")


def _run(fn, case, dtype: torch.dtype) -> list[torch.Tensor]:
    args, kwargs = case.make(dtype)
    return [x.detach().cpu() for x in case.out(args, fn(*args, **kwargs))]


def _err(outs: list[torch.Tensor], refs: list[torch.Tensor]) -> tuple[float, float]:
    d = max(compare.max_abs(o.double(), r.double()) for o, r in zip(outs, refs))
    c = min(compare.cosine(o.double(), r.double()) for o, r in zip(outs, refs) if r.is_floating_point())
    return d, c


def _twin_refs(twin_fn, case, dtype: torch.dtype) -> tuple[list[torch.Tensor], float | None]:
    """The twin on float32 inputs, and (low precision) the twin's own error in ``dtype`` against it,
    floored at one ulp of the largest reference value: the denominator of the 2x rule."""
    ref32 = _run(twin_fn, case, torch.float32)
    if dtype == torch.float32:
        return ref32, None
    plain, _ = _err(_run(twin_fn, case, dtype), ref32)
    floor = torch.finfo(dtype).eps * max(float(r.abs().max()) for r in ref32 if r.numel())
    return ref32, max(plain, floor)


def _score(name, out, refs, per, cos, ratio) -> None:
    ref32, plain = refs
    per[name], cos[name] = _err(out, ref32)
    if plain is not None:
        ratio[name] = per[name] / plain


@register_check("operator_alignment")
def operator_alignment(params: Mapping[str, Any], thresholds: Mapping[str, float], ctx) -> Outcome:
    try:
        from adapt.runtime.kernels import get_kernels
    except ImportError as e:
        raise Skip(f"adapt.runtime.kernels is not available ({e})") from None
    from adapt.validate.checks.operator_cases import UnsupportedCase, build_cases

    dtype = _DT.get(ctx.dtype)
    if dtype is None:
        raise Skip(f"no operator cases for dtype {ctx.dtype}")
    from adapt.runtime import cpu_kernels
    from adapt.runtime.kernels import fused

    cpu_kernels.load()  # the cases run on the CPU: check the forms the CPU runtime runs
    ker, twin = get_kernels("adapt"), get_kernels("reference")
    wanted = params.get("kernels", "all")
    from adapt.runtime.backends import OPS

    names = list(OPS)  # every kernel with a twin (the configuration math in SHARED has none)
    if wanted != "all":
        names = [n for n in names if n in set(wanted)]
    cases = build_cases()
    per: dict[str, float] = {}
    cos: dict[str, float] = {}
    ratio: dict[str, float] = {}
    missing = [n for n in names if n not in cases]
    unsupported: list[str] = []
    for n in names:
        if n not in cases:
            continue
        try:  # a case this host cannot build in dtype (a layout it does not pack) skips twin and kernel
            refs = _twin_refs(getattr(twin, n), cases[n], dtype)
            out = _run(getattr(ker, n), cases[n], dtype)
        except UnsupportedCase:
            unsupported.append(n)
            continue
        _score(n, out, refs, per, cos, ratio)
        if n in FUSED and fused.module() is not None:
            with fused.disabled():
                _score(f"{n}[torch]", _run(getattr(ker, n), cases[n], dtype), refs, per, cos, ratio)
    paths_not_offered = _check_moe_paths(ker, twin, cases, names, dtype, per, cos, ratio)
    checked, not_here = _check_backends(cases, names, twin, dtype, per, cos, ratio)
    if not per:
        raise Skip("no kernel has an operator case")
    worst = max(per, key=per.get)
    from adapt.runtime.tactics import STRATEGIES

    n_paths = sum(n in {f"moe_experts_fused[{p}]" for p in STRATEGIES} for n in per)
    n_backends = sum(checked.values())
    n_torch = sum(n.endswith("[torch]") for n in per)
    m: dict[str, Any] = {"max_abs": per[worst], "cosine": min(cos.values()),
                         "kernels": len(per) - n_paths - n_torch - n_backends,
                         "moe_paths_checked": n_paths, "torch_forms_checked": n_torch,
                         "fused_cpu_kernels": cpu_kernels.status(),
                         "kernels_without_case": len(missing), "kernels_unsupported_here": len(unsupported),
                         "worst_kernel": worst, "backend_ops_checked": n_backends,
                         **{f"backend.{b}.ops_checked": c for b, c in checked.items()},
                         **{f"{n}.max_abs": v for n, v in per.items()}}
    if ratio:
        m["max_abs_vs_torch_ratio"] = max(ratio.values())
    msg = f"{len(per)} kernels vs twin; worst {worst} max_abs {per[worst]:.3g}"
    if missing:
        msg += f"; no case for {', '.join(missing)}"
    if unsupported:
        msg += f"; not runnable on this device in {ctx.dtype}: {', '.join(unsupported)}"
    if not_here:
        msg += "; backends not runnable here: " + "; ".join(f"{b} ({why})" for b, why in not_here.items())
    if paths_not_offered:
        msg += f"; MoE paths not offered for the case here: {', '.join(paths_not_offered)}"
    return Outcome(m, message=msg)


def _check_moe_paths(ker, twin, cases, names, dtype, per, cos, ratio) -> list[str]:
    """Each path of moe_experts_fused against the twin, pinned with the kernel's ``choose`` hook; returns
    the paths the case does not offer on this device (they are reported, not passed)."""
    from adapt.runtime.tactics import STRATEGIES

    n = "moe_experts_fused"
    if n not in names or n not in cases:
        return []
    refs = _twin_refs(getattr(twin, n), cases[n], dtype)
    missing = []
    for path in STRATEGIES:
        ran: list[str] = []

        def pinned(*args, _path=path, _ran=ran, **kwargs):
            def choose(key, cands):
                _ran.append(_path if _path in cands else "")
                return cands[_path]() if _path in cands else cands["loop"]()
            return getattr(ker, n)(*args, choose=choose, **kwargs)

        try:
            out = _run(pinned, cases[n], dtype)
        except RuntimeError:  # e.g. no grouped_mm kernel for this dtype
            ran = [""]
        if not ran or "" in ran:  # not offered (off CPU nothing is chosen: the static rule runs)
            missing.append(path)
            continue
        _score(f"{n}[{path}]", out, refs, per, cos, ratio)
    return missing


def _check_backends(cases, names, twin, dtype, per, cos, ratio) -> tuple[dict[str, int], dict[str, str]]:
    """Each op of every backend besides cpu / torch / reference (checked above) against its twin, on the CPU
    where the cases run; returns (ops checked per backend, why each other backend cannot run here)."""
    from adapt.runtime.backends import backends, plugin_errors
    from adapt.validate.checks.operator_cases import UnsupportedCase

    checked: dict[str, int] = {}
    not_here: dict[str, str] = {}
    for b in backends():
        if b.name in ("cpu", "torch", "reference"):
            continue
        why = b.unavailable("cpu", dtype)
        if why is not None:
            not_here[b.name] = why
            continue
        for n in names:
            if n not in cases or not b.offers(n, dtype):
                continue
            try:
                refs = _twin_refs(getattr(twin, n), cases[n], dtype)
                out = _run(b.ops[n].fn, cases[n], dtype)
            except UnsupportedCase:
                continue
            _score(f"{n}[{b.name}]", out, refs, per, cos, ratio)
            checked[b.name] = checked.get(b.name, 0) + 1
    for e in plugin_errors():
        not_here[e.split(":")[0]] = e
    return checked, not_here
