"""`adapt day0`: the whole chain into one directory, every stage logged with its time and artifacts."""

from __future__ import annotations

import json

import pytest

from adapt.validate.checklist import default_checklist_path
from tests.fixtures.tiny import save_tiny
from tests.validate.test_validate_cli import run_cli

STAGES = ["profile", "ops", "plan", "shard", "run", "validate", "report"]


def _check_dir(out, with_model: bool):
    d = json.loads((out / "day0.json").read_text())
    names = [s["name"] for s in d["stages"]]
    assert names == (["init"] if with_model else []) + STAGES
    for s in d["stages"]:
        assert s["status"] == "pass", s
        assert s["seconds"] >= 0 and s["artifacts"]
        for a in s["artifacts"]:
            assert (out / a).exists(), a  # every artifact lands in DIR
    for f in ("profile.json", "plan.yaml", "plan.json", "shard/manifest.json", "run.json", "day0.md",
              "validate/report.json", "validate/report.html", "validate/junit.xml", "validate/summary.md"):
        assert (out / f).is_file(), f
    assert json.loads((out / "run.json").read_text())
    ops = json.loads((out / "ops.json").read_text())["ops"]  # the operator-mapping table, in day0.md too
    assert ops and all(o["impl"] for o in ops)
    assert "## Operator mapping" in (out / "day0.md").read_text()
    assert f"| {ops[0]['op']} |" in (out / "day0.md").read_text()
    return d


def test_day0_on_a_given_model_with_a_short_checklist(tmp_path):
    """The cheap flow: a 2-layer llama and the day0 checklist cut to loading, text, layers."""
    _, model = save_tiny("llama", tmp_path / "llama")
    cl = tmp_path / "short.yaml"
    import yaml

    doc = yaml.safe_load(default_checklist_path().read_text())
    doc["sections"] = [s for s in doc["sections"] if s["id"] in ("model_loading", "runtime_startup",
                                                                  "text_inference", "layer_alignment")]
    cl.write_text(yaml.safe_dump(doc))
    out = tmp_path / "day0"
    assert run_cli("day0", model, "--out", out, "--checklist", cl) == 0
    d = _check_dir(out, with_model=False)
    v = json.loads((out / "validate" / "report.json").read_text())
    st = {it["id"]: it["status"] for it in v["items"]}
    assert st["manifest_verify"] == "pass" and st["prefill_logits"] == "pass" and st["hidden_states"] == "pass"
    assert v["environment"]["target_kind"] == "shard" and d["exit_code"] == 0


@pytest.mark.slow
def test_day0_with_no_argument_builds_tiny_k2(tmp_path):
    # no timed assertion (a test must not depend on the machine's speed): .ci/run's first stage prints the time
    out = tmp_path / "day0"
    rc = run_cli("day0", "--out", out)
    assert rc == 0
    _check_dir(out, with_model=True)
    assert (out / "model" / "config.json").is_file()


@pytest.mark.parametrize("model, text", [("no-such-model", "is not a directory, a config file"),
                                         ("empty", "has no config.json")])
def test_day0_on_a_model_that_does_not_resolve_fails_before_writing(tmp_path, monkeypatch, capsys, model, text):
    from adapt.cli.main import main

    monkeypatch.chdir(tmp_path)
    (tmp_path / "empty").mkdir()
    with pytest.raises(SystemExit) as e:
        main(["day0", model, "--out", str(tmp_path / "d")])
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 1 and len(err) == 1 and text in err[0], err
    assert not (tmp_path / "d").exists()
