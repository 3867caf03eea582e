import json
import os
import stat

import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from adapt.errors import SignatureError, ValidationInputError
from adapt.validate.baseline import (
    ENV_KEY, canonical_json, compare_to_baseline, environment_differences, load_baseline,
    resolve_signing_key, write_baseline,
)

from .conftest import make_report


@pytest.fixture(autouse=True)
def _isolated_config(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))
    monkeypatch.delenv(ENV_KEY, raising=False)


def _key_file(path):
    k = Ed25519PrivateKey.generate()
    path.write_bytes(k.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                     serialization.NoEncryption()))
    return k


def test_canonical_json_is_order_and_whitespace_independent():
    assert canonical_json({"b": 1, "a": [1.5, "x"]}) == canonical_json({"a": [1.5, "x"], "b": 1})
    assert canonical_json({"a": 1}) == b'{"a":1}'


def test_first_use_creates_private_key_in_config_dir(tmp_path, report):
    info = write_baseline(report, tmp_path / "baseline.json", signer="Ada")
    assert info.key_source == "config" and info.key_created
    assert info.key_path == tmp_path / "config" / "adapt" / "signing_key.pem"
    assert stat.S_IMODE(os.stat(info.key_path).st_mode) == 0o600
    again = write_baseline(report, tmp_path / "b2.json", signer="Ada")
    assert not again.key_created and again.public_key == info.public_key
    b = load_baseline(tmp_path / "baseline.json", trusted_public_key=info.public_key)
    assert b.sign_off["signer"] == "Ada" and b.sign_off["utc"].endswith("Z")
    assert b.items["prefill_logits"]["metrics"]["cosine"] == 0.999995
    assert b.items["prefill_logits"]["tolerances"]["cosine"]["error"] == "deficit"
    assert b.environment["checkpoint_hash"] == "sha256:ab12"
    assert compare_to_baseline(report, b) == []
    assert environment_differences(report, b) == {}


def test_key_from_explicit_file_and_env(tmp_path, monkeypatch, report):
    k = _key_file(tmp_path / "k.pem")
    info = write_baseline(report, tmp_path / "b.json", "Ada", key=tmp_path / "k.pem")
    assert info.key_source == "file"
    load_baseline(tmp_path / "b.json", trusted_public_key=k.public_key())
    monkeypatch.setenv(ENV_KEY, str(tmp_path / "k.pem"))
    assert resolve_signing_key().source == "env-path"
    monkeypatch.setenv(ENV_KEY, (tmp_path / "k.pem").read_text())
    sk = resolve_signing_key()
    assert sk.source == "env-pem" and sk.path is None
    monkeypatch.setenv(ENV_KEY, str(tmp_path / "absent.pem"))
    with pytest.raises(ValidationInputError, match="cannot read"):
        resolve_signing_key()
    (tmp_path / "junk.pem").write_text("not a key")
    with pytest.raises(ValidationInputError, match="not an unencrypted PEM"):
        resolve_signing_key(tmp_path / "junk.pem")


def _tamper(path, fn):
    doc = json.loads(path.read_text())
    fn(doc)
    path.write_text(json.dumps(doc, indent=4))  # re-indented too: whitespace alone must not matter


def test_reindented_untouched_baseline_still_verifies(tmp_path, report):
    write_baseline(report, tmp_path / "b.json", "Ada")
    _tamper(tmp_path / "b.json", lambda d: None)
    load_baseline(tmp_path / "b.json")


def test_tampered_metric_is_refused(tmp_path, report):
    write_baseline(report, tmp_path / "b.json", "Ada")

    def edit(d):
        d["payload"]["items"]["prefill_logits"]["metrics"]["max_abs"] = 1.0

    _tamper(tmp_path / "b.json", edit)
    with pytest.raises(SignatureError, match="does not verify") as ei:
        load_baseline(tmp_path / "b.json")
    assert ei.value.exit_code == 2


def test_loosened_tolerance_is_refused(tmp_path, report):
    write_baseline(report, tmp_path / "b.json", "Ada")
    _tamper(tmp_path / "b.json",
            lambda d: d["payload"]["items"]["prefill_logits"]["tolerances"]["cosine"].update(rel=100.0))
    with pytest.raises(SignatureError):
        load_baseline(tmp_path / "b.json")


def test_wrong_key_is_refused(tmp_path, report):
    write_baseline(report, tmp_path / "b.json", "Ada")
    other = Ed25519PrivateKey.generate().public_key()
    with pytest.raises(SignatureError, match="not the trusted key"):
        load_baseline(tmp_path / "b.json", trusted_public_key=other)
    pem = other.public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
    with pytest.raises(SignatureError, match="not the trusted key"):
        load_baseline(tmp_path / "b.json", trusted_public_key=pem.decode())


def test_swapped_public_key_is_refused(tmp_path, report):
    """An attacker who swaps in their own public key without re-signing fails verification."""
    write_baseline(report, tmp_path / "b.json", "Ada")
    import base64
    raw = Ed25519PrivateKey.generate().public_key().public_bytes(serialization.Encoding.Raw,
                                                                 serialization.PublicFormat.Raw)
    _tamper(tmp_path / "b.json", lambda d: d["signature"].update(public_key=base64.b64encode(raw).decode()))
    with pytest.raises(SignatureError, match="does not verify"):
        load_baseline(tmp_path / "b.json")


def test_unsigned_and_malformed_are_refused(tmp_path, report):
    write_baseline(report, tmp_path / "b.json", "Ada")
    _tamper(tmp_path / "b.json", lambda d: d.pop("signature"))
    with pytest.raises(SignatureError, match="unsigned"):
        load_baseline(tmp_path / "b.json")
    write_baseline(report, tmp_path / "c.json", "Ada")
    _tamper(tmp_path / "c.json", lambda d: d["signature"].update(value="!!!"))
    with pytest.raises(SignatureError, match="malformed"):
        load_baseline(tmp_path / "c.json")
    (tmp_path / "d.json").write_text("{}")
    with pytest.raises(ValidationInputError, match="not an adapt baseline"):
        load_baseline(tmp_path / "d.json")
    with pytest.raises(ValidationInputError, match="signer"):
        write_baseline(report, tmp_path / "e.json", " ")


def test_regression_detection(tmp_path):
    base = make_report()
    write_baseline(base, tmp_path / "b.json", "Ada")
    b = load_baseline(tmp_path / "b.json")

    now = make_report(model="tiny-kimi-rev2")
    m = now.items[0].metrics
    m["cosine"] = 0.99999  # 1 - cos: 5e-6 -> 1e-5, past 5e-6 * 1.1 + 1e-6
    m["max_abs"] = 2.1e-5  # within 2e-5 * 1.1 + 1e-6: noise, not a regression
    m["kl_mean"] = 1e-6  # far past 1e-9 * 1.1 + 1e-8
    now.items[1].metrics["max_abs"] = float("nan")  # NaN always regresses
    now.items[3].status = "fail"  # skip -> fail
    now.items[4].metrics["top1_agreement"] = 0.5  # optional item: not gated
    regs = compare_to_baseline(now, b)
    got = {(r.item_id, r.kind, r.metric) for r in regs}
    assert got == {("prefill_logits", "metric", "cosine"), ("prefill_logits", "metric", "kl_mean"),
                   ("hidden_states", "metric", "max_abs"), ("parallel_tp2", "status", None)}
    assert environment_differences(now, b)["model"] == ("tiny-kimi", "tiny-kimi-rev2")

    better = make_report()
    better.items[0].metrics.update(cosine=1.0, max_abs=0.0)  # improvements never regress
    better.items[0].status = "fail"  # pass -> fail
    better.items = [it for it in better.items if it.id != "hidden_states"]
    regs = compare_to_baseline(better, b)
    assert {(r.item_id, r.kind) for r in regs} == {("prefill_logits", "status"), ("hidden_states", "missing")}
