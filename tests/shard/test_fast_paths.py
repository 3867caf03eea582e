"""The fast I/O paths: one pass per source file gives the same bytes for any read chunking and with hashing on
lanes, strided gathers equal torch,
source digests are cached by (name, size, mtime_ns, inode) and hub-cache blob names are trusted only when
they look like LFS sha256 blobs."""

from __future__ import annotations

import hashlib
import os
import shutil

import pytest
import torch
from safetensors.torch import save_file

import adapt.shard.run as run_mod
import adapt.shard.stream as stream
import adapt.shard.writer as writer
from adapt.shard import load_manifest, shard, verify
from adapt.shard.checkpoint import open_checkpoint
from adapt.shard.source_hash import hub_blob_sha256, source_digest
from adapt.shard.stream import byte_slice, chunk_pieces, iter_slice


def _hashes(out):
    return {f.path: f.sha256 for f in load_manifest(out).files}


def _raw(t):
    return t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("loop,direct", [(2048, 65536), (0, 65536), (0, 4)])  # numpy gather, row loop, no gather
def test_chunk_pieces_equal_narrow_for_any_chunking(seed, loop, direct, monkeypatch):
    """A slice's share of arbitrary (unaligned, tiny, huge) chunks, joined, is the slice's bytes in order."""
    monkeypatch.setattr(stream, "GATHER_LOOP", loop)
    monkeypatch.setattr(stream, "GATHER_BELOW", direct)
    g = torch.Generator().manual_seed(seed)
    for _ in range(40):
        nd = int(torch.randint(1, 4, (1,), generator=g))
        shape = tuple(int(x) for x in torch.randint(1, 7, (nd,), generator=g))
        x = torch.arange(torch.Size(shape).numel(), dtype=torch.int16).view(shape)
        raw = _raw(x)
        dim = int(torch.randint(0, nd, (1,), generator=g))
        start = int(torch.randint(0, shape[dim], (1,), generator=g))
        stop = int(torch.randint(start, shape[dim] + 1, (1,), generator=g))
        bs = byte_slice(0, shape, 2, dim, start, stop)
        cuts = sorted({0, len(raw), *(int(c) for c in torch.randint(0, len(raw) + 1, (3,), generator=g))})
        got, gather = b"", memoryview(bytearray(len(raw) + 8))
        for a, b in zip(cuts, cuts[1:]):
            got += b"".join(bytes(p) for p in chunk_pieces(bs, a, b, memoryview(raw)[a:b], gather))
        assert got == _raw(x.narrow(dim, start, stop - start).contiguous()), (shape, dim, start, stop, cuts)


@pytest.mark.parametrize("chunk", [24, 1000])
def test_tiny_read_chunks_give_the_same_files(tiny_ckpts, tmp_path, monkeypatch, chunk):
    """Chunks smaller than a row (partial runs at both ends) or not a multiple of it give the same bytes."""
    ckpt = tiny_ckpts["qwen2_moe"]
    shard(ckpt, tmp_path / "ref", tp=2, ep=2, max_file_size=20_000)
    monkeypatch.setattr(stream, "CHUNK", chunk)  # the worker threads are new: their buffers take this size
    shard(ckpt, tmp_path / "small", tp=2, ep=2, max_file_size=20_000, workers=1)
    assert _hashes(tmp_path / "small") == _hashes(tmp_path / "ref")
    assert verify(tmp_path / "small", source=ckpt).ok


def test_hash_lanes_give_the_same_files(tiny_ckpts, tmp_path, monkeypatch):
    ckpt = tiny_ckpts["llama"]
    shard(ckpt, tmp_path / "inline", tp=2, workers=2)
    monkeypatch.setattr(run_mod, "usable_cores", lambda: 8)  # fewer workers than cores: hash on lanes
    monkeypatch.setattr(writer, "OVERLAP_MIN", 1)
    shard(ckpt, tmp_path / "lanes", tp=2, workers=1)
    assert _hashes(tmp_path / "lanes") == _hashes(tmp_path / "inline")
    assert load_manifest(tmp_path / "lanes").source_files == load_manifest(tmp_path / "inline").source_files


def test_every_output_file_draws_on_one_source_file(tiny_ckpts, tmp_path):
    m = shard(tiny_ckpts["qwen2_moe"], tmp_path / "o", tp=2, ep=2, max_file_size=20_000).manifest
    for f in m.files:
        assert len({t.source_file for t in f.tensors}) == 1, f.path


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


def _direct_supported(d) -> bool:
    try:
        os.close(os.open(d / "probe", os.O_WRONLY | os.O_CREAT | os.O_DIRECT, 0o644))
        return True
    except OSError:
        return False


def _odd_pieces(data, step=100_003):
    return [data[i:i + step] for i in range(0, len(data), step)]


@pytest.mark.parametrize("n", [0, 1, 4095, 8192, 3 * 8192 + 17, (1 << 20) + 5])
def test_direct_io_file_is_exact(tmp_path, n):
    """O_DIRECT through 8 KiB staging buffers: odd piece sizes, a padded last block cut back to the size."""
    data = os.urandom(n)
    with writer.AtomicFile(tmp_path / "f.bin", direct_stage=8192) as f:
        for piece in _odd_pieces(data, 3001):
            f.write(piece)
    assert (tmp_path / "f.bin").read_bytes() == data
    assert f.sha256 == hashlib.sha256(data).hexdigest() and f.size == n
    assert [p.name for p in tmp_path.iterdir()] == ["f.bin"]


def test_direct_io_refused_by_the_filesystem_falls_back(tmp_path, monkeypatch):
    real_open, real_pwrite = os.open, writer.pwrite_all
    monkeypatch.setattr(writer, "DIRECT", True)

    def no_direct_open(path, flags, *a):
        if flags & os.O_DIRECT:
            raise OSError(22, "Invalid argument")
        return real_open(path, flags, *a)
    monkeypatch.setattr(writer.os, "open", no_direct_open)
    data = os.urandom(50_000)
    with writer.AtomicFile(tmp_path / "a.bin", direct_stage=8192) as f:
        f.write(data)
    assert f.direct is None and (tmp_path / "a.bin").read_bytes() == data
    monkeypatch.setattr(writer.os, "open", real_open)

    calls = []

    def einval_once(fd, view, offset):  # the flag is taken but the I/O is not (some FUSE filesystems)
        calls.append(offset)
        if len(calls) == 1:
            raise OSError(22, "Invalid argument")
        return real_pwrite(fd, view, offset)
    monkeypatch.setattr(writer, "pwrite_all", einval_once)
    with writer.AtomicFile(tmp_path / "b.bin", direct_stage=8192) as f:
        for piece in _odd_pieces(data, 777):
            f.write(piece)
    assert (tmp_path / "b.bin").read_bytes() == data and f.sha256 == hashlib.sha256(data).hexdigest()
    assert writer.DIRECT is False  # later files go straight to the page cache


def test_shard_through_direct_io_equals_page_cache(tiny_ckpts, tmp_path, monkeypatch):
    ckpt = tiny_ckpts["deepseek_v3"]
    monkeypatch.setattr(writer, "DIRECT", True)
    monkeypatch.setattr(writer, "DIRECT_MIN", 0)
    monkeypatch.setenv("ADAPT_SHARD_DIRECT", "0")
    assert shard(ckpt, tmp_path / "cached", tp=2, ep=2, max_file_size=20_000).io == \
        "page cache (ADAPT_SHARD_DIRECT=0)"
    monkeypatch.setenv("ADAPT_SHARD_DIRECT", "1")
    monkeypatch.setattr(writer, "STAGE", 8192)
    import adapt.shard.fanout as fanout
    monkeypatch.setattr(fanout, "STAGE", 8192)
    monkeypatch.setattr(fanout, "STAGE_MIN", 4096)
    made = []
    real_init = writer._Direct.__init__
    monkeypatch.setattr(writer._Direct, "__init__", lambda self, *a: made.append(1) or real_init(self, *a))
    shard(ckpt, tmp_path / "direct", tp=2, ep=2, max_file_size=20_000)
    if _direct_supported(tmp_path):
        assert len(made) >= len(load_manifest(tmp_path / "direct").files)
    assert _hashes(tmp_path / "direct") == _hashes(tmp_path / "cached")
    assert verify(tmp_path / "direct", source=ckpt).ok


def test_each_source_byte_is_read_once_for_all_ranks(tiny_ckpts, tmp_path, monkeypatch):
    """tp=2 with row-parallel slices, one unit per source file: the pass that hashes a file also feeds both
    ranks, so the bytes read are exactly the checkpoint's (header included), not once per rank."""
    import adapt.shard.fanout as fanout

    ckpt = tiny_ckpts["llama"]
    read = []
    real = fanout.pread_into
    monkeypatch.setattr(fanout, "pread_into", lambda fd, dest, offset: read.append(dest.nbytes) or
                        real(fd, dest, offset))
    m = shard(ckpt, tmp_path / "o", tp=2, workers=1, trust_hub_cache=False).manifest
    files = sorted(ckpt.glob("*.safetensors"))
    assert sum(read) == sum(f.stat().st_size for f in files)
    assert {s["sha256_from"] for s in m.source_files} == {"hashed"}
    assert any(t.slice.dim == 1 for f in m.files for t in f.tensors)  # row-parallel slices were there
    assert verify(tmp_path / "o", source=ckpt).ok
