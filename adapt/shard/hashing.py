"""sha256 for shard and verify: hashlib, or two streams at a time with the x86 SHA extensions.

A shard run's manifest needs the sha256 of every source byte and of every output byte, so on a fast disk the
run is bound by hashing (a 2-core Zen 4 VM: 4.3 GB of sha256 for a 2.1 GB checkpoint at 1.8 GB/s a core,
against a disk that took 2.4 GB/s). One SHA-256 stream is bound by the latency of its rounds; two streams
interleaved by one core ran at 3.4 GB/s there (csrc/sha256.c). The two are already at hand: each chunk read
from a source file goes to the source's hash and, sliced, to the hashes of the output files it lands in. So
a unit of work collects its updates in a :class:`Batch` while it copies a chunk and hashes them at the
chunk's end, in pairs of streams, before its buffers are reused.

The library is compiled once per host and source with the system C compiler (``$CC``, else ``cc``; about
0.2 s) into ``$ADAPT_CACHE/native/<key>/`` and loaded with ctypes, which releases the GIL during each call.
It is checked against hashlib on load. Where there is no compiler, no x86-64 or no SHA extensions, or with
``ADAPT_SHARD_SHA=hashlib``, every stream is a hashlib object and a batch hashes as it is given: the same
digests, at hashlib's rate. ``status()`` says which is in use; the shard summary reports it.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from adapt.errors import ShardError
from adapt.fileio import cache_root

ENV = "ADAPT_SHARD_SHA"  # "auto" (unset) or "hashlib"
SOURCE = Path(__file__).with_name("csrc") / "sha256.c"
LIB = "libadapt_sha256.so"
FAILED = "failed.txt"  # beside where the library would be: why it could not be built (not retried)

_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_size = 0
_status = "not loaded"
_tried = False


def env_mode() -> str:
    mode = os.environ.get(ENV, "auto").strip().lower() or "auto"
    if mode not in ("auto", "hashlib"):
        raise ShardError(f"{ENV} must be auto or hashlib; got {os.environ[ENV]!r}")
    return mode


def status() -> str:
    """One line: which sha256 this process uses, and why not the native one."""
    native()
    return _status


def native() -> ctypes.CDLL | None:
    """The loaded library, or None (hashlib), built on first use."""
    global _tried
    if _tried:
        return _lib
    with _lock:
        if not _tried:
            _load()
            _tried = True
    return _lib


def _key() -> str:
    cc = os.environ.get("CC", "cc")
    h = hashlib.sha256(SOURCE.read_bytes())
    h.update(f"{cc}|{platform.machine()}|{platform.system()}".encode())
    return h.hexdigest()[:16]


def _build(cc: str, out: Path) -> str | None:
    """Compile to a temporary name, then rename: the library's name only ever holds a whole library. Returns
    why it failed, or None."""
    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    cmd = [cc, "-O2", "-shared", "-fPIC", "-o", str(tmp), str(SOURCE)]
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"{cc}: {e}"
    try:
        if p.returncode != 0:
            lines = (p.stderr or p.stdout).strip().splitlines()
            return f"{cc} exit {p.returncode}: {lines[0] if lines else ''}"
        os.replace(tmp, out)
        return None
    finally:
        tmp.unlink(missing_ok=True)


def _load() -> None:
    global _lib, _size, _status
    if env_mode() == "hashlib":
        _status = f"hashlib ({ENV}=hashlib)"
        return
    if platform.machine().lower() not in ("x86_64", "amd64") or platform.system() != "Linux":
        _status = f"hashlib (the native form is for x86-64 Linux; this is {platform.system()} {platform.machine()})"
        return
    d = cache_root() / "native" / f"sha256-{_key()}"
    lib, failed = d / LIB, d / FAILED
    if failed.exists():
        _status = f"hashlib (the native build failed before: {failed.read_text().strip()}; delete {d} to retry)"
        return
    if not lib.exists():
        cc = os.environ.get("CC", "cc")
        if shutil.which(cc) is None:
            _status = f"hashlib (no C compiler: {cc} not found)"
            return
        try:
            d.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            _status = f"hashlib (cannot write {d}: {e.strerror})"
            return
        why = _build(cc, lib)
        if why is not None:
            try:
                failed.write_text(why + "\n")
            except OSError:
                pass
            _status = f"hashlib (native build failed: {why})"
            return
    try:
        so = ctypes.CDLL(str(lib))
    except OSError as e:  # e.g. cut short by a crash before it reached the disk
        lib.unlink(missing_ok=True)
        _status = f"hashlib (cannot load {lib}: {e}; removed, built again next time)"
        return
    so.adapt_sha256_size.restype = ctypes.c_size_t
    so.adapt_sha256_native.restype = ctypes.c_int
    so.adapt_sha256_init.argtypes = [ctypes.c_void_p]
    so.adapt_sha256_update.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t]
    so.adapt_sha256_many.argtypes = [ctypes.c_size_t, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
                                     ctypes.c_void_p]
    so.adapt_sha256_digest.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
    for f in ("init", "update", "many", "digest"):
        getattr(so, f"adapt_sha256_{f}").restype = None
    if not so.adapt_sha256_native():
        _status = "hashlib (this CPU has no SHA extensions)"
        return
    _lib, _size = so, so.adapt_sha256_size()
    why = _self_test()
    if why is not None:
        _lib = None
        _status = f"hashlib (the native sha256 disagreed with hashlib on {why}; not used)"
        return
    _status = "native (SHA extensions, two streams at a time)"


def _self_test() -> str | None:
    data = bytes(range(256)) * 9 + b"adapt"  # 2309 bytes: whole blocks, a partial one, two lanes
    want = hashlib.sha256(data).hexdigest()
    a, b, c = Sha256(_lib), Sha256(_lib), Sha256(_lib)
    a.update(data)
    batch = Batch()
    for h, v in ((b, data[:100]), (c, data), (b, data[100:])):
        batch.add(h, memoryview(bytearray(v)))
    batch.flush()
    for name, h in (("one stream", a), ("two streams", b), ("two streams", c)):
        if h.hexdigest() != want:
            return name
    return None


def buffer_address(view: memoryview) -> tuple[int, object]:
    """The address of a contiguous buffer's first byte, and what keeps it valid while it is used."""
    if view.readonly:  # headers and other small byte strings: copied
        keep = ctypes.create_string_buffer(view.tobytes(), view.nbytes)
        return ctypes.addressof(keep), keep
    keep = (ctypes.c_char * view.nbytes).from_buffer(view)
    return ctypes.addressof(keep), keep


class Sha256:
    """One stream's sha256: ``update`` now, or through a :class:`Batch`; ``hexdigest`` any time."""

    __slots__ = ("ctx", "h")

    def __init__(self, _native: ctypes.CDLL | None = None) -> None:
        lib = _native or native()  # _native: the library being checked on load
        if lib is None:
            self.ctx, self.h = None, hashlib.sha256()
        else:
            self.ctx, self.h = ctypes.create_string_buffer(_size), None
            lib.adapt_sha256_init(self.ctx)

    def update(self, data) -> None:
        if self.h is not None:
            self.h.update(data)
            return
        mv = memoryview(data).cast("B")
        if mv.nbytes:
            addr, keep = buffer_address(mv)
            _lib.adapt_sha256_update(self.ctx, addr, mv.nbytes)
            del keep

    def hexdigest(self) -> str:
        if self.h is not None:
            return self.h.hexdigest()
        out = ctypes.create_string_buffer(32)
        _lib.adapt_sha256_digest(self.ctx, out)
        return out.raw.hex()


class Batch:
    """Updates of several streams, hashed at ``flush`` two streams at a time, each stream's in the order given.

    Every buffer given to ``add`` must keep its bytes until the next ``flush``; the batch holds a reference, not
    a copy. With hashlib streams ``add`` hashes at once."""

    __slots__ = ("jobs",)

    def __init__(self) -> None:
        self.jobs: list[tuple[Sha256, memoryview]] = []

    def add(self, h: Sha256, data) -> None:
        if h.h is not None:
            h.h.update(data)
            return
        mv = memoryview(data).cast("B")
        if mv.nbytes:
            self.jobs.append((h, mv))

    def flush(self) -> None:
        jobs, self.jobs = self.jobs, []
        if not jobs:
            return
        if len(jobs) == 1:
            jobs[0][0].update(jobs[0][1])
            return
        n = len(jobs)
        ctxs, ptrs, lens = (ctypes.c_void_p * n)(), (ctypes.c_void_p * n)(), (ctypes.c_size_t * n)()
        keep = []
        for i, (h, mv) in enumerate(jobs):
            addr, k = buffer_address(mv)
            keep.append(k)
            ctxs[i], ptrs[i], lens[i] = ctypes.addressof(h.ctx), addr, mv.nbytes
        done = (ctypes.c_ubyte * n)()
        _lib.adapt_sha256_many(n, ctxs, ptrs, lens, done)
        del keep


class SourceHash:
    """A source file's sha256, fed in file order. With ``lane`` (a core to spare: fewer units running than
    cores), every update runs on a helper thread while the unit goes on with the writes; the unit then reads
    into a ring of buffers (``buffer``), each reused only once its update is done. One unit alone, tp=1, hashed
    the source and its output one after the other on one core without it. Without a lane, updates go through
    the unit's ``batch``, hashed beside its output files' (two streams at a time: Batch)."""

    RING = 4

    def __init__(self, lane: bool, batch: Batch | None):
        self.h = Sha256()
        self.batch = batch
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="adapt-src-sha") if lane else None
        self.ring: list[memoryview] = []  # allocated on first use, of the unit's read-buffer size
        self.futs: list = [None] * self.RING
        self.i = 0

    @property
    def lane(self) -> bool:
        return self.pool is not None

    def buffer(self, default: memoryview) -> memoryview:
        """The buffer to read the next chunk into (at least as large as ``default``)."""
        if self.pool is None:
            return default
        if not self.ring:
            self.ring = [memoryview(bytearray(default.nbytes)) for _ in range(self.RING)]
        j = self.i % self.RING
        if self.futs[j] is not None:
            self.futs[j].result()
            self.futs[j] = None
        return self.ring[j]

    def update(self, view: memoryview) -> None:
        if self.pool is None:
            if self.batch is not None:
                self.batch.add(self.h, view)
            else:
                self.h.update(view)
            return
        j = self.i % self.RING
        if not self.ring or view.obj is not self.ring[j].obj:  # not a ring buffer: hash it now
            self._drain()
            self.h.update(view)
            return
        self.futs[j] = self.pool.submit(self.h.update, view)
        self.i += 1

    def _drain(self) -> None:
        for j, f in enumerate(self.futs):
            if f is not None:
                f.result()
                self.futs[j] = None

    def hexdigest(self) -> str:
        self._drain()
        if self.batch is not None:
            self.batch.flush()
        return self.h.hexdigest()

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown(wait=True)


def sha256_file(path: Path) -> str:
    """A file's sha256; an OSError reading it is raised."""
    got = sha256_files([path], threads=1)[0]
    if isinstance(got, OSError):
        raise got
    return got


def sha256_files(paths: list[Path], threads: int = 0, chunk: int = 1 << 20) -> list[str | OSError]:
    """The sha256 of each file (or the OSError reading it raised), in order. ``threads`` threads (default: one
    per core, at most 8) each hash two files at a time (``Batch``), reading both a chunk at a time."""
    paths = list(paths)
    out: list[str | OSError] = [""] * len(paths)
    todo = iter(range(len(paths)))
    lock = threading.Lock()

    def nxt() -> int | None:
        with lock:
            return next(todo, None)

    def worker() -> None:
        slots: list[list] = []  # [index, file, Sha256, buffer]
        batch = Batch()
        while True:
            while len(slots) < 2 and (i := nxt()) is not None:
                try:
                    f = open(paths[i], "rb", buffering=0)
                except OSError as e:
                    out[i] = e
                    continue
                slots.append([i, f, Sha256(), memoryview(bytearray(chunk))])
            if not slots:
                return
            for s in list(slots):
                try:
                    n = s[1].readinto(s[3])
                except OSError as e:
                    out[s[0]] = e
                    n = -1
                if n > 0:
                    batch.add(s[2], s[3][:n])
                    continue
                batch.flush()  # this slot's earlier chunks, before its digest
                if n == 0:
                    out[s[0]] = s[2].hexdigest()
                s[1].close()
                slots.remove(s)
            batch.flush()

    n = max(1, min(threads or min(8, os.cpu_count() or 1), -(-len(paths) // 2)))
    if n == 1:
        worker()
    else:
        pool = [threading.Thread(target=worker, name=f"adapt-sha-{k}") for k in range(n)]
        for t in pool:
            t.start()
        for t in pool:
            t.join()
    return out
