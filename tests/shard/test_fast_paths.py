"""The fast I/O paths: copy_file_range and pread+write give the same bytes, strided gathers equal torch,
source digests are cached by (name, size, mtime_ns, inode) and hub-cache blob names are trusted only when
they look like LFS sha256 blobs."""

from __future__ import annotations

import hashlib
import os
import shutil

import pytest
import torch
from safetensors.torch import save_file

import adapt.shard.writer as writer
from adapt.shard import load_manifest, shard, verify
from adapt.shard.checkpoint import open_checkpoint
from adapt.shard.source_hash import hub_blob_sha256, source_digest
from adapt.shard.stream import byte_slice, iter_slice


def _hashes(out):
    return {f.path: f.sha256 for f in load_manifest(out).files}


def test_copy_range_path_bitwise_identical_to_read_write_path(tiny_ckpts, tmp_path, monkeypatch):
    ckpt = tiny_ckpts["qwen2"]
    monkeypatch.setattr(writer, "COPY_RANGE", True)
    shard(ckpt, tmp_path / "cfr", tp=2, max_file_size=20_000)
    monkeypatch.setattr(writer, "COPY_RANGE", False)
    shard(ckpt, tmp_path / "rw", tp=2, max_file_size=20_000)
    a, b = _hashes(tmp_path / "cfr"), _hashes(tmp_path / "rw")
    assert a == b
    for p in a:
        assert (tmp_path / "cfr" / p).read_bytes() == (tmp_path / "rw" / p).read_bytes()
        assert hashlib.sha256((tmp_path / "cfr" / p).read_bytes()).hexdigest() == a[p]
    assert verify(tmp_path / "cfr", source=ckpt).ok


def test_copy_range_unsupported_falls_back(tiny_ckpts, tmp_path, monkeypatch):
    def refuse(*a, **k):
        raise OSError(18, "Invalid cross-device link")
    monkeypatch.setattr(writer, "COPY_RANGE", True)
    monkeypatch.setattr(writer.os, "copy_file_range", refuse, raising=False)
    shard(tiny_ckpts["llama"], tmp_path / "o", tp=2)
    assert writer.COPY_RANGE is False
    assert verify(tmp_path / "o", source=tiny_ckpts["llama"]).ok


@pytest.mark.parametrize("shape,dim", [((7, 10), 0), ((7, 10), 1), ((3, 5, 6), 1), ((3, 5, 6), 2), ((1, 8, 4), 1),
                                       ((9,), 0), ((), None), ((4, 0), 1)])
def test_stream_equals_torch_narrow(tmp_path, shape, dim):
    x = torch.arange(max(1, torch.Size(shape).numel()), dtype=torch.bfloat16)[:torch.Size(shape).numel()].view(shape)
    save_file({"a": torch.ones(3), "x": x}, str(tmp_path / "model.safetensors"))
    ck, _ = open_checkpoint(tmp_path)
    start, stop = (0, 0) if dim is None else (shape[dim] // 3, shape[dim] - 1 if shape[dim] > 1 else shape[dim])
    want = x if dim is None else x.narrow(dim, start, stop - start).contiguous()
    got = ck.read("x", dim, start, stop)
    def raw(t):
        return t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""
    assert got.shape == want.shape and got.dtype == want.dtype and raw(got) == raw(want)
    pieces = iter_slice(ck.fd(ck.tensors["x"].file), ck.byte_slice("x", dim, start, stop), chunk=8)
    assert b"".join(bytes(p) for p in pieces) == raw(want)
    ck.close()


def test_byte_slice_contiguity():
    assert byte_slice(100, (4, 6), 2, 0, 1, 3) == byte_slice(100, (4, 6), 2, 0, 1, 3)
    b = byte_slice(100, (4, 6), 2, 0, 1, 3)
    assert (b.offset, b.nbytes, b.contiguous) == (112, 24, True)
    b = byte_slice(100, (4, 6), 2, 1, 3, 6)
    assert (b.offset, b.outer, b.run, b.stride, b.contiguous) == (106, 4, 6, 12, False)
    assert byte_slice(0, (1, 4, 6), 2, 1, 1, 2).contiguous


def test_source_digest_cache_invalidated_on_mtime_change(tmp_path):
    p = tmp_path / "model.safetensors"
    p.write_bytes(b"abc" * 1000)
    st = os.stat(p)
    first = source_digest(p, st, None)
    assert first["sha256_from"] == "hashed" and first["sha256"] == hashlib.sha256(p.read_bytes()).hexdigest()
    fake = dict(first, sha256="0" * 64)
    assert source_digest(p, st, fake)["sha256_from"] == "cached"  # same key: the cache is believed
    os.utime(p, ns=(st.st_atime_ns, st.st_mtime_ns + 1000))
    again = source_digest(p, os.stat(p), fake)
    assert again["sha256_from"] == "hashed" and again["sha256"] == first["sha256"]
    assert source_digest(p, os.stat(p), dict(fake, mtime_ns=os.stat(p).st_mtime_ns, size=1))["sha256_from"] == "hashed"


def test_rerun_reuses_source_digests_then_rehashes_after_touch(tiny_ckpts, tmp_path):
    ckpt = shutil.copytree(tiny_ckpts["llama"], tmp_path / "ck")
    shard(ckpt, tmp_path / "o", tp=2)
    m = load_manifest(tmp_path / "o")
    assert {s["sha256_from"] for s in m.source_files} == {"hashed"}
    m2 = shard(ckpt, tmp_path / "o", tp=2).manifest
    assert {s["sha256_from"] for s in m2.source_files} == {"cached"}
    victim = sorted(ckpt.glob("*.safetensors"))[0]
    st = victim.stat()
    os.utime(victim, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    m3 = shard(ckpt, tmp_path / "o", tp=2).manifest
    by = {s["name"]: s for s in m3.source_files}
    assert by[victim.name]["sha256_from"] == "hashed"
    assert [s["sha256"] for s in m3.source_files] == [s["sha256"] for s in m.source_files]
    assert verify(tmp_path / "o", source=ckpt).ok


def _hub_layout(tmp_path, src, name_of):
    repo = tmp_path / "models--org--tiny"
    snap = repo / "snapshots" / ("a" * 40)
    (repo / "blobs").mkdir(parents=True)
    snap.mkdir(parents=True)
    for f in src.iterdir():
        blob = repo / "blobs" / name_of(f)
        shutil.copy(f, blob)
        (snap / f.name).symlink_to(os.path.relpath(blob, snap))
    return snap


def test_hub_cache_blob_name_used_as_sha256(tiny_ckpts, tmp_path):
    src = tiny_ckpts["llama"]
    snap = _hub_layout(tmp_path, src, lambda f: hashlib.sha256(f.read_bytes()).hexdigest())
    m = shard(snap, tmp_path / "o", tp=2).manifest
    assert {s["sha256_from"] for s in m.source_files} == {"hub-blob"}
    assert verify(tmp_path / "o", source=snap).ok  # verify re-hashes: the blob names were right
    m2 = shard(snap, tmp_path / "o2", tp=2, trust_hub_cache=False).manifest
    assert {s["sha256_from"] for s in m2.source_files} == {"hashed"}
    assert [s["sha256"] for s in m.source_files] == [s["sha256"] for s in m2.source_files]


def test_hub_cache_non_lfs_or_plain_names_not_trusted(tmp_path):
    f = tmp_path / "x.safetensors"
    f.write_bytes(b"1")
    assert hub_blob_sha256(f) is None  # not a symlink
    src = tmp_path / "src"
    src.mkdir()
    (src / "model.safetensors").write_bytes(b"1")
    snap = _hub_layout(tmp_path / "h1", src, lambda f: "b" * 40)  # git sha1 blob: a non-LFS file
    assert hub_blob_sha256(snap / "model.safetensors") is None
    other = tmp_path / "elsewhere"
    other.mkdir()
    (other / ("c" * 64)).write_bytes(b"1")
    (tmp_path / "snapshots" / "r").mkdir(parents=True)
    link = tmp_path / "snapshots" / "r" / "model.safetensors"
    link.symlink_to(other / ("c" * 64))  # 64 hex, but not in the repo's blobs/
    assert hub_blob_sha256(link) is None


def _local_dir_meta(d, name, etag, written):
    meta = d / ".cache" / "huggingface" / "download"
    meta.mkdir(parents=True, exist_ok=True)
    (meta / f"{name}.metadata").write_text(f"{'a' * 40}\n{etag}\n{written}\n")


def test_hub_local_dir_metadata_used_as_sha256(tiny_ckpts, tmp_path):
    src = tmp_path / "local"
    shutil.copytree(tiny_ckpts["llama"], src)
    files = sorted(f for f in src.iterdir() if f.suffix == ".safetensors")
    for f in files:  # as `hf download --local-dir` leaves it: etag = LFS oid = sha256, written after the file
        _local_dir_meta(src, f.name, hashlib.sha256(f.read_bytes()).hexdigest(), f.stat().st_mtime + 0.5)
    m = shard(src, tmp_path / "o", tp=2).manifest
    assert {s["sha256_from"] for s in m.source_files} == {"hub-local-dir"}
    assert verify(tmp_path / "o", source=src).ok
    m2 = shard(src, tmp_path / "o2", tp=2, trust_hub_cache=False).manifest
    assert {s["sha256_from"] for s in m2.source_files} == {"hashed"}
    assert [s["sha256"] for s in m.source_files] == [s["sha256"] for s in m2.source_files]


def test_hub_local_dir_metadata_not_trusted_when_stale_or_not_lfs(tmp_path):
    f = tmp_path / "model.safetensors"
    f.write_bytes(b"12345678")
    st = os.stat(f)
    good = hashlib.sha256(b"12345678").hexdigest()
    _local_dir_meta(tmp_path, f.name, good, st.st_mtime + 0.5)
    assert source_digest(f, st, None)["sha256_from"] == "hub-local-dir"
    assert source_digest(f, st, None, trust_hub_cache=False)["sha256_from"] == "hashed"
    _local_dir_meta(tmp_path, f.name, good, st.st_mtime - 5)  # file edited after the download
    assert source_digest(f, st, None)["sha256_from"] == "hashed"
    _local_dir_meta(tmp_path, f.name, "b" * 40, st.st_mtime + 0.5)  # git sha1 etag: a non-LFS file
    assert source_digest(f, st, None)["sha256_from"] == "hashed"
    (tmp_path / ".cache/huggingface/download/model.safetensors.metadata").write_text("garbage")
    assert source_digest(f, st, None)["sha256_from"] == "hashed"


@pytest.mark.parametrize("writeback", [True, False])
def test_early_writeback_keeps_bytes_and_hash(tmp_path, monkeypatch, writeback):
    monkeypatch.setattr(writer, "WRITEBACK", writeback and hasattr(os, "posix_fadvise"))
    monkeypatch.setattr(writer, "WRITEBACK_EVERY", 1 << 16)
    data = os.urandom(3 << 20)
    with writer.AtomicFile(tmp_path / "f.bin") as f:
        for i in range(0, len(data), 100_003):  # odd piece sizes across many windows
            f.write(data[i:i + 100_003])
    assert (tmp_path / "f.bin").read_bytes() == data
    assert f.sha256 == hashlib.sha256(data).hexdigest() and f.size == len(data)
