"""``OUT/manifest.json``: the commit point of a sharded output, and the API that loads one rank from it.

The manifest holds the plan, the source files with sha256, every output file with sha256 and size, and
for every output tensor its source name, slice (dim, start, stop), transform and dtype. It carries a
digest of its own body, so an edited manifest is refused. File names read from it are checked never to
leave OUT; tensor names only ever index into safetensors files.

Runtime use::

    m = load_manifest(out_dir)
    for name, (tslice, load) in open_rank(out_dir, rank).items():
        tensor = load()   # this rank's part of checkpoint tensor `name`, as tslice says
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from adapt.errors import ShardError
from adapt.plan import TensorSlice

MANIFEST = "manifest.json"
VERSION = 1
_RANK_FILE = re.compile(r"^rank-\d{5}/[A-Za-z0-9][A-Za-z0-9._-]*\.safetensors$")
_PLAIN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")


def rank_dir(rank: int) -> str:
    return f"rank-{rank:05d}"


@dataclass(frozen=True)
class OutputTensor:
    """One tensor of an output file: ``slice`` of source tensor ``source`` after ``transform``."""

    name: str
    source: str
    source_file: str
    slice: TensorSlice
    shape: tuple[int, ...]
    full_shape: tuple[int, ...]
    transform: str  # none | cast | fp8_block_dequant
    dtype: str
    source_dtype: str
    scale: str | None = None  # fp8_block_dequant: the source scale tensor

    def to_json(self) -> dict[str, Any]:
        s = self.slice
        return dict(name=self.name, source=self.source, source_file=self.source_file,
                    slice=None if s.whole else dict(dim=s.dim, start=s.start, stop=s.stop),
                    shape=list(self.shape), full_shape=list(self.full_shape), transform=self.transform,
                    dtype=self.dtype, source_dtype=self.source_dtype, scale=self.scale)

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> "OutputTensor":
        s = d["slice"]
        ts = TensorSlice(d["source"]) if s is None else TensorSlice(d["source"], int(s["dim"]), int(s["start"]),
                                                                    int(s["stop"]))
        return cls(str(d["name"]), str(d["source"]), str(d["source_file"]), ts, tuple(int(x) for x in d["shape"]),
                   tuple(int(x) for x in d["full_shape"]), str(d["transform"]), str(d["dtype"]),
                   str(d["source_dtype"]), d.get("scale"))


@dataclass(frozen=True)
class OutputFile:
    path: str  # relative to OUT: rank-XXXXX/model-XXXXX-of-XXXXX.safetensors
    rank: int
    tensors: tuple[OutputTensor, ...]
    size: int = 0
    sha256: str = ""

    @property
    def nbytes(self) -> int:
        return sum(_numel(t.shape) * _itemsize(t.dtype) for t in self.tensors)

    def to_json(self) -> dict[str, Any]:
        return dict(path=self.path, rank=self.rank, size=self.size, sha256=self.sha256,
                    tensors=[t.to_json() for t in self.tensors])


@dataclass(frozen=True)
class Manifest:
    model: str
    model_type: str
    plan: dict[str, Any]
    dtype: str  # the --dtype choice
    max_file_size: int
    source_dir: str
    source_config: dict[str, Any]
    source_files: tuple[dict[str, Any], ...]  # {name, size, sha256}
    files: tuple[OutputFile, ...]
    extra_files: tuple[dict[str, Any], ...] = ()  # config and tokenizer files: {path, size, sha256}
    block_size: tuple[int, int] | None = None
    version: int = VERSION

    def rank_files(self, rank: int) -> list[OutputFile]:
        return [f for f in self.files if f.rank == rank]

    @property
    def world_size(self) -> int:
        return int(self.plan["world_size"])

    def body(self) -> dict[str, Any]:
        return dict(adapt_shard=self.version, model=self.model, model_type=self.model_type, plan=self.plan,
                    dtype=self.dtype, max_file_size=self.max_file_size,
                    block_size=list(self.block_size) if self.block_size else None,
                    source=dict(dir=self.source_dir, files=list(self.source_files), config=self.source_config),
                    files=[f.to_json() for f in self.files], extra_files=list(self.extra_files))

    def to_json(self) -> str:
        body = self.body()
        body["manifest_sha256"] = _digest(body)
        return json.dumps(body, indent=1) + "\n"


def _digest(body: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def check_rel_path(path: Any, out_dir: Path, kind: str = "file") -> Path:
    """A manifest file path as a Path under out_dir, or ShardError if it could escape it."""
    ok = isinstance(path, str) and ".." not in path and "\\" not in path and "\0" not in path and (
        _RANK_FILE.match(path) if kind == "rank" else _PLAIN.match(path))
    if not ok:
        raise ShardError(f"{out_dir / MANIFEST}: unsafe file name {path!r} (must stay inside the output directory)")
    full = (out_dir / path).resolve()
    if not full.is_relative_to(out_dir.resolve()):
        raise ShardError(f"{out_dir / MANIFEST}: file name {path!r} escapes the output directory")
    return out_dir / path


def parse_manifest(text: str, out_dir: Path) -> Manifest:
    """Parse and check a manifest's text: digest, schema and file names."""
    where = out_dir / MANIFEST
    try:
        d = json.loads(text)
    except json.JSONDecodeError as e:
        raise ShardError(f"{where}: malformed JSON ({e.msg} at line {e.lineno})") from e
    if not isinstance(d, dict) or d.get("adapt_shard") != VERSION:
        raise ShardError(f"{where}: not an adapt shard manifest (version {VERSION})")
    digest = d.pop("manifest_sha256", None)
    if digest != _digest(d):
        raise ShardError(f"{where}: manifest digest does not match its contents (the manifest was edited)")
    try:
        files = []
        for f in d["files"]:
            check_rel_path(f["path"], out_dir, "rank")
            if not f["path"].startswith(rank_dir(int(f["rank"])) + "/"):
                raise ShardError(f"{where}: file {f['path']} is not in the directory of rank {f['rank']}")
            files.append(OutputFile(f["path"], int(f["rank"]), tuple(OutputTensor.from_json(t) for t in f["tensors"]),
                                    int(f["size"]), str(f["sha256"])))
        extra = tuple(dict(e) for e in d.get("extra_files", []))
        for e in extra:
            check_rel_path(e["path"], out_dir)
        src = d["source"]
        return Manifest(str(d["model"]), str(d["model_type"]), dict(d["plan"]), str(d["dtype"]),
                        int(d["max_file_size"]), str(src["dir"]), dict(src["config"]), tuple(src["files"]),
                        tuple(files), extra, tuple(d["block_size"]) if d.get("block_size") else None)
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise ShardError(f"{where}: malformed manifest ({type(e).__name__}: {e})") from e


def load_manifest(out_dir: str | Path) -> Manifest:
    """Read and check ``OUT/manifest.json``. Raises ShardError (one line) if absent, malformed or edited."""
    out_dir = Path(out_dir)
    try:
        text = (out_dir / MANIFEST).read_text()
    except OSError as e:
        raise ShardError(f"{out_dir} has no readable {MANIFEST} (not a complete adapt shard output)") from e
    return parse_manifest(text, out_dir)


def open_rank(out_dir: str | Path, rank: int, manifest: Manifest | None = None
              ) -> dict[str, tuple[TensorSlice, Callable[[], Any]]]:
    """This rank's tensors: checkpoint name -> (the TensorSlice it holds, a loader returning the torch tensor).

    Loaders read lazily from the rank's safetensors files; call ``verify`` first to check checksums.
    """
    out_dir = Path(out_dir)
    m = manifest or load_manifest(out_dir)
    if not 0 <= rank < m.world_size:
        raise ShardError(f"rank {rank} is outside the plan's world size {m.world_size}")
    out: dict[str, tuple[TensorSlice, Callable[[], Any]]] = {}
    for f in m.rank_files(rank):
        path = check_rel_path(f.path, out_dir, "rank")
        for t in f.tensors:
            out[t.name] = (t.slice, _loader(path, t.name))
    return out


def _loader(path: Path, name: str) -> Callable[[], Any]:
    def load():
        from safetensors import safe_open

        with safe_open(str(path), framework="pt") as fh:
            return fh.get_tensor(name)
    return load


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def _itemsize(dtype: str) -> int:
    from adapt.shard.header import DTYPES, TORCH_TO_ST

    return DTYPES[TORCH_TO_ST[dtype]][1]


__all__ = ["Manifest", "OutputFile", "OutputTensor", "load_manifest", "open_rank", "parse_manifest", "rank_dir",
           "check_rel_path", "MANIFEST"]
