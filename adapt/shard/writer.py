"""Atomic file writing: temporary name, fsync, rename, directory fsync; sha256 computed while writing.

A final file name therefore only ever holds a complete file. Safetensors files are streamed: the header
is known up front (shapes and dtypes come from the plan), then each tensor's bytes are appended, so only
one tensor slice is in memory at a time.

Large files are written with ``O_DIRECT`` where the filesystem allows it (``direct_stage``): bytes are copied
into two page-aligned staging buffers, and a full one is written to the device on an I/O thread while the
other fills; the last partial block is padded, written, and the file truncated to its size. Whether a run
takes it is decided per run (``iomode.direct_io``: where the device is fast, O_DIRECT saves the CPU a shard run
is bound by; where it is slow, the page cache's writeback gets more out of it). A filesystem that refuses
O_DIRECT (tmpfs, some FUSE) gets the page-cache path with early writeback.
"""

from __future__ import annotations

import errno
import fcntl
import mmap
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Iterable

from adapt.errors import ShardError
from adapt.shard.hashing import Batch, Sha256
from adapt.shard.header import encode_header

if TYPE_CHECKING:  # imported only where a tensor is handled: pure slicing never loads torch (~0.8 s)
    import torch

TMP_MARK = ".adapt-tmp-"
# With ``overlap`` (fewer writers than cores), a buffer at least this large is hashed on a lane thread while the
# caller writes it to the page cache (both release the GIL), so the write costs max(write, hash), not the sum.
# Without it the writer hashes inline, from its own core's cache: with one writer per core, handing the hash to a
# lane made a 2.1 GB tp=2 run 1.2-1.3x slower on 2 cores (threads competing for the cores, buffers crossing them).
OVERLAP_MIN = 256 << 10
# fadvise(DONTNEED) on written ranges starts their writeback without waiting (AtomicFile._writeback);
# ADAPT_SHARD_WRITEBACK=0 turns it off.
WRITEBACK_EVERY = 64 << 20
WRITEBACK = hasattr(os, "posix_fadvise") and os.environ.get("ADAPT_SHARD_WRITEBACK", "1") != "0"
DIRECT = hasattr(os, "O_DIRECT")  # False once a filesystem took the flag but refused the I/O (EINVAL)
ALIGN = 4096  # O_DIRECT offsets, lengths and buffer addresses: a multiple of the logical block size
STAGE = 4 << 20  # bytes per staging buffer (two per file being written)
DIRECT_MIN = 8 << 20  # files smaller than this go through the page cache
_pools: dict[str, ThreadPoolExecutor] = {}
_pools_lock = threading.Lock()


def io_pool(name: str, workers: int = 0) -> ThreadPoolExecutor:
    """The process's thread pool ``name`` (made at first use: ``workers`` threads, default one per core, at
    least 2)."""
    with _pools_lock:
        if name not in _pools:
            _pools[name] = ThreadPoolExecutor(max_workers=workers or max(2, os.cpu_count() or 2),
                                              thread_name_prefix=name)
        return _pools[name]


def _hash_lanes() -> ThreadPoolExecutor:
    return io_pool("adapt-sha")


def pwrite_all(fd: int, data: memoryview, offset: int) -> None:
    done = 0
    while done < data.nbytes:
        n = os.pwrite(fd, data[done:], offset + done)
        if n <= 0:
            raise OSError(errno.EIO, "short write")
        done += n


class _Direct:
    """Appends through two aligned staging buffers of ``stage`` bytes; a full one goes to the device on an I/O
    thread while the other fills. The first write is synchronous: a filesystem that takes the O_DIRECT flag
    but not the I/O (EINVAL) switches this descriptor, and later files, to the page cache."""

    def __init__(self, fd: int, stage: int):
        self.fd, self.stage = fd, stage
        self.maps = [mmap.mmap(-1, stage) for _ in range(2)]  # anonymous maps: page aligned
        self.views = [memoryview(m) for m in self.maps]
        self.cur, self.fill, self.pos = 0, 0, 0
        self.pending: list = [None, None]
        self.direct = True

    def write(self, mv: memoryview) -> None:
        done, n = 0, mv.nbytes
        while done < n:
            k = min(self.stage - self.fill, n - done)
            self.views[self.cur][self.fill:self.fill + k] = mv[done:done + k]
            self.fill += k
            done += k
            if self.fill == self.stage:
                self._flush()

    def reserve(self, n: int) -> memoryview:
        """Up to ``n`` bytes of free staging to fill in place (e.g. with ``preadv``), then ``commit``."""
        return self.views[self.cur][self.fill:self.fill + min(n, self.stage - self.fill)]

    def commit(self, n: int) -> None:
        self.fill += n
        if self.fill == self.stage:
            self._flush()

    def _first(self, data: memoryview) -> None:
        global DIRECT
        try:
            pwrite_all(self.fd, data, self.pos)
        except OSError as e:
            if e.errno != errno.EINVAL:
                raise
            DIRECT = self.direct = False
            fcntl.fcntl(self.fd, fcntl.F_SETFL, fcntl.fcntl(self.fd, fcntl.F_GETFL) & ~os.O_DIRECT)
            pwrite_all(self.fd, data, self.pos)

    def _flush(self) -> None:
        view = self.views[self.cur]
        if self.pos == 0:
            self._first(view)
        else:
            self.pending[self.cur] = io_pool("adapt-io").submit(pwrite_all, self.fd, view, self.pos)
        self.pos += self.stage
        self.cur ^= 1
        self._wait(self.cur)
        self.fill = 0

    def _wait(self, i: int) -> None:
        fut, self.pending[i] = self.pending[i], None
        if fut is not None:
            fut.result()

    def finish(self, size: int) -> None:
        """Write what is staged (padded to a block) and cut the file to ``size``."""
        self._wait(0)
        self._wait(1)
        if self.fill:
            end = self.fill + (-self.fill % ALIGN if self.direct else 0)
            view = self.views[self.cur]
            view[self.fill:end] = bytes(end - self.fill)
            if self.pos == 0:
                self._first(view[:end])
            else:
                pwrite_all(self.fd, view[:end], self.pos)
        os.ftruncate(self.fd, size)

    def close(self) -> None:
        for i in (0, 1):
            try:
                self._wait(i)
            except OSError:
                pass
        for v in self.views:
            v.release()
        for m in self.maps:
            try:
                m.close()
            except BufferError:
                pass  # a caller still holds a reserved view; the map goes with it


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

    def __init__(self, path: Path, overlap: bool = False, direct_stage: int = 0, batch: Batch | None = None):
        self.path = Path(path)
        self.overlap = overlap
        self.batch = batch  # hash through it: the caller flushes it before it reuses a buffer it wrote from
        self.tmp = tmp_name(self.path)
        self.sha = Sha256()
        self.size = 0
        self._wb = [0, 0]  # start of the window written back last, start of the one not yet
        self.stage = direct_stage - direct_stage % ALIGN
        self.direct: _Direct | None = None

    def __enter__(self) -> "AtomicFile":
        self.path.parent.mkdir(parents=True, exist_ok=True)
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_CLOEXEC", 0)
        try:
            fd = -1
            if DIRECT and self.stage > 0:
                try:
                    fd = os.open(self.tmp, flags | os.O_DIRECT, 0o644)
                except OSError as e:
                    if e.errno != errno.EINVAL:
                        raise
            if fd < 0:
                fd = os.open(self.tmp, flags, 0o644)
            else:
                self.direct = _Direct(fd, self.stage)
            self.f = open(fd, "wb", buffering=0)
        except OSError as e:
            raise ShardError(f"cannot write {self.tmp}: {e.strerror}") from e
        return self

    def write(self, data) -> None:
        """Append ``data``; it is hashed from the same buffer it is written from, before this returns (with a
        batch: by its next flush)."""
        mv = memoryview(data).cast("B")
        # a lane only for page-cache writes: a direct write is a copy into staging, too short to hide a hash behind
        # (one unit, 2 cores, 2.1 GB: 2.6-2.8 s with lanes, 2.3 s without)
        lane = None
        if self.batch is not None:
            self.batch.add(self.sha, mv)
        elif self.overlap and self.direct is None and mv.nbytes >= OVERLAP_MIN:
            lane = _hash_lanes().submit(self.sha.update, mv)
        else:
            self.sha.update(mv)
        try:
            if self.direct is not None:
                self.direct.write(mv)
            else:
                done = 0
                while done < mv.nbytes:
                    done += self.f.write(mv[done:])
        finally:
            if lane is not None:
                lane.result()  # the caller may reuse the buffer once this returns
        self.size += mv.nbytes
        self._writeback()

    def reserve(self, n: int) -> memoryview | None:
        """Direct files: a view of up to ``n`` bytes of staging to fill in place, saving the copy ``write``
        makes; ``commit(view)`` then appends (and hashes) it. None for page-cache files. With a batch, flush it
        before the next ``reserve``: the one after may hand out the same staging again."""
        return self.direct.reserve(n) if self.direct is not None and n > 0 else None

    def commit(self, view: memoryview) -> None:
        if self.batch is not None:
            self.batch.add(self.sha, view)  # flushed before this staging buffer is filled again
        else:
            self.sha.update(view)
        self.size += view.nbytes
        self.direct.commit(view.nbytes)

    def _writeback(self) -> None:
        """Every WRITEBACK_EVERY bytes, start writing the new window to disk and drop the older one (clean by
        now) from the page cache: the final fsync then has little left to wait for, and output pages do not
        crowd the cache out (the kernel would start on its own only past dirty_background_ratio of RAM)."""
        if not WRITEBACK or self.direct is not None or self.size - self._wb[1] < WRITEBACK_EVERY:
            return
        try:
            os.posix_fadvise(self.f.fileno(), self._wb[0], self.size - self._wb[0], os.POSIX_FADV_DONTNEED)
        except OSError:
            pass  # advice only
        self._wb = [self._wb[1], self.size]

    def __exit__(self, exc_type, exc, tb) -> None:
        try:
            try:
                if exc_type is None:
                    if self.direct is not None:
                        self.direct.finish(self.size)
                    self.f.flush()
                    os.fsync(self.f.fileno())
            finally:
                if self.direct is not None:
                    self.direct.close()  # waits for writes in flight before the descriptor closes
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


def tensor_bytes(t: "torch.Tensor") -> memoryview:
    """The raw little-endian bytes of a tensor, without a copy when it is contiguous."""
    import torch

    t = t.contiguous().reshape(-1)
    if t.numel() == 0:
        return memoryview(b"")
    return memoryview(t.view(torch.uint8).numpy())


class StreamedFile:
    """A safetensors file written in its planned tensor order without holding it: the header first (shapes and
    dtypes come from the plan), then each tensor's bytes appended in pieces (``append``, then ``end_tensor``) or
    whole (``tensor``). Every tensor's byte count is checked against its planned size. Opened on the first
    write; ``close`` commits it (fsync, rename) and returns (size, sha256); ``abort`` removes it."""

    def __init__(self, path: Path, specs: list[tuple[str, str, tuple[int, ...]]], overlap: bool = False,
                 on_bytes: Callable[[int], None] | None = None, stage: int = STAGE, batch: Batch | None = None):
        self.path, self.specs, self.overlap, self.on_bytes = Path(path), specs, overlap, on_bytes
        self.batch = batch
        self.header, offs = encode_header(specs)
        self.sizes = [end - begin for begin, end in offs]
        total = len(self.header) + sum(self.sizes)
        self.stage = stage if total >= DIRECT_MIN else 0  # small files: the page cache
        self.index, self.got = 0, 0
        self.f: AtomicFile | None = None

    @property
    def complete(self) -> bool:
        return self.index == len(self.specs)

    def _open(self) -> AtomicFile:
        if self.f is None:
            self.f = AtomicFile(self.path, self.overlap, self.stage, self.batch).__enter__()
            self.f.write(self.header)
        return self.f

    def append(self, piece) -> None:
        f = self._open()
        n = memoryview(piece).nbytes
        if self.complete or self.got + n > self.sizes[self.index]:
            name = self.specs[min(self.index, len(self.specs) - 1)][0]
            raise ShardError(f"internal: {self.path.name}: {name} got more bytes than planned")
        if n:
            f.write(piece)
            self.got += n
            if self.on_bytes:
                self.on_bytes(n)

    def reserve(self, n: int) -> memoryview | None:
        """See AtomicFile.reserve; ``n`` must fit in the current tensor."""
        if self.complete or self.got + n > self.sizes[self.index]:
            return None
        return self._open().reserve(n)

    def commit(self, view: memoryview) -> None:
        self.f.commit(view)
        self.got += view.nbytes
        if self.on_bytes:
            self.on_bytes(view.nbytes)

    def end_tensor(self) -> None:
        self._open()
        name, _, _ = self.specs[self.index]
        if self.got != self.sizes[self.index]:
            raise ShardError(f"internal: {self.path.name}: {name} produced {self.got} bytes, planned "
                             f"{self.sizes[self.index]}")
        self.index, self.got = self.index + 1, 0

    def tensor(self, t: "torch.Tensor") -> None:
        name, dtype, shape = self.specs[self.index]
        if tuple(t.shape) != tuple(shape) or str(t.dtype).replace("torch.", "") != dtype:
            raise ShardError(f"internal: {name} produced {tuple(t.shape)} {t.dtype}, planned {shape} {dtype}")
        self.append(tensor_bytes(t))
        self.end_tensor()

    def close(self) -> tuple[int, str]:
        f = self._open()
        if not self.complete:
            raise ShardError(f"internal: {self.path.name} closed after {self.index} of {len(self.specs)} tensors")
        self.f = None
        f.__exit__(None, None, None)
        return f.size, f.sha256

    def abort(self) -> None:
        if self.f is not None:
            f, self.f = self.f, None
            f.__exit__(ShardError, ShardError("aborted"), None)


def write_bytes(path: Path, data: bytes) -> tuple[int, str]:
    with AtomicFile(path) as f:
        f.write(data)
    return f.size, f.sha256


def remove_stale_tmp(dirs: Iterable[Path]) -> None:
    """Delete temporary files a killed run left behind."""
    for d in dirs:
        if d.is_dir():
            for p in d.iterdir():
                if TMP_MARK in p.name and p.is_file():
                    p.unlink()
