"""Bad quantized checkpoints through the CLI: `adapt shard --dtype keep`, `adapt run` and `adapt profile` refuse
with one line naming the tensor and the rule (or the arithmetic), exit non-zero, and shard writes nothing (no
output directory, no partial or temporary files beside it)."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.fixtures.quant import save_quantized

SCALE = "model.layers.0.mlp.up_proj.weight_scale_inv"  # [96, 64] in 32 x 32 blocks: [3, 2]


@pytest.fixture
def cli(tmp_path, capsys, monkeypatch):
    from tests.flows.test_run_cli import _run_here

    def run(*args):
        code, out, err = _run_here(list(args), tmp_path / "cache", capsys, monkeypatch)
        assert code != 0 and out == "", (code, out, err)
        assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
        return err

    return run


@pytest.fixture(scope="module")
def fp8_dir(tmp_path_factory):
    return save_quantized("deepseek_v3", tmp_path_factory.mktemp("q"), "fp8", block=(32, 32))[0]


@pytest.fixture(scope="module")
def int4_dir(tmp_path_factory):
    return save_quantized("llama", tmp_path_factory.mktemp("q4"), "int4", group=32)[0]


def _edit(src, dst, change=None, config=None):
    dst.mkdir(parents=True)
    cfg = json.loads((src / "config.json").read_text())
    if config:
        config(cfg)
    (dst / "config.json").write_text(json.dumps(cfg))
    ts = load_file(str(src / "model.safetensors"))
    if change:
        change(ts)
    save_file(ts, str(dst / "model.safetensors"))
    return dst


def _nothing_written(out):
    assert not out.exists(), sorted(out.rglob("*"))
    assert sorted(p.name for p in out.parent.iterdir()) == ["in"], sorted(out.parent.iterdir())  # no temp files


def _missing(ts):
    ts.pop(SCALE)


def _misshaped(ts):
    ts[SCALE] = torch.ones(4, 2)


@pytest.mark.parametrize("change,want", [(_missing, "1 missing: " + SCALE), (_misshaped, SCALE + " [4, 2] (expected [3, 2]")],
                         ids=["missing", "misshaped"])
@pytest.mark.parametrize("degrees", [[], ["--tp", "2", "--ep", "2"]], ids=["tp1", "tp2ep2"])
def test_shard_keep_bad_scale(fp8_dir, tmp_path, cli, change, want, degrees):
    bad = _edit(fp8_dir, tmp_path / "w" / "in", change)
    out = tmp_path / "w" / "out"
    err = cli("shard", "run", str(bad), "--out", str(out), "--dtype", "keep", *degrees)
    assert want in err and "weight_scale_inv is [ceil(N / block), ceil(K / block)]" in err, err
    _nothing_written(out)


def test_group_size_not_dividing_k(int4_dir, tmp_path, cli):
    """A stored group size of 40 over K = 64: two groups per row, as the scales' [N, 2] (written for groups of
    32) also say, so only the arithmetic catches it; before, adapt run dequantized it silently wrong."""
    def g40(cfg):
        cfg["quantization_config"]["config_groups"]["group_0"]["weights"]["group_size"] = 40

    bad = _edit(int4_dir, tmp_path / "w" / "in", config=g40)
    want = "model.layers.0.self_attn.q_proj.weight: group_size 40 does not divide K = 64 (64 % 40 = 24)"
    assert want in cli("run", str(bad), "--prompt-ids", "1,2")
    assert want in cli("profile", str(bad))
    out = tmp_path / "w" / "out"
    assert want in cli("shard", "run", str(bad), "--out", str(out), "--dtype", "keep")
    _nothing_written(out)


def test_shard_dequantize_compressed_tensors_refused(int4_dir, tmp_path, cli):
    src = tmp_path / "w" / "in"
    src.parent.mkdir()
    src.symlink_to(int4_dir, target_is_directory=True)
    out = tmp_path / "w" / "out"
    err = cli("shard", "run", str(src), "--out", str(out), "--dtype", "bf16")
    assert "slices compressed-tensors (pack-quantized) checkpoints as stored (--dtype keep, no --quantize)" in err
    _nothing_written(out)


def test_tp_split_cutting_a_block_or_group(fp8_dir, int4_dir, tmp_path, cli):
    # q_b_proj: 4 heads x 24 = 96 rows; tp 2 starts rank 1 at row 48, inside the second 32-row block
    src = tmp_path / "a" / "in"
    src.parent.mkdir()
    src.symlink_to(fp8_dir, target_is_directory=True)
    out = tmp_path / "a" / "out"
    err = cli("shard", "run", str(src), "--out", str(out), "--dtype", "keep", "--tp", "2")
    assert "model.layers.0.self_attn.q_b_proj.weight: slice [48, 96) on dim 0" in err and "(48 % 32 = 16)" in err
    _nothing_written(out)
    # o_proj's K is 4 heads x 24 = 96: tp 2 gives each rank 48 columns, which int4 groups of 32 do not tile,
    # whether the checkpoint stores them (--dtype keep) or shard makes them (--quantize)
    src = tmp_path / "k" / "in"
    src.parent.mkdir()
    src.symlink_to(int4_dir, target_is_directory=True)
    out = tmp_path / "k" / "out"
    err = cli("shard", "run", str(src), "--out", str(out), "--dtype", "keep", "--tp", "2")
    assert "model.layers.0.self_attn.o_proj.weight_packed: slice [0, 48) on dim 1 cuts a group of 32 columns " \
           "(48 % 32 = 16)" in err, err
    _nothing_written(out)
    src = tmp_path / "b" / "in"
    src.parent.mkdir()
    src.symlink_to(int4_dir.parent / "src", target_is_directory=True)
    out = tmp_path / "b" / "out"
    err = cli("shard", "run", str(src), "--out", str(out), "--tp", "2", "--quantize", "int4", "--group-size", "32")
    assert "model.layers.0.self_attn.o_proj.weight: --group-size 32 does not divide K = 48" in err, err
    _nothing_written(out)


def test_zero_point_rows_cut_by_a_split():
    """Zero points pack eight output rows to an int32: a rank slice starting inside a word is refused (the tiny
    configs' tp splits all fall on multiples of 8, so this is checked on the slice rule itself)."""
    from adapt.errors import PlanError
    from adapt.layout import WeightLayout
    from adapt.plan import TensorSlice, stored_slice_of
    from adapt.quantize import quantization_config
    from adapt.spec import ModelSpec
    from tests.fixtures.tiny import tiny_config

    spec = ModelSpec.from_hf_config(tiny_config("llama", quantization_config=quantization_config(
        "int4", group=8, symmetric=False)))
    layout = WeightLayout.from_spec(spec)
    w = layout["model.layers.0.self_attn.k_proj.weight_packed"]
    z = layout["model.layers.0.self_attn.k_proj.weight_zero_point"]
    assert stored_slice_of(z, w, TensorSlice(w.name, 0, 24, 48), spec) == TensorSlice(z.name, 0, 3, 6)
    with pytest.raises(PlanError, match=r"k_proj.weight_packed: slice \[12, 24\) on dim 0 cuts an int32 word of "
                                        r"eight int4 values \(12 % 8 = 4\) of .*k_proj.weight_zero_point"):
        stored_slice_of(z, w, TensorSlice(w.name, 0, 12, 24), spec)
