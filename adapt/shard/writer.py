"""Atomic file writing: temporary name, fsync, rename, directory fsync; sha256 computed while writing.

A final file name therefore only ever holds a complete file. Safetensors files are streamed: the header
is known up front (shapes and dtypes come from the plan), then each tensor's bytes are appended, so only
one tensor slice is in memory at a time.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Callable, Iterable

import torch

from adapt.errors import ShardError
from adapt.shard.header import encode_header

TMP_MARK = ".adapt-tmp-"
HASH_CHUNK = 8 << 20


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

    def __enter__(self) -> "AtomicFile":
        self.path.parent.mkdir(parents=True, exist_ok=True)
        try:
            self.f = open(self.tmp, "wb")
        except OSError as e:
            raise ShardError(f"cannot write {self.tmp}: {e.strerror}") from e
        return self

    def write(self, data) -> None:
        mv = memoryview(data)
        self.f.write(mv)
        self.sha.update(mv)
        self.size += mv.nbytes

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


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """The raw little-endian bytes of a tensor, without a copy when it is contiguous."""
    t = t.contiguous().reshape(-1)
    if t.numel() == 0:
        return memoryview(b"")
    return memoryview(t.view(torch.uint8).numpy())


def write_safetensors(path: Path, specs: list[tuple[str, str, tuple[int, ...]]],
                      produce: Callable[[int], torch.Tensor], on_bytes: Callable[[int], None] | None = None,
                      after_tensor: Callable[[], None] | None = None) -> tuple[int, str]:
    """Stream a safetensors file: specs (name, dtype, shape) in order; ``produce(i)`` gives tensor i.

    Returns (size, sha256). Each produced tensor is checked against its spec before it is written.
    """
    header, offs = encode_header(specs)
    with AtomicFile(path) as f:
        f.write(header)
        for i, (name, dtype, shape) in enumerate(specs):
            t = produce(i)
            if tuple(t.shape) != tuple(shape) or str(t.dtype).replace("torch.", "") != dtype:
                raise ShardError(f"internal: {name} produced {tuple(t.shape)} {t.dtype}, planned {shape} {dtype}")
            b = tensor_bytes(t)
            assert b.nbytes == offs[i][1] - offs[i][0]
            f.write(b)
            del t, b
            if on_bytes:
                on_bytes(offs[i][1] - offs[i][0])
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
