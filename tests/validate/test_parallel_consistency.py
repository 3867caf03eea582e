"""multi_device items through adapt.runtime.distributed.run_layout: a tiny MoE model against itself passes
every layout of day0.yaml; a layout whose all-reduce drops a rank's contribution, or whose rank fails,
fails them with the reason. Each layout is one torchrun launch (a few seconds on 2 cores)."""

from __future__ import annotations

import textwrap

import pytest

from adapt.validate.runner import run_validation

ITEMS = {"parallel_tp2", "parallel_ep2", "parallel_pp2", "parallel_tp2_ep2"}


@pytest.fixture(scope="module")
def moe(tmp_path_factory):
    from adapt.runtime.init_model import init_model

    return init_model("tiny-qwen3-moe", tmp_path_factory.mktemp("pc") / "qwen3moe")


def test_tiny_moe_passes_every_layout(moe):
    report, _ = run_validation(moe, moe, only=ITEMS)
    items = {it.id: it for it in report.items}
    assert set(items) == ITEMS
    assert "dp1" not in items["parallel_ep2"].message  # day0.yaml's ep2 is dp2.ep2 (ep spans tp x dp)
    for it in items.values():
        assert it.status == "pass", (it.id, it.status, it.message, it.metrics)
        assert it.metrics["max_abs"] <= 1e-5 and it.metrics["greedy_tokens_identical"] == 1.0, it.id
        assert "greedy tokens identical" in it.message


def test_shard_output_of_another_layout_is_resharded_from_its_source(moe, tmp_path):
    from adapt.runtime.distributed import run_layout
    from adapt.runtime.engine import Engine
    from adapt.shard import shard

    shard(moe, tmp_path / "tp2", tp=2)
    one = Engine.from_pretrained(moe, kv_cache_memory="16MiB").prefill_logits([1, 5, 9])
    same = run_layout(tmp_path / "tp2", [1, 5, 9], tp=2, max_new_tokens=0)
    other = run_layout(tmp_path / "tp2", [1, 5, 9], pp=2, max_new_tokens=0)
    assert not same.resharded and other.resharded
    assert (same.logits - one).abs().max() <= 1e-5 and (other.logits - one).abs().max() <= 1e-5


def _sitecustomize(tmp_path, body: str):
    """A sitecustomize.py that patches adapt inside every torchrun rank of the subprocess."""
    (tmp_path / "sitecustomize.py").write_text(textwrap.dedent(body))
    return str(tmp_path)


def test_dropped_all_reduce_contribution_fails(moe, tmp_path, monkeypatch):
    # rank 1's all-reduce contributes zeros: every tp layout computes the wrong sum
    monkeypatch.setenv("PYTHONPATH", _sitecustomize(tmp_path, """
        import os
        if os.environ.get("RANK") == "1":
            import torch
            from adapt.runtime.distributed import context

            _orig = context.DistributedContext.all_reduce

            def all_reduce(self, x, group="tp"):
                if self.group_size(group) == 1:  # the identity, as in the runtime
                    return x
                return _orig(self, torch.zeros_like(x), group)

            context.DistributedContext.all_reduce = all_reduce
        """))
    report, _ = run_validation(moe, moe, only={"parallel_tp2", "parallel_pp2"})
    items = {it.id: it for it in report.items}
    assert items["parallel_tp2"].status == "fail", items["parallel_tp2"]
    assert items["parallel_tp2"].metrics["max_abs"] > 1e-3
    assert items["parallel_pp2"].status == "pass", items["parallel_pp2"]  # pp has no tp all-reduce


def test_failing_rank_fails_the_item_with_the_rank_named(moe, monkeypatch):
    monkeypatch.setenv("ADAPT_INJECT_FAULT", "1:1:raise")
    report, _ = run_validation(moe, moe, only={"parallel_tp2"})
    it = report.items[0]
    assert it.status == "fail" and "rank 1" in it.message and "injected fault" in it.message, it.message
