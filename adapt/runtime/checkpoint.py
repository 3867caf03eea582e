"""What MODEL names for the runtime: a checkpoint dir, an ``adapt shard`` output dir, or a built-in name.

A checkpoint dir holds config.json and safetensors (single file or index.json-sharded), optionally
tokenizer.json and generation_config.json. A shard output holds manifest.json and rank-XXXXX/ dirs of
safetensors with each rank's slices; the config is OUT/config.json or the manifest's ``config``. A
built-in name (tiny-k2, tiny-llama, tiny-qwen3-moe) is written once by ``init-model`` into
$ADAPT_CACHE (default ~/.cache/adapt)/models/NAME and read from there.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from adapt.builtin import BUILTIN_CONFIGS
from adapt.errors import CheckpointError, ModelNotFoundError
from adapt.runtime.loader import SafetensorsReader
from adapt.runtime.parallel import ParallelContext
from adapt.spec import ModelSpec
from adapt.source import read_config


@dataclass
class OpenedModel:
    path: Path
    spec: ModelSpec
    reader: SafetensorsReader
    presliced: bool  # the files hold this rank's slices already (shard output)
    tokenizer: object | None
    eos_token_ids: tuple[int, ...]


def open_model(model: str | Path, ctx: ParallelContext) -> OpenedModel:
    path = Path(model).expanduser()
    if not path.is_dir():
        if str(model) in BUILTIN_CONFIGS:
            from adapt.runtime.init_model import builtin_checkpoint
            path = builtin_checkpoint(str(model))
        else:
            raise ModelNotFoundError(f"{model!r} is not a checkpoint directory, an adapt shard output or a built-in "
                                     f"model ({', '.join(BUILTIN_CONFIGS)})")
    manifest = path / "manifest.json"
    if manifest.is_file():
        cfg, reader = _open_shard(path, ctx)
        presliced = True
    else:
        if not (path / "config.json").is_file():
            raise ModelNotFoundError(f"{path} has neither config.json nor manifest.json")
        cfg, presliced = read_config(path / "config.json"), False
        reader = None
    spec = ModelSpec.from_hf_config(cfg, name=path.name)
    reader = reader if reader is not None else SafetensorsReader.from_dir(path)
    tok_dir = path if any((path / f).is_file() for f in ("tokenizer.json", "tiktoken.model")) else None
    tokenizer = None
    if tok_dir is not None:
        from adapt.runtime.tokenizer import Tokenizer
        tokenizer = Tokenizer.from_dir(tok_dir)
    return OpenedModel(path, spec, reader, presliced, tokenizer, _eos_ids(path, spec))


class ShardRankReader:
    """This rank's tensors of an ``adapt shard`` output, through adapt.shard's manifest API (checked
    digest, paths confined to OUT). The tensors are already the rank's slices."""

    def __init__(self, loaders: dict):
        self._loaders = loaders

    def __contains__(self, name: str) -> bool:
        return name in self._loaders

    def read(self, name: str, sl=None):
        if name not in self._loaders:
            raise CheckpointError(f"shard output has no tensor {name!r} for this rank")
        return self._loaders[name][1]()


def _open_shard(path: Path, ctx: ParallelContext):
    """(config, reader) of a shard output; adapt.shard's API when present, else the plain file layout."""
    try:
        from adapt.shard.manifest import load_manifest, open_rank
    except ImportError:
        cfg, files = _shard_files(path, path / "manifest.json", ctx)
        return cfg, SafetensorsReader(files)
    man = load_manifest(path)
    if man.world_size != ctx.world_size:
        raise CheckpointError(f"{path} is sharded for {man.world_size} ranks but this run has {ctx.world_size}; "
                              f"launch with --nproc {man.world_size} (or shard again for one rank)")
    cfg = read_config(path / "config.json") if (path / "config.json").is_file() else dict(man.source_config)
    return cfg, ShardRankReader(open_rank(path, ctx.rank, man))


def _shard_files(path: Path, manifest: Path, ctx: ParallelContext) -> tuple[dict, list[Path]]:
    try:
        man = json.loads(manifest.read_text())
    except ValueError as e:
        raise CheckpointError(f"{manifest}: malformed JSON ({e})") from None
    cfg = read_config(path / "config.json") if (path / "config.json").is_file() else man.get("config")
    if not isinstance(cfg, dict):
        raise CheckpointError(f"{path}: shard output has no config.json and the manifest holds no 'config'")
    world = _world_size(man)
    if world is not None and world != ctx.world_size:
        raise CheckpointError(f"{path} is sharded for {world} ranks but this run has {ctx.world_size}; "
                              f"launch with --nproc {world} (or shard again for one rank)")
    rank_dir = path / f"rank-{ctx.rank:05d}"
    files = sorted(rank_dir.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{rank_dir} holds no .safetensors files (missing shard for rank {ctx.rank})")
    return cfg, files


def _world_size(man: dict) -> int | None:
    plan = man.get("plan") or {}
    for v in (man.get("world_size"), plan.get("world_size") if isinstance(plan, dict) else None):
        if isinstance(v, int):
            return v
    return None


def _eos_ids(path: Path, spec: ModelSpec) -> tuple[int, ...]:
    ids = list(spec.eos_token_ids)
    gen = path / "generation_config.json"
    if gen.is_file():
        try:
            e = json.loads(gen.read_text()).get("eos_token_id")
        except ValueError:
            e = None
        for x in (e if isinstance(e, list) else [e]):
            if isinstance(x, int) and x not in ids:
                ids.append(x)
    return tuple(ids)
