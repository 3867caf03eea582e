"""One pass over a source file feeds every output file that draws from it, and hashes the source on the way.

The planner gives every output file tensors of one source file only, in source-offset order, so a unit of
work is (source file, a group of ranks): its tensors are read front to back in bounded chunks (1 MiB, a
multiple of a strided slice's row stride), each chunk is hashed for the source's sha256 while it is in this
core's cache (when the source's sha256 is not on record), and every rank's slice of that chunk is appended to
that rank's output file, hashed from the same buffer it is written from. Each source byte is read once for all
ranks: a row-parallel (dim >= 1) slice does not make every rank read whole rows of its own.

Slices are the plan's (``OutputTensor.slice``) turned into byte ranges by :func:`adapt.shard.stream.byte_slice`;
a chunk's share of a slice is the part of its runs that falls inside the chunk (:func:`chunk_pieces`). Tensors
that cannot stream as raw bytes (FP8 block dequantization, pickle checkpoints) are produced whole, within the
memory budget, when the scan reaches them.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

from adapt.errors import ShardError
from adapt.shard.checkpoint import Checkpoint, SourceTensor
from adapt.shard.manifest import OutputFile, OutputTensor
from adapt.shard.planner import scale_blocks
from adapt.shard.stream import ByteSlice, buffers, chunk_pieces, pread_into
from adapt.shard.transform import cast, dequant_slice, quantize_part, shape_value
from adapt.shard.hashing import Batch, SourceHash, sha256_file
from adapt.shard.writer import ALIGN, STAGE, StreamedFile, io_pool, tensor_bytes

# O_DIRECT staging per unit: its ranks' files are open at once, each with two buffers of STAGING / ranks.
STAGING, STAGE_MIN = 8 << 20, 256 << 10
# threads that commit finished files (their last bytes, fsync, rename) while the units read on: waiting on the
# device, not the CPU
COMMITTERS = 8


@dataclass
class _Out:
    """An output file being written by a unit."""

    file: OutputFile
    writer: StreamedFile
    kept: bool = False
    committed: bool = False


@dataclass
class _Use:
    """Output tensor ``t`` of ``out`` takes a slice of one source tensor."""

    out: _Out
    t: OutputTensor
    bs: ByteSlice | None = None  # relative to the source tensor's first byte; None: produced whole


@dataclass
class Unit:
    """A source file, the output files of some ranks that draw from it, and whether to hash it."""

    source_file: str
    files: list[OutputFile]
    hash_source: bool
    cost: int = 0
    kept: set[str] = field(default_factory=set)  # output paths already valid on disk (resume)


def streams(t: OutputTensor, ckpt: Checkpoint) -> bool:
    """Whether the tensor moves as raw bytes (or cast chunk by chunk) without materialising the slice."""
    return not ckpt.pickle and t.transform in ("none", "cast")


def slice_cost(t: OutputTensor, ckpt: Checkpoint) -> int:
    """Bytes a materialised tensor holds while it is produced: the output slice, plus the FP8 or cast input."""
    out = OutputFile("", 0, (t,)).nbytes
    if t.transform == "none":
        return out
    if t.transform.startswith("quantize:"):  # the slice read, widened to float32, and its quantized parts
        n = 1
        for d in t.slice.shape(t.full_shape):
            n *= d
        return out + 6 * n
    n = out // max(1, {"float32": 4}.get(t.dtype, 2))
    return out + n * (1 if t.transform == "fp8_block_dequant" else {"float32": 4}.get(t.source_dtype, 2))


def produce(ckpt: Checkpoint, t: OutputTensor, block):
    """A materialised output tensor: read its slice (only that part), then transform it."""
    s = t.slice
    w = ckpt.read(t.source, s.dim, s.start, s.stop)
    if t.transform == "none":
        return w
    if t.transform == "cast":
        return cast(w, t.dtype)
    if t.transform == "fp8_block_dequant":
        return _dequant(ckpt, t, w, block, t.dtype)
    if t.transform.startswith("shape:"):  # a sliced int4 weight's weight_shape: the rank's [n, k]
        return shape_value(t)
    if t.transform.startswith("quantize:"):  # an FP8 source is dequantized (float32) first
        src = _dequant(ckpt, t, w, block, "float32") if t.scale is not None else w.float()
        return quantize_part(src, t.transform, t.source, t.name, t.dtype)
    raise ShardError(f"unknown transform {t.transform!r}")


def _dequant(ckpt: Checkpoint, t: OutputTensor, w, block, dtype: str):
    s = t.slice
    if block is None or t.scale is None:
        raise ShardError(f"{t.source}: FP8 weight without block scales")
    sc = scale_blocks(s, block, ckpt.tensors[t.scale].shape)
    scale = ckpt.read(t.scale, sc.dim, sc.start, sc.stop)
    return dequant_slice(w, scale, block, s.dim, s.start, dtype)


class _Caster:
    """Casts raw chunks (whole elements) from one dtype to another with torch."""

    def __init__(self, src: str, dst: str):
        import torch

        self.torch, self.src, self.dst = torch, getattr(torch, src), getattr(torch, dst)

    def __call__(self, piece: memoryview) -> memoryview:
        return tensor_bytes(self.torch.frombuffer(piece, dtype=self.src).to(self.dst))


def run_unit(ckpt: Checkpoint, unit: Unit, out_dir, *, block, overlap: bool, acquire: Callable[[int], int],
             release: Callable[[int], None], on_bytes: Callable[[int], None],
             on_file: Callable[[OutputFile, int, str], None], direct: bool, commits: list,
             sleep: float = 0.0) -> str | None:
    """Write the unit's output files (except the kept ones); returns the source's sha256 when asked to hash it.

    Each file is committed (its last bytes to the device, fsync, rename) on a committer thread once its last
    tensor is written, and ``on_file(file, size, sha256)`` is called then. ``commits``: the list the commits'
    futures go to, for the caller to wait on, so that this worker goes on to its next unit while the device
    takes the last ones (a unit that waited for its own commits idled 1.1 s of a 4.5 s run on a 0.4 GB/s
    disk). ``acquire``/``release`` bound the bytes of materialised tensors; ``sleep`` (a test hook) pauses after
    every source tensor; ``direct``: large files through O_DIRECT staging (iomode.direct_io), else the page
    cache."""
    run = _UnitRun(ckpt, unit, out_dir, block, overlap, acquire, release, on_bytes, on_file, sleep, direct)
    digest = run.run()
    commits.extend(run.commits)
    return digest


class _UnitRun:
    def __init__(self, ckpt, unit, out_dir, block, overlap, acquire, release, on_bytes, on_file, sleep, direct):
        self.ckpt, self.unit, self.block, self.sleep, self.overlap = ckpt, unit, block, sleep, overlap
        self.acquire, self.release, self.on_file = acquire, release, on_file
        ranks = len({f.rank for f in unit.files if f.path not in unit.kept})
        stage = max(STAGE_MIN, min(STAGE, STAGING // max(1, ranks) // ALIGN * ALIGN)) if direct else 0
        # Without lanes, every hash update of this unit (source and outputs) is batched and hashed at the end of
        # each chunk, two streams at a time: the buffers it names (the read buffer, each use's gather buffer,
        # cast results, staging) keep their bytes until then.
        self.batch = None if overlap else Batch()
        self.outs = [_Out(f, StreamedFile(out_dir / f.path, [(t.name, t.dtype, t.shape) for t in f.tensors],
                                          overlap, on_bytes, stage, self.batch), f.path in unit.kept)
                     for f in unit.files]
        self.uses: dict[str, list[_Use]] = {}
        self.commits: list = []  # futures of the files handed to the committer threads
        for o in self.outs:
            if o.kept:
                continue
            for t in o.file.tensors:
                if t.source_file != unit.source_file:
                    raise ShardError(f"internal: {o.file.path} mixes source files")
                bs = None
                if streams(t, ckpt):
                    s = t.slice
                    full = ckpt.byte_slice(t.source, s.dim, s.start, s.stop)
                    bs = ByteSlice(full.offset - ckpt.tensors[t.source].offset, full.outer, full.run, full.stride)
                self.uses.setdefault(t.source, []).append(_Use(o, t, bs))

    def run(self) -> str | None:
        if not self.uses and not self.unit.hash_source:
            return None
        try:
            digest = self._scan()
        except BaseException:
            for fut in self.commits:  # no commit is left running on a file about to be removed
                try:
                    fut.result()
                except BaseException:
                    pass
            for o in self.outs:
                if not o.committed:
                    o.writer.abort()
            raise
        for o in self.outs:
            if not o.kept and not o.writer.complete:
                raise ShardError(f"internal: {o.file.path} was not completed")
        return digest

    def _flush(self) -> None:
        if self.batch is not None:
            self.batch.flush()

    def _ended(self, u: _Use) -> None:
        """After one output tensor: when that was its file's last, commit the file on a committer thread (see
        run_unit), while this unit reads on: the fsync waits for the device, and on a slow one (a 0.4 GB/s virtual
        disk) a unit that waited for it left the device idle between its files while it read and hashed the next
        one's bytes."""
        if u.out.writer.complete:
            self._flush()  # its last bytes hashed before the committer reads its digest
            self.commits.append(io_pool("adapt-commit", COMMITTERS).submit(self._commit, u.out))

    def _commit(self, o: _Out) -> None:
        size, sha = o.writer.close()
        o.committed = True
        self.on_file(o.file, size, sha)

    def _whole(self, u: _Use) -> None:
        held = self.acquire(slice_cost(u.t, self.ckpt))
        try:
            u.out.writer.tensor(produce(self.ckpt, u.t, self.block))
            self._flush()
        finally:
            self.release(held)
        self._ended(u)

    def _scan(self) -> str | None:
        ckpt, unit = self.ckpt, self.unit
        if ckpt.pickle:
            digest = sha256_file(ckpt.directory / unit.source_file) if unit.hash_source else None
            for name in sorted(n for n, t in ckpt.tensors.items() if t.file == unit.source_file):
                for u in self.uses.get(name, []):
                    self._whole(u)
            return digest
        h = SourceHash(self.overlap, self.batch) if unit.hash_source else None
        try:
            return self._scan_file(h)
        finally:
            if h is not None:
                h.close()

    def _scan_file(self, h: SourceHash | None) -> str | None:
        ckpt, unit = self.ckpt, self.unit
        fd = ckpt.fd(unit.source_file)
        rbuf, gbuf = buffers()
        self.gbufs = [gbuf]  # a gather buffer per use of a chunk: all of them are hashed at the chunk's end
        pos = 0
        order = sorted((t for t in ckpt.tensors.values() if t.file == unit.source_file),
                       key=lambda t: (t.offset, t.name))
        for src in order:
            if h is not None:
                pos = _hash_gap(fd, h, pos, src.offset, rbuf)
            todo = self.uses.get(src.name, [])
            if not todo and h is None:
                continue
            stream, later, seen = [], [], set()
            for u in todo:
                if id(u.out) in seen:  # a second slice of this tensor for the same file: after the first one
                    later.append(u)
                elif u.bs is None:
                    self._whole(u)
                else:
                    stream.append(u)
                seen.add(id(u.out))
            if stream or h is not None:
                self._stream(fd, src, stream, h, rbuf, gbuf)
            for u in later:
                if u.bs is None:
                    self._whole(u)
                else:
                    self._stream(fd, src, [u], None, rbuf, gbuf)
            pos = max(pos, src.offset + src.nbytes)
            if self.sleep:
                time.sleep(self.sleep)
        if h is None:
            return None
        _hash_gap(fd, h, pos, ckpt.sizes[unit.source_file], rbuf)
        return h.hexdigest()

    def _interleave(self, fd: int, src: SourceTensor, uses: list[_Use], rbuf: memoryview) -> None:
        """Disjoint contiguous slices, the source not hashed (its sha256 on record, or another unit's job): two
        slices at a time, a chunk of each per step, so that their files' hashes go two streams at a time (read in
        order, a column-parallel tensor feeds one rank at a time and every hash would go alone). Each slice is
        still read once, in order; a chunk lands in its file's staging where it can, else in a read buffer of its
        own."""
        size = rbuf.nbytes
        while len(self.gbufs) < 2:
            self.gbufs.append(memoryview(bytearray(rbuf.nbytes)))
        bufs = (rbuf, self.gbufs[1])
        todo = [[u, u.bs.offset, u.bs.offset + u.bs.nbytes] for u in uses]
        lanes: list[list] = []
        while todo or lanes:
            while len(lanes) < 2 and todo:
                lanes.append(todo.pop(0))
            for k, lane in enumerate(lanes):
                u, pos, end = lane
                n = min(size, end - pos)
                w = u.out.writer
                view = w.reserve(n)
                if view is not None:
                    pread_into(fd, view, src.offset + pos)
                    w.commit(view)
                else:
                    view = bufs[k][:n]
                    pread_into(fd, view, src.offset + pos)
                    w.append(view)
                lane[1] = pos + view.nbytes
            self._flush()  # before the read buffers, or a staging buffer handed out again, are reused
            view = None
            lanes = [lane for lane in lanes if lane[1] < lane[2]]

    def _stream(self, fd: int, src: SourceTensor, stream: list[_Use], h, rbuf: memoryview, gbuf: memoryview
                ) -> None:
        """Read ``src`` in chunks (all of it when hashing, else the span its slices cover) and append each use's
        share of every chunk to its file."""
        casts = [_Caster(u.t.source_dtype, u.t.dtype) if u.t.transform == "cast" else None for u in stream]
        live = [u.bs for u in stream if u.bs.nbytes]
        if h is None and self.batch is not None and _disjoint_runs(stream, casts):
            self._interleave(fd, src, [u for u in stream if u.bs.nbytes], rbuf)
            for u in stream:
                u.out.writer.end_tensor()
                self._ended(u)
            return
        if h is not None:
            lo, hi = 0, src.nbytes
        else:
            lo = min((bs.offset for bs in live), default=0)
            hi = max((bs.offset + (bs.outer - 1) * bs.stride + bs.run for bs in live), default=0)
        size = rbuf.nbytes
        strided = [bs.stride for bs in live if not bs.contiguous and bs.stride <= size]
        if strided:  # chunks of whole rows: each holds whole runs of the slice, gathered in one copy
            size = size // strided[0] * strided[0]
            lo -= lo % strided[0]
        while len(self.gbufs) < len(stream):
            self.gbufs.append(memoryview(bytearray(gbuf.nbytes)))
        for a in range(lo, hi, size):
            b = min(a + size, hi)
            sole = None if h is not None and h.lane else _sole_reader(stream, casts, a, b)
            if sole is not None:  # read straight into that file's staging: no copy through rbuf
                w, pos = sole.out.writer, a
                while pos < b and (view := w.reserve(b - pos)) is not None:
                    pread_into(fd, view, src.offset + pos)
                    if h is not None:
                        h.update(view)
                    w.commit(view)
                    self._flush()  # the next reserve may hand out this staging buffer's twin, and then it again
                    pos += view.nbytes
                view = None
                if pos == b:
                    continue
                a = pos  # a page-cache file: the rest through rbuf
            view = (h.buffer(rbuf) if h is not None else rbuf)[:b - a]
            pread_into(fd, view, src.offset + a)
            if h is not None:
                h.update(view)
            for u, c, g in zip(stream, casts, self.gbufs):
                for piece in chunk_pieces(u.bs, a, b, view, g):
                    u.out.writer.append(c(piece) if c else piece)
            self._flush()  # before rbuf and the gather buffers are filled again
        for u in stream:
            u.out.writer.end_tensor()
            self._ended(u)


def _disjoint_runs(stream: list[_Use], casts: list) -> bool:
    """Whether two or more uses take contiguous, raw, pairwise disjoint byte ranges (a column-parallel split)."""
    spans = sorted((u.bs.offset, u.bs.offset + u.bs.nbytes) for u, c in zip(stream, casts)
                   if u.bs.nbytes and u.bs.contiguous and c is None)
    if len(spans) < 2 or len(spans) != sum(1 for u in stream if u.bs.nbytes):
        return False
    return all(e <= s for (_, e), (s, _) in zip(spans, spans[1:]))


def _sole_reader(stream: list[_Use], casts: list, a: int, b: int) -> _Use | None:
    """The one use that takes all of [a, b) as raw bytes while no other use takes any of it, or None."""
    sole = None
    for u, c in zip(stream, casts):
        bs = u.bs
        if bs.nbytes == 0:
            continue
        if bs.contiguous:
            if bs.offset >= b or bs.offset + bs.nbytes <= a:
                continue  # none of it here
            if c is not None or sole is not None or bs.offset > a or bs.offset + bs.nbytes < b:
                return None
            sole = u
        elif a < bs.offset + (bs.outer - 1) * bs.stride + bs.run and bs.offset < b:
            return None  # a strided slice with (possibly) bytes here: the gather path
    return sole


def _hash_gap(fd: int, h: SourceHash, pos: int, end: int, rbuf: memoryview) -> int:
    """Hash the file's bytes [pos, end) (the header before the first tensor; nothing between tensors in a
    validated file)."""
    while pos < end:
        n = min(rbuf.nbytes, end - pos)
        view = h.buffer(rbuf)[:n]
        pread_into(fd, view, pos)
        h.update(view)
        if h.batch is not None:
            h.batch.flush()
        pos += n
    return pos
