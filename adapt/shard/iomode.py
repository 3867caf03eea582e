"""How a shard run's large output files reach the device: O_DIRECT, or the page cache.

O_DIRECT saves CPU: on a 2-core Xeon VM whose disk took 2 GB/s, writing 2 GB through the page cache cost
1.1-2.2 CPU-seconds (page allocation, dirty accounting, writeback) against 0.05, and such a run is bound by
its CPU (it sha256s every byte it reads and writes). On a slow device the device bounds the run, and there
the kernel's writeback got more out of it than O_DIRECT's one write in flight per file: a 2-core AMD EPYC VM
whose virtual disk took 0.2-0.55 GB/s of 4 MB O_DIRECT writes, whatever their concurrency (1-16 threads), wrote
the bench's 2.14 GB (tp=2, re-hashed) in 4.3-5.1 s through the page cache against 5.2-6.9 s with O_DIRECT,
alternated run by run. So a run that has files for O_DIRECT first times a short O_DIRECT write into OUT
(``PROBE`` bytes, in the writer's own 4 MB pieces, then fsync), and takes O_DIRECT only where the device takes
it at ``FAST`` or more. ``ADAPT_SHARD_DIRECT=1`` / ``0`` skips the probe and forces either.
"""

from __future__ import annotations

import errno
import mmap
import os
import time
from pathlib import Path

from adapt.errors import ShardError
from adapt.shard import writer

ENV = "ADAPT_SHARD_DIRECT"
PROBE = 32 << 20  # bytes the probe writes: 16 ms at 2 GB/s, 60-160 ms on the slow disk above
FAST = 1e9  # bytes/s of O_DIRECT writes from which the run is CPU-bound on few cores (hashing ~1.6 GB/s a core)


def env_mode() -> str:
    """``ADAPT_SHARD_DIRECT``: "auto" (unset), "0" or "1"; anything else is an error."""
    mode = os.environ.get(ENV, "auto").strip().lower() or "auto"
    if mode not in ("auto", "0", "1"):
        raise ShardError(f"{ENV} must be 0, 1 or auto; got {os.environ[ENV]!r}")
    return mode


def direct_io(out: Path, largest: int) -> tuple[bool, str]:
    """Whether this run writes its files of ``writer.DIRECT_MIN`` bytes and more with O_DIRECT, and why (the
    run's summary says it). ``largest``: the size of the largest file the run writes."""
    mode = env_mode()
    if not writer.DIRECT:
        return False, "page cache (O_DIRECT not available here)"
    if mode != "auto":
        return mode == "1", f"{'O_DIRECT' if mode == '1' else 'page cache'} ({ENV}={mode})"
    if largest < writer.DIRECT_MIN:
        return False, "page cache (small files)"
    rate = probe(out)
    if rate is None:
        return False, "page cache (the filesystem refuses O_DIRECT)"
    fast = rate >= FAST
    return fast, f"{'O_DIRECT' if fast else 'page cache'} (O_DIRECT probe {rate / 1e9:.2f} GB/s)"


def probe(out: Path, nbytes: int = PROBE, piece: int = writer.STAGE) -> float | None:
    """Bytes/s of O_DIRECT writes of ``piece`` bytes, one after another, into a temporary file in ``out``,
    fsynced and removed (its name is a writer temporary's, so a killed probe is swept like one); None where the
    filesystem refuses O_DIRECT. The bytes are random: a device that compresses or skips zeros sees real data."""
    path = writer.tmp_name(out / "io-probe")
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT | getattr(os, "O_CLOEXEC", 0)
    buf = mmap.mmap(-1, piece)  # page aligned, as O_DIRECT needs
    buf.write(os.urandom(piece))
    try:
        try:
            fd = os.open(path, flags, 0o600)
        except OSError as e:
            if e.errno == errno.EINVAL:
                return None
            raise ShardError(f"cannot write {path}: {e.strerror}") from e
        try:
            t0 = time.perf_counter()
            for off in range(0, nbytes, piece):
                writer.pwrite_all(fd, memoryview(buf), off)
            os.fsync(fd)
            return nbytes / max(time.perf_counter() - t0, 1e-9)
        except OSError as e:
            if e.errno == errno.EINVAL:  # took the flag, not the I/O (some FUSE filesystems)
                return None
            raise ShardError(f"cannot write {path}: {e.strerror}") from e
        finally:
            os.close(fd)
            path.unlink(missing_ok=True)
    finally:
        buf.close()
