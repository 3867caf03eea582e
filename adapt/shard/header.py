"""A safetensors header validator that runs before any tensor allocation.

The format: an 8-byte little-endian header length N, N bytes of JSON ``{name: {dtype, shape,
data_offsets: [begin, end]}, "__metadata__": {str: str}}``, then the data buffer. Every check here runs
on the header alone (at most ``max_header_bytes`` read), so a hostile or broken file is refused with one
line before anything the size of a tensor is allocated.
"""

from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path

from adapt.errors import CheckpointError

MAX_HEADER_BYTES = 100 * 1024 * 1024

# safetensors dtype -> (torch dtype name, bytes per element)
DTYPES: dict[str, tuple[str, int]] = {
    "F64": ("float64", 8), "F32": ("float32", 4), "F16": ("float16", 2), "BF16": ("bfloat16", 2),
    "F8_E4M3": ("float8_e4m3fn", 1), "F8_E5M2": ("float8_e5m2", 1),
    "I64": ("int64", 8), "I32": ("int32", 4), "I16": ("int16", 2), "I8": ("int8", 1),
    "U64": ("uint64", 8), "U32": ("uint32", 4), "U16": ("uint16", 2), "U8": ("uint8", 1), "BOOL": ("bool", 1),
}
TORCH_TO_ST = {v[0]: k for k, v in DTYPES.items()}


class HeaderError(CheckpointError):
    """A safetensors file whose header is malformed; subclasses say how."""


class HeaderTooLargeError(HeaderError):
    """The 8-byte header length exceeds the limit or the file."""


class HeaderFormatError(HeaderError):
    """The header is not well-formed JSON of the safetensors schema, or names an unknown dtype."""


class OffsetError(HeaderError):
    """Tensor data offsets overlap, leave gaps, or point outside the file."""


class SizeMismatchError(HeaderError):
    """A tensor's byte range does not equal shape x dtype size."""


class TruncatedFileError(HeaderError):
    """The file is shorter (or longer) than its header says."""


@dataclass(frozen=True)
class TensorEntry:
    """One tensor of a safetensors file; ``begin``/``end`` are absolute file offsets."""

    name: str
    dtype: str  # torch dtype name, e.g. bfloat16
    shape: tuple[int, ...]
    begin: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.begin


@dataclass(frozen=True)
class Header:
    path: Path
    tensors: dict[str, TensorEntry]
    metadata: dict[str, str]
    data_offset: int
    file_size: int


def read_header(path: str | os.PathLike, max_header_bytes: int = MAX_HEADER_BYTES) -> Header:
    """Read and validate the header of a safetensors file. Raises a HeaderError subclass, one line."""
    path = Path(path)
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size < 8:
                raise TruncatedFileError(f"{path}: truncated safetensors file ({size} bytes, no header length)")
            (n,) = struct.unpack("<Q", f.read(8))
            if n > max_header_bytes:
                raise HeaderTooLargeError(f"{path}: safetensors header length {n} exceeds the limit of "
                                          f"{max_header_bytes} bytes")
            if n > size - 8:
                raise TruncatedFileError(f"{path}: truncated safetensors file: header length {n} but only "
                                         f"{size - 8} bytes follow")
            raw = f.read(n)
    except OSError as e:
        raise CheckpointError(f"cannot read {path}: {e.strerror}") from e
    return parse_header(path, raw, size)


def parse_header(path: Path, raw: bytes, file_size: int) -> Header:
    """Validate the JSON header bytes of a file of ``file_size`` bytes."""
    try:
        doc = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise HeaderFormatError(f"{path}: safetensors header is not valid JSON ({e})") from e
    if not isinstance(doc, dict):
        raise HeaderFormatError(f"{path}: safetensors header must be a JSON object")
    meta = doc.pop("__metadata__", None) or {}
    if not isinstance(meta, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in meta.items()):
        raise HeaderFormatError(f"{path}: __metadata__ must map strings to strings")
    data_offset = 8 + len(raw)
    entries = []
    for name, e in doc.items():
        if not isinstance(e, dict) or set(e) - {"dtype", "shape", "data_offsets"} or len(e) != 3:
            raise HeaderFormatError(f"{path}: tensor {name!r} must have exactly dtype, shape, data_offsets")
        dt, shape, offs = e["dtype"], e["shape"], e["data_offsets"]
        if dt not in DTYPES:
            raise HeaderFormatError(f"{path}: tensor {name!r} has unknown dtype {dt!r}")
        if not isinstance(shape, list) or not all(isinstance(s, int) and not isinstance(s, bool) and s >= 0
                                                  for s in shape):
            raise HeaderFormatError(f"{path}: tensor {name!r} shape must be a list of non-negative integers")
        if (not isinstance(offs, list) or len(offs) != 2
                or not all(isinstance(o, int) and not isinstance(o, bool) and o >= 0 for o in offs)):
            raise HeaderFormatError(f"{path}: tensor {name!r} data_offsets must be [begin, end]")
        begin, end = offs
        if end < begin:
            raise OffsetError(f"{path}: tensor {name!r} data_offsets [{begin}, {end}] end before begin")
        numel = 1
        for s in shape:
            numel *= s
        want = numel * DTYPES[dt][1]
        if end - begin != want:
            raise SizeMismatchError(f"{path}: tensor {name!r} holds {end - begin} bytes but shape {shape} x {dt} "
                                    f"needs {want}")
        entries.append(TensorEntry(name, DTYPES[dt][0], tuple(shape), data_offset + begin, data_offset + end))
    pos = data_offset
    for t in sorted(entries, key=lambda t: (t.begin, t.end)):
        if t.begin < pos:
            raise OffsetError(f"{path}: tensor {t.name!r} data [{t.begin - data_offset}, {t.end - data_offset}) "
                              f"overlaps the previous tensor")
        if t.begin > pos:
            raise OffsetError(f"{path}: gap before tensor {t.name!r} (data offsets are not contiguous)")
        pos = t.end
    if pos > file_size:
        raise TruncatedFileError(f"{path}: truncated safetensors file: data needs {pos} bytes, file has {file_size}")
    if pos != file_size:
        raise TruncatedFileError(f"{path}: file is {file_size} bytes but its header accounts for {pos}")
    return Header(path, {t.name: t for t in entries}, dict(meta), data_offset, file_size)


def encode_header(tensors: list[tuple[str, str, tuple[int, ...]]], metadata: dict[str, str] | None = None
                  ) -> tuple[bytes, list[tuple[int, int]]]:
    """Header bytes (length prefix included, padded to 8 bytes) for tensors (name, torch dtype, shape) laid
    out contiguously in order; returns (bytes, [(begin, end) relative to the data buffer])."""
    doc: dict = {"__metadata__": dict(metadata or {"format": "pt"})}
    offs, pos = [], 0
    for name, dtype, shape in tensors:
        numel = 1
        for s in shape:
            numel *= s
        n = numel * DTYPES[TORCH_TO_ST[dtype]][1]
        doc[name] = {"dtype": TORCH_TO_ST[dtype], "shape": list(shape), "data_offsets": [pos, pos + n]}
        offs.append((pos, pos + n))
        pos += n
    raw = json.dumps(doc, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw, offs
