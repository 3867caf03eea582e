"""The shard's sha256 (adapt.shard.hashing): the native two-stream form and the hashlib fallback give hashlib's
digests for any interleaving of updates over several streams, files hashed together equal files hashed alone,
and every digest a shard run records equals hashlib's digest of the file on disk."""

from __future__ import annotations

import hashlib
import json
import os
import platform
import random
import shutil

import pytest

import adapt.shard.fanout as fanout
import adapt.shard.stream as stream
import adapt.shard.writer as writer
from adapt.errors import ShardError
from adapt.shard import hashing, load_manifest, shard, verify


@pytest.fixture(params=["native", "hashlib"])
def mode(request, monkeypatch):
    """Each test once with the native library (skipped where it cannot be had) and once with hashlib."""
    monkeypatch.setattr(hashing, "_tried", False)
    monkeypatch.setattr(hashing, "_lib", None)
    if request.param == "hashlib":
        monkeypatch.setenv(hashing.ENV, "hashlib")
    else:
        monkeypatch.delenv(hashing.ENV, raising=False)
        if hashing.native() is None:
            pytest.skip(f"no native sha256 here: {hashing.status()}")
    yield request.param
    assert (hashing.native() is not None) == (request.param == "native")


def _has_sha_extensions() -> bool:
    try:
        with open("/proc/cpuinfo") as f:
            return any(line.startswith("flags") and " sha_ni" in line for line in f)
    except OSError:
        return False


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64") or not _has_sha_extensions()
                    or shutil.which(os.environ.get("CC", "cc")) is None,
                    reason="the native sha256 needs x86-64 with the SHA extensions and a C compiler")
def test_native_is_used_where_it_can_be(monkeypatch):
    """On such a host a silent fallback to hashlib would halve shard's hashing rate: it must not happen."""
    monkeypatch.delenv(hashing.ENV, raising=False)
    monkeypatch.setattr(hashing, "_tried", False)
    monkeypatch.setattr(hashing, "_lib", None)
    assert hashing.native() is not None, hashing.status()
    assert hashing.status().startswith("native")


@pytest.mark.parametrize("seed", range(3))
def test_batches_equal_hashlib_for_any_interleaving(mode, seed):
    rng = random.Random(seed)
    for _ in range(60):
        k = rng.randint(1, 5)
        edge = [0, 1, 55, 56, 63, 64, 65, 119, 120, 128, 4096 + 3]
        data = [os.urandom(rng.choice(edge + [rng.randint(0, 20000)])) for _ in range(k)]
        hs = [hashing.Sha256() for _ in range(k)]
        pos, batch = [0] * k, hashing.Batch()
        while any(p < len(d) for p, d in zip(pos, data)):
            i = rng.randrange(k)
            n = rng.randint(0, len(data[i]) - pos[i])
            piece = data[i][pos[i]:pos[i] + n]
            # writable buffers (read and staging buffers) and read-only ones (file headers)
            batch.add(hs[i], memoryview(bytearray(piece)) if rng.random() < 0.7 else piece)
            pos[i] += n
            if rng.random() < 0.3:
                batch.flush()
            if rng.random() < 0.1:
                batch.flush()
                assert hs[i].hexdigest() == hashlib.sha256(data[i][:pos[i]]).hexdigest()  # and goes on after
        batch.flush()
        assert [h.hexdigest() for h in hs] == [hashlib.sha256(d).hexdigest() for d in data]


def test_one_stream_updates_equal_hashlib(mode):
    data = os.urandom(300_001)
    h = hashing.Sha256()
    cuts = [0, 1, 64, 65, 1000, 1063, 200_000, len(data)]
    for a, b in zip(cuts, cuts[1:]):
        h.update(memoryview(bytearray(data[a:b])))
    assert h.hexdigest() == hashlib.sha256(data).hexdigest()
    assert hashing.Sha256().hexdigest() == hashlib.sha256(b"").hexdigest()


def test_files_hashed_together_equal_hashlib(mode, tmp_path):
    sizes = [0, 1, 63, 64, 65, 1 << 16, (1 << 16) + 7, 333_333, 5]
    paths = []
    for i, n in enumerate(sizes):
        p = tmp_path / f"f{i}"
        p.write_bytes(os.urandom(n))
        paths.append(p)
    paths.insert(3, tmp_path / "absent")
    for threads in (1, 2, 3):
        got = hashing.sha256_files(paths, threads=threads, chunk=1 << 14)
        assert isinstance(got[3], OSError)
        assert [g for i, g in enumerate(got) if i != 3] == \
            [hashlib.sha256(p.read_bytes()).hexdigest() for i, p in enumerate(paths) if i != 3]


def test_bad_mode_is_a_one_line_error(monkeypatch):
    monkeypatch.setenv(hashing.ENV, "fast")
    monkeypatch.setattr(hashing, "_tried", False)
    with pytest.raises(ShardError, match="ADAPT_SHARD_SHA must be auto or hashlib"):
        hashing.native()


def _recorded_digests_are_hashlibs(out, src) -> None:
    m = load_manifest(out)
    for f in m.files:
        assert f.sha256 == hashlib.sha256((out / f.path).read_bytes()).hexdigest(), f.path
    for e in m.extra_files:
        assert e["sha256"] == hashlib.sha256((out / e["path"]).read_bytes()).hexdigest(), e["path"]
    for s in m.source_files:
        assert s["sha256"] == hashlib.sha256((src / s["name"]).read_bytes()).hexdigest(), s["name"]


@pytest.mark.parametrize("hub", [False, True])
@pytest.mark.parametrize("family,degrees", [("llama", dict(tp=2)), ("qwen2_moe", dict(tp=4, ep=2)),
                                            ("deepseek_v3", dict(tp=2, pp=2))])
def test_shard_records_hashlib_digests(mode, tiny_ckpts, tmp_path, monkeypatch, family, degrees, hub):
    """Small read chunks (many per tensor, rows split across them), several ranks' gathers per chunk, direct
    staging smaller than a chunk (a staging buffer handed out twice within one chunk): every recorded digest
    is still hashlib's of the bytes on disk, for outputs and sources alike. With the sources' sha256 on
    record (``hub``: as `hf download --local-dir` leaves them), column-parallel slices are streamed two at a
    time (fanout._interleave), and the same holds."""
    ckpt = tiny_ckpts[family]
    interleaved = []
    if hub:
        ckpt = shutil.copytree(ckpt, tmp_path / "local")
        meta = ckpt / ".cache" / "huggingface" / "download"
        meta.mkdir(parents=True)
        for f in ckpt.glob("*.safetensors"):
            digest = hashlib.sha256(f.read_bytes()).hexdigest()
            (meta / f"{f.name}.metadata").write_text(f"{'a' * 40}\n{digest}\n{f.stat().st_mtime + 0.5}\n")
        real = fanout._UnitRun._interleave
        monkeypatch.setattr(fanout._UnitRun, "_interleave",
                            lambda self, *a: interleaved.append(1) or real(self, *a))
    monkeypatch.setattr(stream, "CHUNK", 10_000)
    monkeypatch.setattr(writer, "DIRECT_MIN", 0)
    monkeypatch.setattr(fanout, "STAGE", 4096)
    monkeypatch.setattr(fanout, "STAGE_MIN", 4096)
    monkeypatch.setenv("ADAPT_SHARD_DIRECT", "1")
    out = tmp_path / "out"
    r = shard(ckpt, out, max_file_size=20_000, trust_hub_cache=hub, **degrees)
    assert r.hash == hashing.status() and r.hash.startswith(mode)
    assert {s["sha256_from"] for s in r.manifest.source_files} == {"hub-local-dir" if hub else "hashed"}
    assert bool(interleaved) == hub
    _recorded_digests_are_hashlibs(out, ckpt)
    assert verify(out, source=ckpt).ok
    # and the text summary says which sha256 ran
    assert json.loads(json.dumps(r.to_dict()))["hash"].startswith(mode)
