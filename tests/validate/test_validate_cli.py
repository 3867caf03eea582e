"""`adapt validate` end to end: self-validation passes, perturbed copies fail with the right first
divergence, baselines gate (tampered: exit 2; regressed: exit 1), golden directories stand in for the
reference, and bad input exits 2."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from adapt.cli.main import main
from tests.fixtures.tiny import save_tiny

LAYERS = 4
TEXT_AND_LAYERS = ["--only", "text_inference", "--only", "layer_alignment"]


def run_cli(*argv: str) -> int:
    """The exit code of ``adapt ARGV`` run in this process (main() returns normally on success)."""
    try:
        main([str(a) for a in argv])
    except SystemExit as e:
        return int(e.code or 0)
    return 0


def perturbed(src: Path, dst: Path, name: str, fn) -> Path:
    shutil.copytree(src, dst)
    f = dst / "model.safetensors"
    t = load_file(f)
    t[name] = fn(t[name].clone())
    save_file(t, f, metadata={"format": "pt"})
    return dst


def _bump(w: torch.Tensor) -> torch.Tensor:
    w[0, 0] += 0.5  # one element of a late layer's down_proj: small, but 0.5 x an O(1e-2) activation
    return w


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    _, clean = save_tiny("llama", root / "clean", num_hidden_layers=LAYERS)
    oproj = perturbed(clean, root / "oproj", "model.layers.1.self_attn.o_proj.weight", lambda w: w * 1.05)
    elem = perturbed(clean, root / "elem", f"model.layers.{LAYERS - 1}.mlp.down_proj.weight", _bump)
    return {"clean": clean, "oproj": oproj, "elem": elem}


def report(out: Path) -> dict:
    return json.loads((out / "report.json").read_text())


def test_self_validation_passes_every_applicable_item(models, tmp_path):
    out = tmp_path / "out"
    assert run_cli("validate", models["clean"], "--reference", models["clean"], "--out", out) == 0
    r = report(out)
    assert {p.name for p in out.iterdir()} >= {"report.json", "report.html", "junit.xml", "summary.md"}
    st = {it["id"]: it["status"] for it in r["items"]}
    assert not [k for k, v in st.items() if v in ("fail", "error")], st
    for k in ("greedy_token_match", "logprob_closeness", "top1_agreement", "next_token_kl", "prefill_logits",
              "kernels_vs_twin", "hidden_states", "staged_init", "memory_vs_profile"):
        assert st[k] == "pass", (k, r["items"])
    assert all(it["message"] for it in r["items"] if it["status"] == "skip")  # every skip says why
    assert r["first_divergence"] is None and r["environment"]["runtime"] == "adapt"
    assert r["exit_code"] == 0


@pytest.mark.parametrize("runtime", ["adapt", "transformers"])
def test_o_proj_scaled_fails_and_names_the_layer(models, tmp_path, runtime):
    out = tmp_path / "out"
    rc = run_cli("validate", models["oproj"], "--reference", models["clean"], "--out", out, "--runtime", runtime,
                 *TEXT_AND_LAYERS)
    assert rc == 1
    r = report(out)
    st = {it["id"]: it["status"] for it in r["items"]}
    assert st["prefill_logits"] == "fail" and st["next_token_kl"] == "fail" and st["hidden_states"] == "fail"
    assert r["first_divergence"]["layer"] == 1 and r["first_divergence"]["module"] == "attention"
    assert len(r["layer_curve"]) == LAYERS and r["layer_curve"][0]["max_abs"] < 1e-5 < r["layer_curve"][1]["max_abs"]


def test_one_weight_element_in_a_late_layer_is_caught(models, tmp_path):
    out = tmp_path / "out"
    assert run_cli("validate", models["elem"], "--reference", models["clean"], "--out", out, *TEXT_AND_LAYERS) == 1
    r = report(out)
    hs = next(it for it in r["items"] if it["id"] == "hidden_states")
    assert hs["status"] == "fail"
    assert r["first_divergence"] == {**r["first_divergence"], "layer": LAYERS - 1, "module": "mlp"}


def test_baseline_signed_tampered_and_regressed(models, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "cfg"))
    monkeypatch.delenv("ADAPT_SIGNING_KEY", raising=False)
    base = tmp_path / "baseline.json"
    only = ["--only", "prefill_logits", "--only", "hidden_states"]
    rc = run_cli("validate", models["clean"], "--reference", models["clean"], "--out", tmp_path / "o1", *only,
                 "--write-baseline", base, "--signer", "Release Bot")
    assert rc == 0 and base.is_file()
    err = capsys.readouterr().err
    assert "created now" in err and str(tmp_path / "cfg" / "adapt" / "signing_key.pem") in err.replace("\n", "")
    # the same stack again passes against its baseline
    assert run_cli("validate", models["clean"], "--reference", models["clean"], "--out", tmp_path / "o2", *only,
                   "--baseline", base) == 0
    # a perturbed model against the clean baseline: regressions, exit 1
    assert run_cli("validate", models["elem"], "--reference", models["clean"], "--out", tmp_path / "o3", *only,
                   "--baseline", base) == 1
    r = report(tmp_path / "o3")
    assert any(g["kind"] == "metric" and g["item_id"] == "hidden_states" for g in r["regressions"])
    # one metric edited in the signed file: refused before anything runs
    doc = json.loads(base.read_text())
    doc["payload"]["items"]["prefill_logits"]["metrics"]["max_abs"] = 0.5
    bad = tmp_path / "tampered.json"
    bad.write_text(json.dumps(doc))
    assert run_cli("validate", models["clean"], "--reference", models["clean"], "--out", tmp_path / "o4", *only,
                   "--baseline", bad) == 2
    assert "signature does not verify" in capsys.readouterr().err
    assert not (tmp_path / "o4").exists()


def test_bad_inputs_exit_2(models, tmp_path):
    assert run_cli("validate", tmp_path / "nope", "--reference", models["clean"], "--out", tmp_path / "o") == 2
    bad = tmp_path / "bad.yaml"
    bad.write_text("sections: 3\n")
    assert run_cli("validate", models["clean"], "--reference", models["clean"], "--out", tmp_path / "o",
                   "--checklist", bad) == 2
    assert run_cli("validate", models["clean"], "--reference", tmp_path, "--out", tmp_path / "o") == 2
    assert run_cli("validate", models["clean"], "--reference", models["clean"], "--out", tmp_path / "o",
                   "--write-baseline", tmp_path / "b.json") == 2  # no --signer
    afile = tmp_path / "afile"
    afile.write_text("x")  # refused before the run, not after it
    assert run_cli("validate", models["clean"], "--reference", models["clean"], "--out", afile) == 2
    assert afile.read_text() == "x"
