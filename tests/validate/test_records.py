import json
import math

import pytest

from adapt.errors import ValidationInputError
from adapt.validate.records import ItemResult, Regression, Report, exit_code

from .conftest import make_report


def test_round_trip_is_exact(report):
    text = report.to_json()
    json.loads(text, parse_constant=lambda c: pytest.fail(f"non-strict JSON constant {c}"))
    back = Report.from_json(text)
    assert back.to_json() == text
    assert math.isnan(back.items[-1].metrics["ppl_delta"])
    assert back.first_divergence == {"layer": 2, "module": "model.layers.2"}
    assert back.environment["checkpoint_hash"] == "sha256:ab12"
    assert back.layer_curve == report.layer_curve


def test_summary_counts(report):
    s = report.summary
    assert s["total"] == 5
    assert s["by_status"] == {"pass": 2, "fail": 1, "skip": 2, "error": 0}
    assert s["by_section"]["multi_device"]["skip"] == 1
    assert s["required_failing"] == 0


def test_exit_codes(report):
    assert exit_code(report) == 0  # optional failure and required skip do not fail
    report.items[0].status = "error"
    assert exit_code(report) == 1
    report.items[0].status = "pass"
    report.items[1].status = "fail"
    assert exit_code(report) == 1
    report.items[1].status = "pass"
    report.regressions.append(Regression("prefill_logits", "metric", "cosine regressed", metric="cosine"))
    assert exit_code(report) == 1
    assert Report.from_json(report.to_json()).regressions[0].metric == "cosine"


def test_bad_inputs():
    with pytest.raises(ValidationInputError, match="status"):
        ItemResult("x", "s", "t", "passed")
    with pytest.raises(ValidationInputError, match="not valid JSON"):
        Report.from_json("{")
    good = json.loads(make_report().to_json())
    good["items"][0]["colour"] = "red"
    with pytest.raises(ValidationInputError, match="unknown field 'colour'"):
        Report.from_dict(good)
    with pytest.raises(ValidationInputError, match="schema_version"):
        Report.from_dict({"schema_version": 99, "items": []})
