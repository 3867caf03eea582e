"""Moving a tensor slice's bytes out of a safetensors file with ``os.preadv`` into reusable buffers.

No mmap (so no file-backed pages count in the resident set) and no torch for pure slicing. The byte
offsets come from the header :func:`adapt.shard.header.read_header` validated, and the slice from
adapt.plan (``tensor_slice`` / ``rank_tensors`` / ``scale_slice``); this module only turns that slice into
byte ranges. A slice [start, stop) along dim d of a C-contiguous tensor of shape S is ``outer = prod(S[:d])``
runs of ``(stop - start) * inner`` bytes at a stride of ``S[d] * inner`` bytes (``inner = prod(S[d+1:]) *
itemsize``). Whole tensors and dim-0 slices (outer == 1) are one contiguous byte range and are copied chunk
by chunk; other slices read whole rows and gather the runs with numpy (GIL-free), in bounded chunks.
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass
from typing import Iterator

from adapt.errors import CheckpointError

CHUNK = 1 << 20  # bytes per read and write: measured 4-10x faster page-cache writes than 16 MiB pieces here (cache-resident)
_local = threading.local()
# Runs at least this long are written straight from the read buffer; shorter ones are gathered first, by a
# slice copy per run down to GATHER_LOOP bytes, below that with one numpy strided copy.
GATHER_BELOW = 64 << 10
GATHER_LOOP = 2048


@dataclass(frozen=True)
class ByteSlice:
    """``outer`` runs of ``run`` bytes, the first at absolute file ``offset``, ``stride`` bytes apart."""

    offset: int
    outer: int
    run: int
    stride: int

    @property
    def nbytes(self) -> int:
        return self.outer * self.run

    @property
    def contiguous(self) -> bool:
        return self.outer <= 1 or self.run == self.stride


def byte_slice(begin: int, shape: tuple[int, ...], itemsize: int, dim: int | None = None, start: int = 0,
               stop: int = 0) -> ByteSlice:
    """The bytes of ``tensor[start:stop]`` along ``dim`` (the whole tensor when dim is None)."""
    numel = 1
    for s in shape:
        numel *= s
    if dim is None:
        return ByteSlice(begin, 1, numel * itemsize, numel * itemsize)
    assert 0 <= dim < len(shape) and 0 <= start <= stop <= shape[dim], (shape, dim, start, stop)
    outer = 1
    for s in shape[:dim]:
        outer *= s
    inner = itemsize
    for s in shape[dim + 1:]:
        inner *= s
    return ByteSlice(begin + start * inner, outer, (stop - start) * inner, shape[dim] * inner)


def buffers() -> tuple[memoryview, memoryview]:
    """This thread's (read, gather) buffers, allocated once."""
    b = getattr(_local, "bufs", None)
    if b is None:
        b = _local.bufs = (memoryview(bytearray(CHUNK)), memoryview(bytearray(CHUNK)))
    return b


def pread_into(fd: int, dest: memoryview, offset: int) -> None:
    """Fill ``dest`` from ``offset``; a short file (truncated after validation) is a CheckpointError."""
    done, n = 0, dest.nbytes
    while done < n:
        got = os.preadv(fd, [dest[done:]], offset + done)
        if got <= 0:
            raise CheckpointError(f"source file (fd {fd}) ended at byte {offset + done}, inside a tensor; "
                                  "was it truncated while sharding?")
        done += got


def iter_slice(fd: int, bs: ByteSlice, chunk: int = CHUNK) -> Iterator[memoryview]:
    """The slice's bytes in order, as views of this thread's buffers (valid until the next item).

    Every piece is a multiple of the run's element size as long as ``chunk`` is a multiple of 8.
    """
    rbuf, gbuf = buffers()
    chunk = min(chunk, rbuf.nbytes)
    if bs.contiguous:
        pos, end = bs.offset, bs.offset + bs.nbytes
        while pos < end:
            n = min(chunk, end - pos)
            pread_into(fd, rbuf[:n], pos)
            yield rbuf[:n]
            pos += n
        return
    if bs.stride > chunk:  # rows too long to batch: read each row's run directly
        for o in range(bs.outer):
            yield from iter_slice(fd, ByteSlice(bs.offset + o * bs.stride, 1, bs.run, bs.run), chunk)
        return
    import numpy as np  # here: ~45 ms of import that a run without strided slices never pays

    rows_per = chunk // bs.stride
    src = np.frombuffer(rbuf, dtype=np.uint8)
    dst = np.frombuffer(gbuf, dtype=np.uint8)
    for o in range(0, bs.outer, rows_per):
        rows = min(rows_per, bs.outer - o)
        span = (rows - 1) * bs.stride + bs.run
        pread_into(fd, rbuf[:span], bs.offset + o * bs.stride)
        runs = np.lib.stride_tricks.as_strided(src, shape=(rows, bs.run), strides=(bs.stride, 1))
        out = dst[:rows * bs.run].reshape(rows, bs.run)
        np.copyto(out, runs)
        yield gbuf[:rows * bs.run]


def read_into(fd: int, bs: ByteSlice, dest: memoryview) -> None:
    """Copy the slice's bytes into ``dest`` (of exactly ``bs.nbytes``); contiguous slices land directly."""
    assert dest.nbytes == bs.nbytes, (dest.nbytes, bs.nbytes)
    if bs.contiguous:
        pread_into(fd, dest, bs.offset)
        return
    pos = 0
    for piece in iter_slice(fd, bs):
        dest[pos:pos + piece.nbytes] = piece
        pos += piece.nbytes


def chunk_pieces(bs: ByteSlice, a: int, b: int, buf: memoryview, gather: memoryview) -> Iterator[memoryview]:
    """The bytes of slice ``bs`` that lie in [a, b) of the same byte space, in order, taken from ``buf`` (which
    holds bytes a..b). Whole runs shorter than GATHER_BELOW are gathered into ``gather`` (at least b - a bytes),
    valid until the next item."""
    if bs.nbytes == 0 or b <= a:
        return
    if bs.contiguous:
        s, e = max(a, bs.offset), min(b, bs.offset + bs.nbytes)
        if s < e:
            yield buf[s - a:e - a]
        return
    off, run, stride = bs.offset, bs.run, bs.stride
    k0 = max(0, (a - off - run) // stride + 1)  # the first run ending after a
    k1 = min(bs.outer, max(0, -(-(b - off) // stride)))  # one past the last run starting before b
    if k0 >= k1:
        return
    full0, full1 = k0, k1  # the runs wholly inside [a, b)
    head = off + k0 * stride < a
    if head:  # the end of a run that began before a (all of the overlap when it also ends after b)
        r = off + k0 * stride
        yield buf[:min(b, r + run) - a]
        full0 = k0 + 1
    tail = k1 - 1 >= full0 and off + (k1 - 1) * stride + run > b  # the start of a run ending after b
    if tail:
        full1 = k1 - 1
    if full1 > full0:
        if run >= GATHER_BELOW:
            for k in range(full0, full1):
                r = off + k * stride - a
                yield buf[r:r + run]
        elif run >= GATHER_LOOP:
            pos = 0
            for k in range(full0, full1):
                r = off + k * stride - a
                gather[pos:pos + run] = buf[r:r + run]
                pos += run
            yield gather[:pos]
        else:
            import numpy as np

            rows = full1 - full0
            src = np.frombuffer(buf, dtype=np.uint8)[off + full0 * stride - a:]
            runs = np.lib.stride_tricks.as_strided(src, shape=(rows, run), strides=(stride, 1))
            out = np.frombuffer(gather, dtype=np.uint8)[:rows * run].reshape(rows, run)
            np.copyto(out, runs)
            yield gather[:rows * run]
    if tail:
        yield buf[off + (k1 - 1) * stride - a:b - a]
