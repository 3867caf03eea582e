"""FP8 e4m3 128x128 block dequantization of a synthetic DeepSeek-V3 checkpoint (dims not multiples of 128)."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open

from adapt.errors import PlanError
from adapt.shard import load_manifest, shard, verify
from adapt.shard.checkpoint import open_checkpoint
from adapt.shard.transform import dequant_slice
from tests.shard.conftest import FP8_CONFIG, write_fp8_checkpoint


def _blockwise(w: torch.Tensor, scale: torch.Tensor, b: int = 128) -> torch.Tensor:
    """w.float() * scale, one block at a time (the test's own oracle)."""
    out = torch.empty(w.shape, dtype=torch.float32)
    for i in range(scale.shape[0]):
        for j in range(scale.shape[1]):
            out[i * b:(i + 1) * b, j * b:(j + 1) * b] = w[i * b:(i + 1) * b, j * b:(j + 1) * b].float() * scale[i, j]
    return out


@pytest.fixture(scope="module")
def fp8_ckpt(tmp_path_factory):
    return write_fp8_checkpoint(tmp_path_factory.mktemp("fp8") / "ckpt")


@pytest.mark.parametrize("tp,pp,ep", [(1, 1, 1), (2, 2, 2), (4, 1, 1)])
def test_fp8_dequant_is_exact(fp8_ckpt, tmp_path, tp, pp, ep):
    out = tmp_path / "o"
    shard(fp8_ckpt, out, tp=tp, pp=pp, ep=ep, dtype="fp32")
    rep = verify(out, source=fp8_ckpt)
    assert rep.ok, [p.line() for p in rep.problems]
    cfg = json.loads((out / "config.json").read_text())
    assert "quantization_config" not in cfg and cfg["torch_dtype"] == "float32"
    m = load_manifest(out)
    src, _ = open_checkpoint(fp8_ckpt)
    checked = 0
    for f in m.files:
        with safe_open(str(out / f.path), "pt") as fh:
            assert not any(k.endswith("_scale_inv") for k in fh.keys())
            for t in f.tensors:
                if t.transform != "fp8_block_dequant":
                    continue
                w, sc = src.read(t.source), src.read(t.scale)
                assert w.shape[0] % 128 or w.shape[1] % 128 or w.shape[0] == 128  # edge blocks are exercised
                ref = _blockwise(w, sc)
                s = t.slice
                want = ref if s.whole else ref.narrow(s.dim, s.start, s.stop - s.start)
                assert torch.equal(fh.get_tensor(t.name), want), t.name
                checked += 1
    assert checked > 20
    assert any(t.source.startswith("model.layers.3.") for f in m.files for t in f.tensors)  # MTP layer sharded


def test_fp8_dequant_bf16_and_chunking():
    g = torch.Generator().manual_seed(1)
    w = (torch.randn(300, 200, generator=g) * 50).to(torch.float8_e4m3fn)
    sc = torch.rand(3, 2, generator=g)
    ref = _blockwise(w, sc)
    for dim, start, stop in ((0, 70, 300), (1, 33, 190), (0, 0, 128), (1, 128, 200)):
        part = w.narrow(dim, start, stop - start)
        b0, b1 = start // 128, -(-stop // 128)
        rows = sc.narrow(dim, b0, b1 - b0)
        got = dequant_slice(part, rows, (128, 128), dim, start, "bfloat16")
        assert torch.equal(got, ref.narrow(dim, start, stop - start).to(torch.bfloat16))


def test_fp8_keep_copies_scales_bitwise(fp8_ckpt, tmp_path):
    out = tmp_path / "keep"
    shard(fp8_ckpt, out, pp=2, dtype="keep")
    assert verify(out, source=fp8_ckpt).ok
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["quantization_config"]["weight_block_size"] == [128, 128]
    names = {t.name for f in load_manifest(out).files for t in f.tensors}
    assert any(n.endswith("_scale_inv") for n in names)


def test_fp8_keep_refuses_unaligned_slices(fp8_ckpt, tmp_path):
    with pytest.raises(PlanError, match="not aligned"):
        shard(fp8_ckpt, tmp_path / "x", tp=2, dtype="keep")
    assert not (tmp_path / "x").exists()


def test_fp8_keep_small_blocks_tp2(tmp_path):
    cfg = dict(FP8_CONFIG, quantization_config=dict(FP8_CONFIG["quantization_config"], weight_block_size=[4, 4]))
    ckpt = write_fp8_checkpoint(tmp_path / "c8", cfg, with_mtp=False)
    shard(ckpt, tmp_path / "o", tp=2, ep=2, dtype="keep")
    assert verify(tmp_path / "o", source=ckpt).ok
    shard(ckpt, tmp_path / "b", tp=2, ep=2, dtype="bf16")
    assert verify(tmp_path / "b", source=ckpt).ok


def test_fp8_dequant_the_same_through_direct_io_and_hash_lanes(fp8_ckpt, tmp_path, monkeypatch):
    """Materialised (dequantized) tensors between streamed ones, written with O_DIRECT through small staging
    buffers and with the source hashed on a helper thread: the same files as the default run."""
    import adapt.shard.fanout as fanout
    import adapt.shard.run as run_mod
    import adapt.shard.writer as writer

    shard(fp8_ckpt, tmp_path / "ref", tp=2, pp=2, ep=2, dtype="bf16")
    monkeypatch.setattr(writer, "DIRECT", True)
    monkeypatch.setattr(writer, "DIRECT_MIN", 0)
    monkeypatch.setenv("ADAPT_SHARD_DIRECT", "1")  # no probe: O_DIRECT whatever the disk
    monkeypatch.setattr(fanout, "STAGE", 8192)
    monkeypatch.setattr(fanout, "STAGE_MIN", 4096)
    monkeypatch.setattr(run_mod, "usable_cores", lambda: 8)
    shard(fp8_ckpt, tmp_path / "o", tp=2, pp=2, ep=2, dtype="bf16", workers=1)
    ref, got = load_manifest(tmp_path / "ref"), load_manifest(tmp_path / "o")
    assert [(f.path, f.sha256) for f in got.files] == [(f.path, f.sha256) for f in ref.files]
    assert got.source_files == ref.source_files
    assert verify(tmp_path / "o", source=fp8_ckpt).ok
