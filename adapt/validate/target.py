"""The target side of a validation: what runs on the device under test, behind one small Protocol.

``ModelRunner`` is all the checks need from a runtime: prefill logits, greedy generation with top-k
logprobs, and the output of every decoder layer and of the sub-modules inside it (input norm,
attention, post-attention norm, MLP). Both adapt's runtime (``Engine``) and transformers implement it,
so the same checks compare either against the reference.

Layer output names (``layer_names``) are runtime-neutral, in execution order::

    embedding, layers.{i}.input_norm, layers.{i}.attention, layers.{i}.post_attention_norm,
    layers.{i}.mlp, layers.{i}, ..., final_norm

``open_target`` picks the runtime: ``adapt`` (the Engine, when adapt.runtime.engine exists),
``transformers`` (the checkpoint run by transformers on the device and dtype asked), or ``auto`` (adapt
when it is importable, else transformers, and the report says which ran).
"""

from __future__ import annotations

import importlib
import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import torch

from adapt.errors import ValidationInputError

SUBMODULES = ("input_norm", "attention", "post_attention_norm", "mlp")
RUNTIMES = ("auto", "adapt", "transformers")


def layer_names(num_layers: int) -> list[str]:
    """Every hooked output, in execution order (see the module docstring)."""
    names = ["embedding"]
    for i in range(num_layers):
        names += [f"layers.{i}.{m}" for m in SUBMODULES] + [f"layers.{i}"]
    return names + ["final_norm"]


def parse_layer_name(name: str) -> tuple[int | None, str]:
    """``layers.3.attention`` -> (3, "attention"); ``layers.3`` -> (3, "output"); ``final_norm`` -> (None, ...)."""
    parts = name.split(".")
    if parts[0] == "layers" and len(parts) >= 2 and parts[1].isdigit():
        return int(parts[1]), parts[2] if len(parts) > 2 else "output"
    return None, name


@dataclass
class Generation:
    """Greedy continuation: ``tokens[p]`` and the top-N logprobs (token -> logprob) it was chosen from."""

    tokens: list[int]
    logprobs: list[dict[int, float]]


@runtime_checkable
class ModelRunner(Protocol):
    """What a check needs from a runtime. Tensors come back on CPU in float32."""

    name: str
    num_layers: int
    vocab_size: int

    def prefill_logits(self, ids: Sequence[int]) -> torch.Tensor:
        """Logits [T, V] of one prompt."""
        ...

    def generate_greedy(self, ids: Sequence[int], max_new_tokens: int, top_n: int = 5) -> Generation:
        """Greedy decode of ``max_new_tokens`` tokens with the top-N logprobs of each step."""
        ...

    def layer_outputs(self, ids: Sequence[int]) -> dict[str, torch.Tensor]:
        """Every name of ``layer_names`` -> its output [T, H] for one prompt."""
        ...


@dataclass
class Target:
    """An opened target: the runner (None when it could not be built, with ``reason``), its directory,
    what kind of directory it is (hf | shard) and the stage timings of opening it."""

    path: Path
    kind: str
    runtime: str
    runner: ModelRunner | None
    reason: str = ""
    manifest: dict[str, Any] | None = None
    stages: dict[str, float] = field(default_factory=dict)
    engine: Any = None  # the adapt Engine when runtime == "adapt"


def detect_kind(path: Path) -> str:
    """``shard`` when ``path`` holds an adapt shard manifest, ``hf`` when it holds a config.json."""
    if (path / "manifest.json").is_file():
        return "shard"
    if (path / "config.json").is_file():
        return "hf"
    raise ValidationInputError(f"target {path}: neither an HF checkpoint (config.json) nor an adapt shard "
                               "output (manifest.json)")


def engine_module() -> Any | None:
    """``adapt.runtime.engine`` when it has landed, else None."""
    try:
        mod = importlib.import_module("adapt.runtime.engine")
    except ImportError:
        return None
    return mod if hasattr(mod, "Engine") else None


def _read_manifest(path: Path) -> dict[str, Any] | None:
    p = path / "manifest.json"
    if not p.is_file():
        return None
    try:
        return json.loads(p.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as e:
        raise ValidationInputError(f"target {path}: manifest.json unreadable ({e})") from None


def open_target(path: str | Path, runtime: str = "auto", device: str = "cpu", dtype: str = "float32") -> Target:
    """Open TARGET with the runtime asked; a runtime that is missing gives a Target with no runner and
    the reason (its items then skip), never a stand-in."""
    p = Path(path)
    if not p.is_dir():
        raise ValidationInputError(f"target {p}: not a directory")
    if runtime not in RUNTIMES:
        raise ValidationInputError(f"--runtime must be one of {', '.join(RUNTIMES)}; got {runtime!r}")
    kind = detect_kind(p)
    manifest = _read_manifest(p)
    plan = (manifest or {}).get("plan") or {}
    world = (manifest or {}).get("world_size") or (plan.get("world_size") if isinstance(plan, dict) else None)
    if kind == "shard" and isinstance(world, int) and world > 1:
        raise ValidationInputError(
            f"target {p} is sharded for {world} ranks and validate runs its target in one process: shard for one "
            f"rank (`adapt shard SOURCE --out DIR`) and validate that, or validate SOURCE itself (its "
            f"parallel_consistency item runs the multi-rank layouts against one rank)")
    eng = engine_module()
    if runtime == "adapt" or (runtime == "auto" and eng is not None):
        if eng is None:
            return Target(p, kind, "adapt", None, "adapt's runtime (adapt.runtime.engine) is not available",
                          manifest)
        from adapt.validate.engine_runner import open_engine_runner

        runner, engine, stages = open_engine_runner(p, device=device, dtype=dtype)
        return Target(p, kind, "adapt", runner, manifest=manifest, stages=stages, engine=engine)
    if kind == "shard":
        return Target(p, kind, "transformers", None,
                      "transformers cannot read an adapt shard output; use --runtime adapt", manifest)
    from adapt.validate.reference import TransformersModel

    runner = TransformersModel.load(p, device=device, dtype=dtype)
    return Target(p, kind, "transformers", runner, manifest=manifest, stages=dict(runner.stages))
