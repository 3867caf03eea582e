"""Signed baselines: a report's metrics, thresholds and environment, signed off and signed with Ed25519.

Layout of baseline.json::

    {"format": "adapt-baseline", "payload": {...}, "signature": {"algorithm": "ed25519",
     "public_key": <base64 raw 32 bytes>, "value": <base64 64 bytes>}}

The signature covers ``canonical_json(payload)`` (sorted keys, no whitespace, UTF-8, strict JSON), so any
edit of a metric, threshold, tolerance, hash or sign-off breaks it. The embedded public key proves only
that the file is intact; pass ``trusted_public_key`` to prove who signed it.

Regression tolerances. Each metric is mapped to an *error* that is lower-is-better: ``1 - x`` for the
bounded higher-is-better metrics (cosine, top-1 agreement, top-k overlap, token match, logprob
closeness), ``|x|`` for signed deltas (perplexity delta), ``x`` for the rest (max abs, max rel, KL,
ratios). A metric regressed when ``error_now > error_baseline * (1 + rel) + abs``. Working on ``1 - cosine``
instead of cosine matters: 0.99999 -> 0.9999 is a 10x worse error but a 0.009% change of the cosine.
``rel`` 10% lets run-to-run noise of the same stack (thread counts, reduction order) through and
catches real drift; ``abs`` is a floor near each metric's noise level so that errors at round-off size
(1e-7 -> 3e-7) do not flag. Unknown metrics are not gated. The tolerances are written into the baseline
(and so signed); ``write_baseline(..., tolerances=...)`` overrides them per metric.
"""

from __future__ import annotations

import base64
import json
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from adapt.errors import SignatureError, ValidationInputError
from adapt.validate.records import Regression, Report, decode_value, encode_value
from adapt.fileio import atomic_write

FORMAT = "adapt-baseline"
VERSION = 1
ENV_KEY = "ADAPT_SIGNING_KEY"

# metric -> (error transform, rel, abs). "deficit": 1 - x; "magnitude": |x|; "value": x.
DEFAULT_TOLERANCES: dict[str, dict[str, Any]] = {
    "cosine": {"error": "deficit", "rel": 0.10, "abs": 1e-6},  # fp32 cosine noise ~1e-7
    "top1_agreement": {"error": "deficit", "rel": 0.10, "abs": 0.01},  # ~1 near-tie flip per 100 positions
    "topk_overlap": {"error": "deficit", "rel": 0.10, "abs": 0.01},
    "token_match": {"error": "deficit", "rel": 0.0, "abs": 0.0},  # exact match is binary
    "logprobs_close": {"error": "deficit", "rel": 0.0, "abs": 0.0},  # vLLM's rule is binary per prompt
    "max_abs": {"error": "value", "rel": 0.10, "abs": 1e-6},  # ~8 ulp of fp32 around 1
    "max_rel": {"error": "value", "rel": 0.50, "abs": 1e-4},  # noisy: dominated by near-zero references
    "kl_mean": {"error": "value", "rel": 0.10, "abs": 1e-8},
    "kl_max": {"error": "value", "rel": 0.10, "abs": 1e-8},
    "ppl_delta": {"error": "magnitude", "rel": 0.10, "abs": 1e-3},
    "ppl_delta_rel": {"error": "magnitude", "rel": 0.10, "abs": 1e-4},
}
# *_vs_torch_ratio metrics (the FlashAttention 2x rule) are errors too.
_RATIO_TOLERANCE = {"error": "value", "rel": 0.10, "abs": 0.05}


def tolerance_for(metric: str, overrides: Mapping[str, Mapping[str, Any]] | None = None) -> dict[str, Any] | None:
    """The tolerance rule for a metric name, or None when it is not gated."""
    if overrides and metric in overrides:
        return dict(overrides[metric])
    if metric in DEFAULT_TOLERANCES:
        return dict(DEFAULT_TOLERANCES[metric])
    if metric.endswith("_vs_torch_ratio"):
        return dict(_RATIO_TOLERANCE)
    return None


def _error(value: float, how: str) -> float:
    return {"deficit": lambda x: 1.0 - x, "magnitude": abs, "value": lambda x: x}[how](value)


def canonical_json(obj: Any) -> bytes:
    """The bytes that are signed: sorted keys, no whitespace, UTF-8, no NaN."""
    return json.dumps(encode_value(obj), sort_keys=True, separators=(",", ":"), ensure_ascii=False,
                      allow_nan=False).encode("utf-8")


# ---------------------------------------------------------------------------------------------- keys


def config_dir() -> Path:
    """``$XDG_CONFIG_HOME/adapt`` (default ``~/.config/adapt``)."""
    base = os.environ.get("XDG_CONFIG_HOME") or os.path.join(os.path.expanduser("~"), ".config")
    return Path(base) / "adapt"


@dataclass(frozen=True)
class SigningKey:
    """A resolved private key and where it came from (``source``: file, env-path, env-pem, config)."""

    private_key: Ed25519PrivateKey
    source: str
    path: Path | None
    created: bool


def _load_private_pem(data: bytes, where: str) -> Ed25519PrivateKey:
    try:
        key = serialization.load_pem_private_key(data, password=None)
    except (ValueError, TypeError) as e:
        raise ValidationInputError(f"{where}: not an unencrypted PEM private key ({e})") from None
    if not isinstance(key, Ed25519PrivateKey):
        raise ValidationInputError(f"{where}: the signing key must be Ed25519, got {type(key).__name__}")
    return key


def _read_key_file(path: Path, where: str) -> Ed25519PrivateKey:
    try:
        return _load_private_pem(path.read_bytes(), f"{where} {path}")
    except OSError as e:
        raise ValidationInputError(f"{where} {path}: cannot read ({e.strerror or e})") from None


def _create_key(path: Path) -> bool:
    """Write a fresh key at ``path`` with mode 0600; False when another process created it first."""
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    pem = Ed25519PrivateKey.generate().private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        return False
    with os.fdopen(fd, "wb") as f:
        f.write(pem)
    return True


def resolve_signing_key(key: str | Path | None = None) -> SigningKey:
    """Explicit key file, else ``$ADAPT_SIGNING_KEY`` (a path or PEM text), else the user's config key,
    created on first use at ``config_dir()/signing_key.pem`` with mode 0600."""
    if key is not None:
        p = Path(key)
        return SigningKey(_read_key_file(p, "signing key"), "file", p, False)
    env = os.environ.get(ENV_KEY, "").strip()
    if env:
        if env.startswith("-----BEGIN"):
            return SigningKey(_load_private_pem(env.encode(), f"${ENV_KEY}"), "env-pem", None, False)
        p = Path(env).expanduser()
        return SigningKey(_read_key_file(p, f"${ENV_KEY}"), "env-path", p, False)
    p = config_dir() / "signing_key.pem"
    created = False if p.exists() else _create_key(p)
    return SigningKey(_read_key_file(p, "signing key"), "config", p, created)


def _public_raw(pub: Ed25519PublicKey) -> bytes:
    return pub.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)


def _as_public_key(k: Any) -> Ed25519PublicKey:
    if isinstance(k, Ed25519PublicKey):
        return k
    if isinstance(k, Ed25519PrivateKey):
        return k.public_key()
    if isinstance(k, Path):
        k = k.read_bytes()
    if isinstance(k, str):
        k = k.encode()
    if isinstance(k, bytes):
        try:
            if k.lstrip().startswith(b"-----BEGIN"):
                pub = serialization.load_pem_public_key(k)
            else:
                pub = Ed25519PublicKey.from_public_bytes(base64.b64decode(k, validate=True))
        except (ValueError, TypeError) as e:
            raise ValidationInputError(f"trusted public key: cannot parse ({e})") from None
        if isinstance(pub, Ed25519PublicKey):
            return pub
    raise ValidationInputError(f"trusted public key: expected an Ed25519 key, got {type(k).__name__}")


# ------------------------------------------------------------------------------------------- writing


@dataclass(frozen=True)
class BaselineWritten:
    """What :func:`write_baseline` did, so the CLI can say where the key lives."""

    path: Path
    key_source: str
    key_path: Path | None
    key_created: bool
    public_key: str  # base64 of the raw 32 bytes


def baseline_payload(
    report: Report, signer: str, tolerances: Mapping[str, Mapping[str, Any]] | None = None,
    signed_utc: str | None = None,
) -> dict[str, Any]:
    """The signed content: per item status, metrics, thresholds and tolerances; environment; sign-off."""
    items = {}
    for it in report.items:
        tol = {m: t for m in it.metrics if (t := tolerance_for(m, tolerances)) is not None}
        items[it.id] = {"section": it.section, "status": it.status, "required": it.required,
                        "metrics": it.metrics, "thresholds": it.thresholds, "tolerances": tol}
    utc = signed_utc or datetime.now(timezone.utc).replace(microsecond=0).isoformat().replace("+00:00", "Z")
    return encode_value({
        "version": VERSION,
        "checklist": report.checklist,
        "report_created_utc": report.created_utc,
        "items": items,
        "environment": report.environment,
        "sign_off": {"signer": signer, "utc": utc},
    })


def write_baseline(
    report: Report, path: str | Path, signer: str, key: str | Path | None = None,
    tolerances: Mapping[str, Mapping[str, Any]] | None = None,
) -> BaselineWritten:
    """Sign ``report`` as a baseline at ``path`` (atomically). ``key``: see :func:`resolve_signing_key`."""
    if not signer or not signer.strip():
        raise ValidationInputError("baseline: a signer name is required for the sign-off")
    sk = resolve_signing_key(key)
    payload = baseline_payload(report, signer.strip(), tolerances)
    pub = base64.b64encode(_public_raw(sk.private_key.public_key())).decode()
    doc = {
        "format": FORMAT,
        "payload": payload,
        "signature": {"algorithm": "ed25519", "public_key": pub,
                      "value": base64.b64encode(sk.private_key.sign(canonical_json(payload))).decode()},
    }
    p = Path(path)
    atomic_write(p, (json.dumps(doc, indent=2, sort_keys=True, ensure_ascii=False) + "\n").encode())
    return BaselineWritten(p, sk.source, sk.path, sk.created, pub)


# ------------------------------------------------------------------------------------------- reading


@dataclass(frozen=True)
class Baseline:
    """A baseline whose signature verified."""

    items: dict[str, dict[str, Any]]
    environment: dict[str, Any]
    sign_off: dict[str, str]
    public_key: str
    checklist: str = ""


def load_baseline(path: str | Path, trusted_public_key: Any = None) -> Baseline:
    """Read and verify a baseline; SignatureError (exit 2) when unsigned, tampered or not by the trusted key.

    ``trusted_public_key``: an Ed25519 public key object, PEM (str/bytes/Path), or base64 of the raw bytes.
    """
    p = Path(path)
    try:
        doc = json.loads(p.read_text(encoding="utf-8"))
    except OSError as e:
        raise ValidationInputError(f"baseline {p}: cannot read ({e.strerror or e})") from None
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise ValidationInputError(f"baseline {p}: not valid JSON") from None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT or not isinstance(doc.get("payload"), dict):
        raise ValidationInputError(f"baseline {p}: not an adapt baseline (format {FORMAT!r} with a payload)")
    sig = doc.get("signature")
    if not isinstance(sig, dict) or not sig.get("value") or not sig.get("public_key"):
        raise SignatureError(f"baseline {p}: unsigned (no signature block)")
    if sig.get("algorithm") != "ed25519":
        raise SignatureError(f"baseline {p}: signature algorithm {sig.get('algorithm')!r} is not ed25519")
    try:
        embedded = Ed25519PublicKey.from_public_bytes(base64.b64decode(sig["public_key"], validate=True))
        value = base64.b64decode(sig["value"], validate=True)
    except (ValueError, TypeError):
        raise SignatureError(f"baseline {p}: malformed signature or public key") from None
    if trusted_public_key is not None:
        if _public_raw(_as_public_key(trusted_public_key)) != _public_raw(embedded):
            raise SignatureError(f"baseline {p}: signed by a key that is not the trusted key")
    payload = doc["payload"]
    try:
        embedded.verify(value, canonical_json(payload))
    except InvalidSignature:
        raise SignatureError(f"baseline {p}: signature does not verify (file edited after signing?)") from None
    payload = decode_value(payload)
    items = payload.get("items")
    if not isinstance(items, dict):
        raise ValidationInputError(f"baseline {p}: payload has no items")
    return Baseline(items, dict(payload.get("environment") or {}), dict(payload.get("sign_off") or {}),
                    sig["public_key"], str(payload.get("checklist", "")))


def _num(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def compare_to_baseline(report: Report, baseline: Baseline) -> list[Regression]:
    """Regressions of the report's required items against a verified baseline.

    A status change to ``fail`` or ``error`` from ``pass`` or ``skip`` is a regression; so is a required
    baseline item missing from the report, and a gated metric whose error grew past its tolerance (see
    the module docstring). Metrics are compared only when both sides have a number; a baseline value that
    is not finite is not a reference to compare against.
    """
    out: list[Regression] = []
    current = {it.id: it for it in report.items}
    for item_id, b in baseline.items.items():
        if b.get("required", True) and item_id not in current:
            out.append(Regression(item_id, "missing", f"{item_id}: in the baseline but not in this report"))
    for it in report.items:
        b = baseline.items.get(it.id)
        if b is None or not it.required:
            continue
        was = b.get("status")
        if was in ("pass", "skip") and it.status in ("fail", "error"):
            out.append(Regression(it.id, "status", f"{it.id}: {was} -> {it.status}", baseline=was,
                                  current=it.status))
        tols = b.get("tolerances") or {}
        for metric, old in (b.get("metrics") or {}).items():
            tol, new = tols.get(metric), it.metrics.get(metric)
            if tol is None or not _num(old) or not math.isfinite(old) or not _num(new):
                continue
            e_old, e_new = _error(float(old), tol["error"]), _error(float(new), tol["error"])
            bound = e_old * (1.0 + float(tol["rel"])) + float(tol["abs"])
            if not e_new <= bound:  # NaN regresses
                out.append(Regression(
                    it.id, "metric", f"{it.id}: {metric} {old:.6g} -> {new:.6g} (error bound {bound:.3g})",
                    metric=metric, baseline=old, current=new, bound=bound))
    return out


def environment_differences(report: Report, baseline: Baseline) -> dict[str, tuple[Any, Any]]:
    """Environment keys whose values differ (baseline, report): context for a regression, not one."""
    now = decode_value(encode_value(report.environment))
    keys = set(baseline.environment) | set(now)
    return {k: (baseline.environment.get(k), now.get(k)) for k in sorted(keys)
            if baseline.environment.get(k) != now.get(k)}
