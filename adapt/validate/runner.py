"""``validate()``: checklist + reference + target -> Report, report files, optional signed baseline.

Order matters for the exit codes: everything that can make the run impossible (checklist, baseline
signature, reference, target) is checked before any item runs and raises ``ValidationInputError``
(exit 2); after that the report decides (0 or 1).
"""

from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import adapt.validate.checks  # noqa: F401  (registers every check kind)
from adapt.validate.baseline import (
    BaselineWritten, compare_to_baseline, environment_differences, load_baseline, write_baseline,
)
from adapt.validate.checklist import load_checklist, normalize_dtype, run_checklist, thresholds_for
from adapt.validate.checks.layers import layer_curve, locate_first_divergence
from adapt.validate.context import ValidationContext
from adapt.validate.golden import open_reference
from adapt.validate.records import Report, collect_environment, exit_code
from adapt.validate.report import write_reports
from adapt.validate.target import open_target

FULL_HASH_LIMIT = 2 << 30  # checkpoints up to 2 GiB are hashed whole; larger ones by file headers


def checkpoint_hash(path: Path) -> str:
    """sha256 of the weight files (names, sizes and contents; only the first MiB of each when large)."""
    files = sorted(p for p in path.rglob("*.safetensors") if p.is_file())
    whole = sum(p.stat().st_size for p in files) <= FULL_HASH_LIMIT
    h = hashlib.sha256()
    for p in files:
        h.update(f"{p.relative_to(path)}:{p.stat().st_size}\n".encode())
        with p.open("rb") as f:
            if whole:
                for chunk in iter(lambda: f.read(1 << 20), b""):
                    h.update(chunk)
            else:
                h.update(f.read(1 << 20))
    return ("sha256:" if whole else "sha256-head:") + h.hexdigest()


@dataclass
class ValidateResult:
    report: Report
    paths: dict[str, Path]
    exit_code: int
    seconds: float
    baseline_written: BaselineWritten | None = None
    notes: list[str] = field(default_factory=list)


@dataclass
class EndpointOptions:
    """``--endpoint URL`` and how to talk to it (a black-box target; see validate/endpoint.py)."""

    url: str
    api_key: str | None = None
    served_model_name: str | None = None
    timeout_s: float = 60.0
    tokenizer: str | Path | None = None


def run_validation(
    target: str | Path | None, reference: str | Path, *, checklist: str | Path | None = None, device: str = "cpu",
    dtype: str = "float32", runtime: str = "auto", only: set[str] | None = None, baseline: str | Path | None = None,
    endpoint: EndpointOptions | None = None,
) -> tuple[Report, list[str]]:
    """Run the checklist; returns the report (with regressions when ``baseline`` is given) and notes."""
    cl = load_checklist(checklist)
    base = load_baseline(baseline) if baseline is not None else None  # bad signature: exit 2 before any work
    dt = normalize_dtype(dtype)
    ref = open_reference(reference)
    registry, info = None, None
    if endpoint is not None:
        from adapt.validate.checks.endpoint import endpoint_registry
        from adapt.validate.endpoint import open_endpoint

        tgt, info, tok = open_endpoint(endpoint.url, ref, api_key=endpoint.api_key, timeout=endpoint.timeout_s,
                                       served_model_name=endpoint.served_model_name, tokenizer_dir=endpoint.tokenizer)
        registry = endpoint_registry()
    else:
        tgt = open_target(target, runtime=runtime, device=device, dtype=dt)
    ctx = ValidationContext(tgt, ref, dt, device)
    if info is not None:
        ctx.notes.update(tokenizer=tok, served_model=info.model, max_model_len=info.max_model_len)
    layer_items = [it for it in cl.items() if it.kind == "layer_alignment"]
    if layer_items:
        ctx.notes["layer_thresholds"] = thresholds_for(layer_items[0], dt)
    items = run_checklist(cl, ctx, dt, registry=registry, only=only)
    failed = [it for it in items if it.status == "fail"
              and cl.item(it.id).kind in ("end_to_end", "layer_alignment")]
    notes = []
    if tgt.runner is None:
        notes.append(f"no target runtime: {tgt.reason}")
    # an endpoint's layers are not visible, nor are those of a reference recorded from one
    white_box = tgt.runner is not None and info is None and getattr(ref, "has_layers", True)
    if failed and ctx.first_divergence is None and white_box:
        ctx.first_divergence = locate_first_divergence(ctx)
    if white_box and not ctx.layer_curve and failed:
        ctx.layer_curve = layer_curve(ctx)
    manifest = tgt.manifest or {}
    extra = {"endpoint": info.to_dict(tgt.runner)} if info is not None else {}
    env = collect_environment(
        device=device if info is None else "endpoint", dtype=dt, model=tgt.path.name, plan=manifest.get("plan"),
        manifest_hash=manifest.get("digest"), checkpoint_hash=checkpoint_hash(tgt.path) if info is None else None,
        reference=ref.description, runtime=tgt.runtime, target=str(tgt.path) if info is None else info.url,
        target_kind=tgt.kind, **extra)
    if getattr(ref, "streamed", None):
        env["reference_streamed"] = ref.streamed  # report.html: the reference was streamed, these experts loaded
    if getattr(ref, "endpoint", None):
        env["reference_endpoint"] = ref.endpoint  # the golden's server: its /v1/models, /version, token-id source
    report = Report(items, env, ctx.first_divergence, ctx.layer_curve, checklist=cl.name)
    if base is not None:
        report.regressions = compare_to_baseline(report, base)
        report.environment["baseline"] = {
            "signer": base.sign_off.get("signer"), "signed_utc": base.sign_off.get("utc"),
            "public_key": base.public_key,
            "environment_differences": {k: list(v) for k, v in environment_differences(report, base).items()
                                        if k not in ("baseline",)}}
    return report, notes


def validate(
    target: str | Path | None, reference: str | Path, out: str | Path, *, checklist: str | Path | None = None,
    device: str = "cpu", dtype: str = "float32", runtime: str = "auto", only: set[str] | None = None,
    baseline: str | Path | None = None, write_baseline_to: str | Path | None = None, signer: str | None = None,
    sign_key: str | Path | None = None, endpoint: EndpointOptions | None = None,
) -> ValidateResult:
    """Validate TARGET against REFERENCE (an HF dir or a golden dir) and write the reports into ``out``.

    ``write_baseline_to`` signs the report as a baseline (``signer`` required); ``baseline`` verifies one
    first and turns regressions into failures.
    """
    t0 = time.perf_counter()
    if write_baseline_to is not None and not (signer or "").strip():
        from adapt.errors import ValidationInputError

        raise ValidationInputError("--write-baseline needs --signer NAME for the sign-off")
    if Path(out).exists() and not Path(out).is_dir():  # before the run, not after it
        from adapt.errors import ValidationInputError

        raise ValidationInputError(f"--out {out} exists and is not a directory")
    report, notes = run_validation(target, reference, checklist=checklist, device=device, dtype=dtype,
                                   runtime=runtime, only=only, baseline=baseline, endpoint=endpoint)
    report.environment["validate_seconds"] = round(time.perf_counter() - t0, 3)
    paths = write_reports(report, out)
    written = None
    if write_baseline_to is not None:
        written = write_baseline(report, write_baseline_to, signer=signer or "", key=sign_key)
        paths["baseline"] = Path(write_baseline_to)
    return ValidateResult(report, paths, exit_code(report), time.perf_counter() - t0, written, notes)


def summary_rows(report: Report) -> list[dict[str, Any]]:
    """One row per item for the terminal table."""
    return [{"id": it.id, "section": it.section, "status": it.status, "required": it.required,
             "message": it.message} for it in report.items]
