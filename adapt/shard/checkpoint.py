"""Reading an HF checkpoint directory: its files, validated headers, and tensors slice by slice.

Safetensors files are read with ``os.preadv`` at the offsets :func:`read_header` validated (see
:mod:`adapt.shard.stream`), so only the asked-for slice is ever read, and nothing is mapped. Pickle files (``.bin``, ``.pt``) are refused unless the
caller allows them, and are then loaded with ``torch.load(weights_only=True, mmap=True)``.
"""

from __future__ import annotations

import json
import os
import threading
from dataclasses import dataclass
from pathlib import Path

from adapt.errors import CheckpointError
from adapt.layout import WeightLayout, part_rule
from adapt.shard.header import DTYPES, TORCH_TO_ST, Header, read_header
from adapt.shard.stream import ByteSlice, byte_slice, read_into

PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")
# Non-weight buffers some checkpoints carry; never sharded, never an error.
IGNORED_SUFFIXES = (".rotary_emb.inv_freq",)


@dataclass(frozen=True)
class SourceTensor:
    name: str
    file: str  # file name inside the checkpoint directory
    dtype: str  # torch dtype name
    shape: tuple[int, ...]
    nbytes: int
    offset: int = -1  # absolute file offset of the data (safetensors), -1 for pickles


class Checkpoint:
    """The tensors of a checkpoint directory; ``read`` returns one slice as a torch tensor."""

    def __init__(self, directory: Path, tensors: dict[str, SourceTensor], files: list[str], pickle: bool = False,
                 sizes: dict[str, int] | None = None):
        self.directory = Path(directory)
        self.tensors = tensors
        self.files = files
        self.pickle = pickle
        self._pickled: dict[str, dict] = {}
        self._lock = threading.Lock()
        self._fds: dict[str, int] = {}
        self.sizes: dict[str, int] = dict(sizes or {})

    def read(self, name: str, dim: int | None = None, start: int = 0, stop: int = 0):
        """The tensor ``name``, or its [start, stop) part along ``dim``: only that part is read."""
        t = self.tensors[name]
        if self.pickle:
            with self._lock:
                if t.file not in self._pickled:
                    self._pickled[t.file] = _torch_load(self.directory / t.file)
            full = self._pickled[t.file][name]
            return full.clone() if dim is None else full.narrow(dim, start, stop - start).clone()
        return self._read_safetensors(t, dim, start, stop)

    def byte_slice(self, name: str, dim: int | None = None, start: int = 0, stop: int = 0) -> ByteSlice:
        """Where the slice's bytes lie in its (validated) source file."""
        t = self.tensors[name]
        assert t.offset >= 0, f"{name}: not a safetensors tensor"
        return byte_slice(t.offset, t.shape, DTYPES[TORCH_TO_ST[t.dtype]][1], dim, start, stop)

    def fd(self, file: str) -> int:
        """A raw read-only descriptor of a source file, opened once and shared (pread is thread-safe)."""
        fd = self._fds.get(file)
        if fd is None:
            with self._lock:
                fd = self._fds.get(file)
                if fd is None:
                    path = self.directory / file
                    try:
                        fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
                    except OSError as e:
                        raise CheckpointError(f"cannot read {path}: {e.strerror}") from e
                    if os.fstat(fd).st_size != self.sizes.get(file, -1):
                        os.close(fd)
                        raise CheckpointError(f"{path} changed size since its header was validated")
                    self._fds[file] = fd
        return fd

    def _read_safetensors(self, t: SourceTensor, dim: int | None, start: int, stop: int):
        """pread the slice straight into a fresh tensor (strided slices through a bounded gather buffer):
        no mmap, so resident memory is the output slice plus one chunk whatever the file size."""
        import torch

        shape = list(t.shape)
        if dim is not None:
            shape[dim] = stop - start
        out = torch.empty(shape, dtype=getattr(torch, t.dtype))
        if out.numel() == 0:
            return out
        dest = memoryview(out.reshape(-1).view(torch.uint8).numpy())
        read_into(self.fd(t.file), self.byte_slice(t.name, dim, start, stop), dest)
        return out

    def close(self) -> None:
        self._pickled.clear()
        with self._lock:
            for fd in self._fds.values():
                os.close(fd)
            self._fds.clear()


def _torch_load(path: Path) -> dict:
    import pickle

    import torch

    try:
        sd = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except (pickle.UnpicklingError, RuntimeError, OSError, EOFError) as e:
        raise CheckpointError(f"{path}: cannot load with weights_only=True: {str(e).splitlines()[0]}") from e
    if not isinstance(sd, dict) or not all(isinstance(v, torch.Tensor) for v in sd.values()):
        raise CheckpointError(f"{path}: not a state dict of tensors")
    return sd


def checkpoint_files(directory: Path, allow_pickle: bool = False) -> tuple[list[str], bool]:
    """The weight files of a checkpoint directory (index.json first), and whether they are pickles."""
    directory = Path(directory)
    if not directory.is_dir():
        raise CheckpointError(f"{directory} is not a checkpoint directory")
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            files = sorted(set(weight_map.values()))
        except (json.JSONDecodeError, KeyError, TypeError, AttributeError) as e:
            raise CheckpointError(f"{index}: malformed index ({e})") from e
        for f in files:
            _safe_file_name(f, index)
            if not (directory / f).is_file():
                raise CheckpointError(f"{index} names {f}, which is missing")
        return files, False
    files = sorted(p.name for p in directory.glob("*.safetensors"))
    if files:
        return files, False
    pickles = sorted(p.name for p in directory.iterdir() if p.suffix in PICKLE_SUFFIXES and p.is_file())
    if pickles:
        if not allow_pickle:
            raise CheckpointError(f"{directory} holds pickle weights ({', '.join(pickles[:3])}); pickle can run "
                                  "code on load: pass --allow-pickle to load them with torch.load(weights_only=True)")
        return pickles, True
    raise CheckpointError(f"{directory} holds no *.safetensors (or index) weight files")


def _safe_file_name(name: str, where: Path) -> None:
    if not isinstance(name, str) or not name or "/" in name or "\\" in name or name in (".", "..") or "\0" in name:
        raise CheckpointError(f"{where}: unsafe file name {name!r} (must be a plain name inside the directory)")


def open_checkpoint(directory: Path, allow_pickle: bool = False) -> tuple[Checkpoint, dict[str, Header]]:
    """Validate every header and index the tensors; nothing is allocated beyond the headers."""
    directory = Path(directory)
    files, is_pickle = checkpoint_files(directory, allow_pickle)
    tensors: dict[str, SourceTensor] = {}
    headers: dict[str, Header] = {}
    for f in files:
        if is_pickle:
            for name, t in _torch_load(directory / f).items():
                tensors[name] = SourceTensor(name, f, str(t.dtype).replace("torch.", ""), tuple(t.shape),
                                             t.numel() * t.element_size())
            continue
        h = read_header(directory / f)
        headers[f] = h
        for name, e in h.tensors.items():
            if name in tensors:
                raise CheckpointError(f"tensor {name!r} is in both {tensors[name].file} and {f}")
            tensors[name] = SourceTensor(name, f, e.dtype, e.shape, e.nbytes, e.begin)
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        for name, f in weight_map.items():
            if name not in tensors or tensors[name].file != f:
                raise CheckpointError(f"{index}: {name!r} is mapped to {f} but that file does not hold it")
    sizes = {f: h.file_size for f, h in headers.items()}
    return Checkpoint(directory, tensors, files, is_pickle, sizes), headers


def check_against_layout(ckpt: Checkpoint, layout: WeightLayout) -> list[str]:
    """Compare the checkpoint with the layout; raise CheckpointError listing every missing, extra and
    mis-shaped tensor. Returns the names of the layout tensors to shard (MTP tensors are optional: all of
    them or none)."""
    have = {n: t for n, t in ckpt.tensors.items() if not n.endswith(IGNORED_SUFFIXES)}
    want = {t.name: t for t in layout}
    mtp = [n for n, t in want.items() if t.mtp]
    use_mtp = any(n in have for n in mtp)
    missing = [n + (f" (the {t.scale_of} companion; {part_rule(n)})" if t.scale_of else "")
               for n, t in want.items() if n not in have and (use_mtp or not t.mtp)]
    extra = [n for n in have if n not in want]
    shaped = [f"{n} {list(have[n].shape)} (expected {list(t.stored_shape)}"
              + (f": {part_rule(n)}, N x K = {' x '.join(map(str, layout[t.scale_of].shape))})" if t.scale_of else ")")
              for n, t in want.items() if n in have and have[n].shape != t.stored_shape]
    fp8 = [f"{n} is {have[n].dtype} (expected float8_e4m3fn)" for n, t in want.items()
           if n in have and t.dtype == "float8_e4m3fn" and have[n].dtype != "float8_e4m3fn"]
    problems = []
    for label, items in (("missing", missing), ("extra", extra), ("mis-shaped", shaped), ("wrong dtype", fp8)):
        if items:
            more = f" ... (+{len(items) - 20} more)" if len(items) > 20 else ""
            problems.append(f"{len(items)} {label}: {', '.join(items[:20])}{more}")
    if problems:
        raise CheckpointError(f"checkpoint {ckpt.directory} does not match the {layout.spec.model_type} layout: "
                              + "; ".join(problems))
    return [n for n, t in want.items() if n in have]

