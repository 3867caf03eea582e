"""The `service` check on a tiny model through adapt's runtime: it passes, and it catches a service whose
greedy tokens differ from the engine's ("healthy but wrong")."""

from __future__ import annotations

from pathlib import Path

import pytest

from adapt.validate.checklist import Skip, load_checklist, thresholds_for
from adapt.validate.checks.service import service
from adapt.validate.context import ValidationContext
from adapt.validate.reference import HFReference
from adapt.validate.target import Target, open_target
from tests.fixtures.tiny import save_tiny


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    _, d = save_tiny("llama", tmp_path_factory.mktemp("m") / "llama", max_position_embeddings=256)
    return d


def _ctx(path: Path) -> ValidationContext:
    return ValidationContext(open_target(path, runtime="adapt"), HFReference(path))


def test_service_check_passes_and_meets_day0_thresholds(tiny):
    out = service({"max_new_tokens": 8, "timeout_s": 30}, {}, _ctx(tiny))
    assert out.status is None, out.message
    m = out.metrics
    assert m["token_match"] == 1.0 and m["token_agreement"] == 1.0 and m["stream_match"] == 1.0
    th = thresholds_for(load_checklist().item("service_api"), "float32")
    assert th["token_match_min"] == 1.0 and m["startup_s"] <= th["startup_s_max"]


def test_service_check_catches_wrong_tokens(tiny, monkeypatch):
    from adapt.runtime.server import loop

    real = loop.sample

    def off_by_one(logits, params, gens):  # a service bug: every served token shifted
        res = real(logits, params, gens)
        res.token_ids = (res.token_ids + 1) % logits.shape[-1]
        return res

    monkeypatch.setattr(loop, "sample", off_by_one)
    out = service({"max_new_tokens": 4, "timeout_s": 30}, {}, _ctx(tiny))
    assert out.metrics["token_match"] == 0.0 and "position 0" in out.message


def test_service_check_skips_without_adapt_runtime(tiny):
    ctx = ValidationContext(Target(tiny, "hf", "transformers", None, "no runtime"), HFReference(tiny))
    with pytest.raises(Skip, match="adapt's runtime"):
        service({}, {}, ctx)
