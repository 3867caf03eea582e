"""Every family x every plan the model allows shards and verifies bitwise against the source."""

from __future__ import annotations

import itertools

import pytest
import torch

from adapt.errors import PlanError, ShardError
from adapt.layout import WeightLayout
from adapt.plan import ParallelPlan
from adapt.shard import load_manifest, open_rank, shard, verify
from adapt.shard.checkpoint import open_checkpoint
from adapt.source import read_config
from adapt.spec import ModelSpec
from tests.fixtures.tiny import TINY, save_tiny


@pytest.mark.parametrize("family", list(TINY))
def test_every_allowed_plan_shards_and_verifies(family, tiny_ckpts, tmp_path):
    ckpt = tiny_ckpts[family]
    spec = ModelSpec.from_hf_config(read_config(ckpt / "config.json"))
    done = []
    for tp, pp, ep in itertools.product((1, 2, 4), (1, 2), (1, 2)):
        try:
            plan = ParallelPlan.build(spec, tp=tp, pp=pp, ep=ep)
        except PlanError:
            continue
        out = tmp_path / f"tp{tp}pp{pp}ep{ep}"
        res = shard(ckpt, out, plan, max_file_size=30_000)
        rep = verify(out, source=ckpt)
        assert rep.ok, [p.line() for p in rep.problems]
        assert rep.tensors_compared > 0 and res.files_written == len(res.manifest.files)
        done.append((tp, pp, ep))
    assert (1, 1, 1) in done and (2, 1, 1) in done, done
    if spec.is_moe:
        assert any(ep == 2 for _, _, ep in done)


def test_open_rank_gives_the_plans_slices(tiny_ckpts, tmp_path):
    ckpt = tiny_ckpts["qwen3_moe"]
    out = tmp_path / "o"
    shard(ckpt, out, tp=2, pp=2, ep=2, max_file_size=20_000)
    m = load_manifest(out)
    assert m.world_size == 4 and any(len(m.rank_files(r)) > 1 for r in range(4))
    src, _ = open_checkpoint(ckpt)
    layout = WeightLayout.from_spec(ModelSpec.from_hf_config(m.source_config))
    seen = set()
    for rank in range(4):
        tensors = open_rank(out, rank)
        for name, (s, load) in tensors.items():
            full = src.read(name)
            want = full if s.whole else full.narrow(s.dim, s.start, s.stop - s.start)
            assert torch.equal(load(), want), name
            seen.add(name)
    assert seen == {t.name for t in layout if not t.mtp}


def test_workers_write_the_same_bytes(tiny_ckpts, tmp_path):
    ckpt = tiny_ckpts["deepseek_v3"]
    a = shard(ckpt, tmp_path / "a", tp=2, ep=2, max_file_size=20_000, workers=1).manifest
    b = shard(ckpt, tmp_path / "b", tp=2, ep=2, max_file_size=20_000, workers=3, memory_budget=50_000).manifest
    assert [(f.path, f.sha256) for f in a.files] == [(f.path, f.sha256) for f in b.files]


def test_auto_workers_one_per_core_and_at_most_one_per_unit(tiny_ckpts, tmp_path, monkeypatch):
    import os

    from adapt.shard import run as run_mod

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3}, raising=False)
    assert run_mod.auto_workers(1) == 1
    assert run_mod.auto_workers(3) == 3
    assert run_mod.auto_workers(100) == 4
    _, single = save_tiny("llama", tmp_path / "single")  # one model.safetensors
    assert len(list(single.glob("*.safetensors"))) == 1
    solo = shard(single, tmp_path / "solo", tp=1)  # one source file, one rank: one unit
    assert solo.workers == 1 and solo.to_dict()["workers"] == 1
    two = shard(single, tmp_path / "two", tp=2)  # one source file, two ranks: a unit per rank
    assert two.workers == 2 and verify(tmp_path / "two", source=single).ok
    assert {s["sha256_from"] for s in two.manifest.source_files} == {"hashed"}
    ckpt = tiny_ckpts["llama"]
    many = shard(ckpt, tmp_path / "many", tp=2, max_file_size=20_000)  # many source files
    assert many.workers == 4 and len(many.manifest.files) >= 4
    with pytest.raises(ShardError, match="--workers"):
        shard(ckpt, tmp_path / "bad", tp=2, workers=-1)
