import textwrap

import pytest

from adapt.errors import ValidationInputError
from adapt.validate.checklist import (
    Outcome, Skip, apply_thresholds, load_checklist, normalize_dtype, register_check, run_checklist,
    thresholds_for,
)

GOOD = """
name: t
sections:
  - id: s1
    items:
      - id: a
        kind: metrics
        thresholds:
          default: {cosine_min: 0.99, max_abs_max: 1.0e-3}
          float32: {max_abs_max: 1.0e-5}
      - id: b
        kind: skipper
        required: false
  - id: s2
    required: false
    items:
      - id: c
        kind: boom
      - id: d
        kind: nope
      - id: e
        kind: outcome
"""


def _write(tmp_path, text, name="c.yaml"):
    p = tmp_path / name
    p.write_text(textwrap.dedent(text))
    return p


def test_load_and_thresholds_for(tmp_path):
    cl = load_checklist(_write(tmp_path, GOOD))
    a = cl.item("a")
    assert [it.id for it in cl.items()] == ["a", "b", "c", "d", "e"]
    assert thresholds_for(a, "torch.float32") == {"cosine_min": 0.99, "max_abs_max": 1e-5}
    assert thresholds_for(a, "bf16") == {"cosine_min": 0.99, "max_abs_max": 1e-3}
    assert cl.item("b").required is False and cl.item("c").required is False  # section default
    assert cl.item("a").title == "a"


@pytest.mark.parametrize("mutate, match", [
    (lambda s: s.replace("kind: skipper", "kind: skipper\n        colour: red"), r"item 'b': unknown key 'colour'"),
    (lambda s: s.replace("id: c", "id: a"), r"item 'a': duplicate id"),
    (lambda s: s.replace("        kind: nope\n", ""), r"item 'd': missing 'kind'"),
    (lambda s: s.replace("float32:", "float33:"), r"item 'a': thresholds: unknown dtype 'float33'"),
    (lambda s: s.replace("cosine_min", "cosine"), r"item 'a': thresholds.default.cosine: name must end"),
    (lambda s: s.replace("0.99,", "high,"), r"item 'a': thresholds.default.cosine_min: 'high' is not"),
    (lambda s: s.replace("required: false\n  - id: s2", "required: maybe\n  - id: s2"), r"item 'b': 'required'"),
    (lambda s: s.replace("name: t", "name: t\nowner: me"), r"unknown key 'owner'"),
    (lambda s: s + "      - id: f\n        kind: x\n        params: [1]\n", r"item 'f': 'params' must be a mapping"),
])
def test_strict_errors_are_one_line_and_named(tmp_path, mutate, match):
    p = _write(tmp_path, mutate(textwrap.dedent(GOOD)))
    with pytest.raises(ValidationInputError, match=match) as ei:
        load_checklist(p)
    msg = str(ei.value)
    assert "\n" not in msg and msg.startswith(str(p))


def test_unreadable_and_bad_yaml(tmp_path):
    with pytest.raises(ValidationInputError, match="cannot read"):
        load_checklist(tmp_path / "missing.yaml")
    with pytest.raises(ValidationInputError, match="not valid YAML at line"):
        load_checklist(_write(tmp_path, "sections: [\n  - {id: a"))
    with pytest.raises(ValidationInputError, match="'sections' must be a non-empty list"):
        load_checklist(_write(tmp_path, "name: x\n"))


def test_apply_thresholds_nan_never_passes():
    assert apply_thresholds({"cosine": 0.995}, {"cosine_min": 0.99}) == []
    assert apply_thresholds({"cosine": float("nan")}, {"cosine_min": 0.99})
    assert apply_thresholds({"max_abs": float("nan")}, {"max_abs_max": 1.0})
    with pytest.raises(KeyError, match="needs metric 'kl'"):
        apply_thresholds({}, {"kl_max": 1.0})


def test_run_checklist_outcomes(tmp_path):
    cl = load_checklist(_write(tmp_path, GOOD))
    reg: dict = {}

    @register_check("metrics", registry=reg)
    def metrics(params, thresholds, ctx):
        return {"cosine": ctx["cos"], "max_abs": 2e-5}

    @register_check("skipper", registry=reg)
    def skipper(params, thresholds, ctx):
        raise Skip("no vision tower")

    @register_check("boom", registry=reg)
    def boom(params, thresholds, ctx):
        raise RuntimeError("device lost\nlong traceback text")

    @register_check("outcome", registry=reg)
    def outcome(params, thresholds, ctx):
        return Outcome({"ok": True}, status="pass", message="fine")

    res = {r.id: r for r in run_checklist(cl, {"cos": 0.999}, "float32", registry=reg)}
    assert res["a"].status == "fail" and "max_abs = 2e-05 > 1e-05" in res["a"].message
    assert res["a"].thresholds == {"cosine_min": 0.99, "max_abs_max": 1e-5}
    assert res["b"].status == "skip" and res["b"].message == "no vision tower"
    assert res["c"].status == "error" and res["c"].message == "RuntimeError: device lost"
    assert res["d"].status == "error" and "unknown check kind 'nope'" in res["d"].message
    assert res["e"].status == "pass" and res["e"].message == "fine"
    assert all(r.duration_s >= 0 for r in res.values())
    res = {r.id: r for r in run_checklist(cl, {"cos": 0.999}, "bfloat16", registry=reg, only={"a"})}
    assert list(res) == ["a"] and res["a"].status == "pass"


def test_returned_skip_missing_metric_and_bad_returns(tmp_path):
    cl = load_checklist(_write(tmp_path, GOOD))
    reg: dict = {}
    register_check("metrics", registry=reg)(lambda p, t, c: {"cosine": 1.0})  # no max_abs
    register_check("skipper", registry=reg)(lambda p, t, c: Skip("later"))
    register_check("boom", registry=reg)(lambda p, t, c: 42)
    register_check("outcome", registry=reg)(lambda p, t, c: Outcome(status="great"))
    res = {r.id: r for r in run_checklist(cl, None, "float32", registry=reg)}
    assert res["a"].status == "error" and "needs metric 'max_abs'" in res["a"].message
    assert res["b"].status == "skip" and res["b"].message == "later"
    assert res["c"].status == "error" and "int" in res["c"].message
    assert res["e"].status == "error" and "'great'" in res["e"].message


def test_register_check_refuses_a_second_function():
    reg: dict = {}

    def f(p, t, c):
        return {}

    def g(p, t, c):
        return {}

    register_check("k", registry=reg)(f)
    register_check("k", registry=reg)(f)  # same function again: fine (re-import)
    with pytest.raises(ValueError, match="already registered"):
        register_check("k", registry=reg)(g)


def test_normalize_dtype():
    import torch
    assert normalize_dtype(torch.bfloat16) == "bfloat16"
    assert normalize_dtype("fp16") == "float16"
    assert normalize_dtype("FP32") == "float32"
