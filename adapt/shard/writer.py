"""Atomic file writing: temporary name, fsync, rename, directory fsync; sha256 computed while writing.

A final file name therefore only ever holds a complete file. Safetensors files are streamed: the header
is known up front (shapes and dtypes come from the plan), then each tensor's bytes are appended, so only
one tensor slice is in memory at a time.
"""

from __future__ import annotations

import errno
import hashlib
import os
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Iterable

from adapt.errors import ShardError
from adapt.shard.header import encode_header

if TYPE_CHECKING:  # imported only where a tensor is handled: pure slicing never loads torch (~0.8 s)
    import torch

TMP_MARK = ".adapt-tmp-"
HASH_CHUNK = 1 << 20
# A buffer at least this large is hashed on a lane thread while the caller writes it (both release the GIL), so
# one file's write costs max(write, hash) rather than their sum; smaller ones are hashed inline.
OVERLAP_MIN = 256 << 10
# fadvise(DONTNEED) on written ranges starts their writeback without waiting (AtomicFile._writeback);
# ADAPT_SHARD_WRITEBACK=0 turns it off.
WRITEBACK_EVERY = 64 << 20
WRITEBACK = hasattr(os, "posix_fadvise") and os.environ.get("ADAPT_SHARD_WRITEBACK", "1") != "0"
_lanes: ThreadPoolExecutor | None = None
_lanes_lock = threading.Lock()


def _hash_lanes() -> ThreadPoolExecutor:
    global _lanes
    with _lanes_lock:
        if _lanes is None:
            _lanes = ThreadPoolExecutor(max_workers=max(2, os.cpu_count() or 2), thread_name_prefix="adapt-sha")
        return _lanes


def tmp_name(path: Path) -> Path:
    return path.with_name(f".{path.name}{TMP_MARK}{os.getpid()}")


def fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


class AtomicFile:
    """``with AtomicFile(path) as f: f.write(b)``: hashed, fsynced and renamed on success, removed on error."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self.tmp = tmp_name(self.path)
        self.sha = hashlib.sha256()
        self.size = 0
        self._wb = [0, 0]  # start of the window written back last, start of the one not yet

    def __enter__(self) -> "AtomicFile":
        self.path.parent.mkdir(parents=True, exist_ok=True)
        try:
            self.f = open(self.tmp, "w+b", buffering=0)  # read back: see copy_range
        except OSError as e:
            raise ShardError(f"cannot write {self.tmp}: {e.strerror}") from e
        return self

    def write(self, data) -> None:
        """Append ``data``; it is hashed from the same buffer it is written from, before this returns."""
        mv = memoryview(data).cast("B")
        lane = _hash_lanes().submit(self.sha.update, mv) if mv.nbytes >= OVERLAP_MIN else None
        if lane is None:
            self.sha.update(mv)
        try:
            done = 0
            while done < mv.nbytes:
                done += self.f.write(mv[done:])
        finally:
            if lane is not None:
                lane.result()  # the caller may reuse the buffer once this returns
        self.size += mv.nbytes
        self._writeback()

    def _writeback(self) -> None:
        """Every WRITEBACK_EVERY bytes, start writing the new window to disk and drop the older one (clean by
        now) from the page cache: the final fsync then has little left to wait for, and output pages do not
        crowd the cache out (the kernel would start on its own only past dirty_background_ratio of RAM)."""
        if not WRITEBACK or self.size - self._wb[1] < WRITEBACK_EVERY:
            return
        try:
            os.posix_fadvise(self.f.fileno(), self._wb[0], self.size - self._wb[0], os.POSIX_FADV_DONTNEED)
        except OSError:
            pass  # advice only
        self._wb = [self._wb[1], self.size]

    def copy_range(self, src_fd: int, offset: int, n: int, on_bytes: Callable[[int], None] | None = None) -> None:
        """Append ``n`` bytes of ``src_fd`` from ``offset`` with ``os.copy_file_range`` (in-kernel, no copy
        through user space), then hash them by reading back what landed in this file, chunk by chunk while it
        is in the page cache, so the digest is of the output bytes themselves. Raises OSError (nothing
        appended) when the kernel or filesystem cannot copy; callers then fall back to read + write."""
        fd = self.f.fileno()
        buf = _hash_buffer()
        done = 0
        while done < n:
            want = min(buf.nbytes, n - done)
            k = os.copy_file_range(src_fd, fd, want, offset + done)
            if k <= 0:
                if done == 0:
                    raise OSError(errno.EIO, "copy_file_range copied nothing")
                raise ShardError(f"cannot write {self.path}: source ended inside a tensor")
            got = 0
            while got < k:
                r = os.preadv(fd, [buf[got:k]], self.size + got)
                if r <= 0:
                    raise ShardError(f"cannot read back {self.tmp}")
                got += r
            self.sha.update(buf[:k])
            self.size += k
            self._writeback()
            done += k
            if on_bytes:
                on_bytes(k)

    def __exit__(self, exc_type, exc, tb) -> None:
        try:
            if exc_type is None:
                self.f.flush()
                os.fsync(self.f.fileno())
            self.f.close()
            if exc_type is None:
                os.replace(self.tmp, self.path)
                fsync_dir(self.path.parent)
        except OSError as e:
            raise ShardError(f"cannot write {self.path}: {e.strerror}") from e
        finally:
            if self.tmp.exists():
                self.tmp.unlink()

    @property
    def sha256(self) -> str:
        return self.sha.hexdigest()


_local = threading.local()


def _hash_buffer() -> memoryview:
    b = getattr(_local, "buf", None)
    if b is None:
        b = _local.buf = memoryview(bytearray(HASH_CHUNK))
    return b


class RangeCopy:
    """A tensor whose output bytes are one contiguous range of a source file: ``write_safetensors`` moves it
    with ``copy_file_range`` when ``COPY_RANGE`` allows and the filesystem supports it, else ``fallback()``
    (an iterable of byte pieces) is read and written."""

    def __init__(self, fd: int, offset: int, nbytes: int, fallback: Callable[[], Iterable]):
        self.fd, self.offset, self.nbytes, self.fallback = fd, offset, nbytes, fallback


# Off by default: on this project's reference VM (ext4), 1 MiB pread + write + hash beat copy_file_range +
# read-back hashing (bench/shard_bench.py); ADAPT_SHARD_COPY_RANGE=1 turns it on (e.g. reflink filesystems).
COPY_RANGE = hasattr(os, "copy_file_range") and os.environ.get("ADAPT_SHARD_COPY_RANGE") == "1"
_COPY_ERRNOS = {errno.EXDEV, errno.ENOSYS, errno.EOPNOTSUPP, errno.EINVAL, errno.EBADF, errno.EIO}


def tensor_bytes(t: "torch.Tensor") -> memoryview:
    """The raw little-endian bytes of a tensor, without a copy when it is contiguous."""
    import torch

    t = t.contiguous().reshape(-1)
    if t.numel() == 0:
        return memoryview(b"")
    return memoryview(t.view(torch.uint8).numpy())


def write_safetensors(path: Path, specs: list[tuple[str, str, tuple[int, ...]]],
                      produce: Callable[[int], "torch.Tensor | Iterable"],
                      on_bytes: Callable[[int], None] | None = None,
                      after_tensor: Callable[[], None] | None = None) -> tuple[int, str]:
    """Stream a safetensors file: specs (name, dtype, shape) in order; ``produce(i)`` gives tensor i, either
    as a torch tensor (checked against its spec) or as an iterable of byte buffers (raw little-endian bytes
    in order, e.g. :func:`adapt.shard.stream.iter_slice`), each hashed from the same buffer it is written from.

    Returns (size, sha256). The byte count of every tensor is checked against its planned offsets.
    """
    header, offs = encode_header(specs)
    with AtomicFile(path) as f:
        f.write(header)
        for i, (name, dtype, shape) in enumerate(specs):
            want = offs[i][1] - offs[i][0]
            t = produce(i)
            torch = sys.modules.get("torch")  # a tensor can only exist once torch is imported
            if torch is not None and isinstance(t, torch.Tensor):
                if tuple(t.shape) != tuple(shape) or str(t.dtype).replace("torch.", "") != dtype:
                    raise ShardError(f"internal: {name} produced {tuple(t.shape)} {t.dtype}, planned {shape} {dtype}")
                b = tensor_bytes(t)
                assert b.nbytes == want
                f.write(b)
                del t, b
                if on_bytes:
                    on_bytes(want)
            else:
                if isinstance(t, RangeCopy):
                    if t.nbytes != want:
                        raise ShardError(f"internal: {name} is {t.nbytes} bytes, planned {want}")
                    global COPY_RANGE
                    if COPY_RANGE and t.nbytes:
                        try:
                            f.copy_range(t.fd, t.offset, t.nbytes, on_bytes)
                            if after_tensor:
                                after_tensor()
                            continue
                        except OSError as e:
                            if e.errno not in _COPY_ERRNOS:
                                raise ShardError(f"cannot write {path}: {e.strerror}") from e
                            COPY_RANGE = False  # this kernel or filesystem cannot; read + write from now on
                    t = t.fallback()
                got = 0
                for piece in t:
                    f.write(piece)
                    got += piece.nbytes
                    if on_bytes:
                        on_bytes(piece.nbytes)
                if got != want:
                    raise ShardError(f"internal: {name} produced {got} bytes, planned {want}")
            if after_tensor:
                after_tensor()
    return f.size, f.sha256


def write_bytes(path: Path, data: bytes) -> tuple[int, str]:
    with AtomicFile(path) as f:
        f.write(data)
    return f.size, f.sha256


def sha256_file(path: Path, on_bytes: Callable[[int], None] | None = None) -> str:
    h = hashlib.sha256()
    buf = bytearray(HASH_CHUNK)
    mv = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        while True:
            n = f.readinto(buf)
            if not n:
                break
            h.update(mv[:n])
            if on_bytes:
                on_bytes(n)
    return h.hexdigest()


def remove_stale_tmp(dirs: Iterable[Path]) -> None:
    """Delete temporary files a killed run left behind."""
    for d in dirs:
        if d.is_dir():
            for p in d.iterdir():
                if TMP_MARK in p.name and p.is_file():
                    p.unlink()
