"""verify catches damage: a flipped byte, a truncated file, a missing file, an extra tensor, an edited manifest."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from adapt.cli.main import main
from adapt.errors import ShardError
from adapt.shard import load_manifest, shard, verify
from adapt.shard.manifest import _digest


@pytest.fixture()
def out(llama_ckpt, tmp_path):
    o = tmp_path / "out"
    shard(llama_ckpt, o, tp=2, pp=2, max_file_size=40_000)
    assert verify(o, source=llama_ckpt).ok
    return o


def _kinds(rep):
    return {(p.kind, p.target.split(":")[0]) for p in rep.problems}


def _first(out):
    return load_manifest(out).files[0].path


def test_flipped_byte(out, llama_ckpt):
    path = out / _first(out)
    data = bytearray(path.read_bytes())
    data[-5] ^= 0x01
    path.write_bytes(bytes(data))
    assert ("sha256", _first(out)) in _kinds(verify(out))
    assert not verify(out, source=llama_ckpt).ok


def test_truncated_file(out):
    path = out / _first(out)
    path.write_bytes(path.read_bytes()[:-100])
    rep = verify(out)
    assert ("size", _first(out)) in _kinds(rep) and "truncated" in rep.problems[0].detail


def test_missing_file(out):
    (out / _first(out)).unlink()
    assert ("missing", _first(out)) in _kinds(verify(out))


def test_extra_tensor(out):
    path = out / _first(out)
    tensors = load_file(str(path))
    tensors["evil.weight"] = torch.zeros(3)
    save_file(tensors, str(path), metadata={"format": "pt"})
    rep = verify(out)
    assert ("extra-tensor", _first(out)) in _kinds(rep)


def test_extra_file(out):
    save_file({"x": torch.zeros(2)}, str(out / "rank-00000" / "model-00009-of-00009.safetensors"))
    assert ("extra-file", "rank-00000/model-00009-of-00009.safetensors") in _kinds(verify(out))


def test_edited_manifest(out):
    p = out / "manifest.json"
    d = json.loads(p.read_text())
    d["files"][0]["tensors"][0]["slice"] = {"dim": 0, "start": 0, "stop": 1}
    p.write_text(json.dumps(d))
    rep = verify(out)
    assert not rep.ok and rep.problems[0].kind == "manifest" and "edited" in rep.problems[0].detail
    with pytest.raises(ShardError, match="edited"):
        load_manifest(out)


def test_edited_manifest_with_recomputed_digest(out):
    """Someone who also fixes the digest is still caught: the slices are re-derived from the plan."""
    p = out / "manifest.json"
    d = json.loads(p.read_text())
    d.pop("manifest_sha256")
    t = next(t for f in d["files"] for t in f["tensors"] if t["slice"])
    t["slice"]["start"] += 1
    d["manifest_sha256"] = _digest(d)
    p.write_text(json.dumps(d))
    assert "plan" in {k for k, _ in _kinds(verify(out))}


def test_manifest_path_escape_refused(out):
    p = out / "manifest.json"
    d = json.loads(p.read_text())
    d.pop("manifest_sha256")
    d["files"][0]["path"] = "rank-00000/../../evil.safetensors"
    d["manifest_sha256"] = _digest(d)
    p.write_text(json.dumps(d))
    with pytest.raises(ShardError, match="unsafe file name"):
        load_manifest(out)


def test_cli_verify_exit_codes(out, llama_ckpt, capsys):
    main(["shard", "verify", str(out), "--source", str(llama_ckpt)])
    assert "OK:" in capsys.readouterr().out
    (out / _first(out)).unlink()
    with pytest.raises(SystemExit) as e:
        main(["shard", "verify", str(out), "--format", "json"])
    assert e.value.code == 1
    rep = json.loads(capsys.readouterr().out)
    assert rep["ok"] is False and rep["problems"][0]["target"] == _first(out)


def _rewrite_with_digests(out, rel: str, data: bytes) -> None:
    """Replace an output file and make the manifest vouch for it (size, sha256, manifest digest): only a
    comparison with the source can then tell."""
    import hashlib

    (out / rel).write_bytes(data)
    p = out / "manifest.json"
    d = json.loads(p.read_text())
    d.pop("manifest_sha256")
    f = next(f for f in d["files"] if f["path"] == rel)
    f["size"], f["sha256"] = len(data), hashlib.sha256(data).hexdigest()
    d["manifest_sha256"] = _digest(d)
    p.write_text(json.dumps(d))


@pytest.mark.parametrize("which", ["first", "last"])
def test_source_compare_catches_bytes_the_manifest_vouches_for(out, llama_ckpt, which):
    """A shard that wrote a wrong byte and hashed it: verify alone passes, --source names the tensor. The
    slices are compared as bytes streamed from both files (column- and row-parallel ones alike)."""
    from adapt.shard.header import read_header

    rel = _first(out)
    h = read_header(out / rel)
    tensors = sorted(h.tensors.values(), key=lambda e: e.begin)
    e = [t for t in tensors if t.nbytes][0 if which == "first" else -1]
    data = bytearray((out / rel).read_bytes())
    data[e.begin + e.nbytes // 2] ^= 0x40
    _rewrite_with_digests(out, rel, bytes(data))
    assert verify(out).ok
    rep = verify(out, source=llama_ckpt)
    assert [(p.kind, p.target) for p in rep.problems] == [("source", f"{rel}:{e.name}")]


def test_source_compare_of_pure_slices_does_not_load_torch(out, llama_ckpt):
    """Slices are compared as bytes: a run without a transform to check never imports torch (1.3 s)."""
    import subprocess
    import sys

    code = ("import sys; from adapt.shard import verify; "
            f"r = verify({str(out)!r}, source={str(llama_ckpt)!r}); "
            "assert r.ok and r.tensors_compared > 0; print('torch' in sys.modules)")
    got = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert got.stdout.strip() == "False"
