"""``adapt slice``: a smaller checkpoint holding the real weights of chosen layers and experts.

The slice is an ordinary HF checkpoint directory (transformers, ``adapt run``, ``shard``, ``validate`` read it):
one safetensors file per kept layer plus one for the embedding, final norm and lm_head, an index, the
adjusted config.json (``slice_config``), the source's tokenizer and other non-weight files, and ``slice.json``:
the selection, every config adjustment with its reason, and per tensor its source name and file, the rows it
keeps (router and correction bias when experts are dropped; else the whole tensor) and the sha256 of its
bytes; per file its sha256. ``verify_slice`` re-hashes the files and, given the source, re-reads every
source tensor and checks the slice's bytes are its bytes. Layers and experts are renumbered from 0 in order;
tensors keep their dtype (FP8 weights and their scales are copied, not converted). Written into a
temporary directory beside OUT and renamed when complete: a failed run leaves nothing at OUT.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from adapt.errors import ShardError
from adapt.layout import WeightLayout
from adapt.shard.slice_config import slice_config
from adapt.spec import ModelSpec

FORMAT = "adapt-slice"
VERSION = 1
_WEIGHTS = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".pkl")
_SKIP = {"config.json", "model.safetensors.index.json", "slice.json", "manifest.json"}


def _sha(t) -> str:
    import torch

    return hashlib.sha256(t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()).hexdigest()


def _file_sha(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(8 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _plan(layout: WeightLayout, layers: Sequence[int], experts: Sequence[int] | None, keep_mtp: bool
          ) -> list[tuple[int | None, str, str, list[int] | None]]:
    """(output layer or None, new name, source name, rows) for every tensor the slice holds."""
    spec = layout.spec
    new_layer = {old: j for j, old in enumerate(layers)}
    if keep_mtp:
        for j in range(spec.num_mtp_layers):
            new_layer[spec.num_layers + j] = len(layers) + j
    new_expert = {old: j for j, old in enumerate(experts)} if experts is not None else None
    out = []
    for t in layout:
        if t.mtp and not keep_mtp:
            continue
        if t.layer is None:
            out.append((None, t.name, t.name, None))
            continue
        if t.layer not in new_layer:
            continue
        j = new_layer[t.layer]
        name = re.sub(rf"\.layers\.{t.layer}\.", f".layers.{j}.", t.name, count=1)
        rows = None
        if new_expert is not None:
            if t.expert is not None:
                if t.expert not in new_expert:
                    continue
                name = name.replace(f".experts.{t.expert}.", f".experts.{new_expert[t.expert]}.")
            elif t.role in ("router", "router_bias"):
                rows = list(experts)
        out.append((j, name, t.name, rows))
    return out


def slice_checkpoint(model: str | Path, out: str | Path, layers: Sequence[int], experts: Sequence[int] | None = None,
                     keep_mtp: bool = False, force: bool = False) -> dict[str, Any]:
    """Write the slice of MODEL at OUT; returns slice.json's content."""
    import torch
    from safetensors.torch import save_file

    from adapt.shard.checkpoint import check_against_layout, open_checkpoint
    from adapt.source import read_config

    src, out = Path(model), Path(out)
    if not (src / "config.json").is_file():
        raise ShardError(f"{src}: not a checkpoint directory (no config.json)")
    if out.exists() and not (force and (out / "slice.json").is_file()):
        raise ShardError(f"{out} exists" + ("" if not (out / "slice.json").is_file() else
                                            " (an adapt slice: --force replaces it)"))
    cfg = read_config(src / "config.json")
    spec = ModelSpec.from_hf_config(cfg, name=src.name)
    if spec.vision is not None:
        raise ShardError(f"{spec.model_type}: adapt slice covers the text families")
    new_cfg, adjustments = slice_config(cfg, layers, experts, keep_mtp)
    layout = WeightLayout.from_spec(spec)
    ckpt, _ = open_checkpoint(src)
    have = set(check_against_layout(ckpt, layout))
    if keep_mtp and spec.num_mtp_layers and not any(t.mtp and t.name in have for t in layout):
        raise ShardError(f"--keep-mtp: {src} holds no MTP layer tensors")
    plan = [p for p in _plan(layout, layers, experts, keep_mtp) if p[2] in have]
    groups: dict[int | None, list] = {}
    for p in plan:
        groups.setdefault(p[0], []).append(p)
    order = [None] + sorted(k for k in groups if k is not None)
    names = {g: f"model-{n + 1:05d}-of-{len(order):05d}.safetensors" for n, g in enumerate(order)}
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.partial-", dir=out.parent))
    tensors, files, weight_map = {}, {}, {}
    try:
        for g in order:
            part = {}
            for _layer, name, source, rows in groups.get(g, []):
                t = ckpt.read(source)
                src_sha = _sha(t)
                if rows is not None:
                    t = t.index_select(0, torch.tensor(rows, dtype=torch.long)).contiguous()
                part[name] = t
                tensors[name] = {"source": source, "source_file": ckpt.tensors[source].file, "rows": rows,
                                 "dtype": str(t.dtype).replace("torch.", ""), "shape": list(t.shape),
                                 "sha256": _sha(t), "source_sha256": src_sha}
                weight_map[name] = names[g]
            save_file(part, str(tmp / names[g]), metadata={"format": "pt"})
            files[names[g]] = _file_sha(tmp / names[g])
            del part
        for f in sorted(src.iterdir()):
            if f.is_file() and f.name not in _SKIP and not f.name.endswith(_WEIGHTS):
                shutil.copy2(f, tmp / f.name)
                files[f.name] = _file_sha(tmp / f.name)
        (tmp / "config.json").write_text(json.dumps(new_cfg, indent=2) + "\n", encoding="utf-8")
        files["config.json"] = _file_sha(tmp / "config.json")
        index = {"metadata": {"total_size": sum(os.path.getsize(tmp / n) for n in names.values())},
                 "weight_map": dict(sorted(weight_map.items()))}
        (tmp / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n", encoding="utf-8")
        doc = {"format": FORMAT, "version": VERSION, "source": str(src.resolve()),
               "source_files": {f: ckpt.sizes.get(f) for f in ckpt.files},
               "layers": list(layers), "experts": list(experts) if experts is not None else None,
               "keep_mtp": keep_mtp, "adjustments": adjustments, "files": files, "tensors": tensors}
        (tmp / "slice.json").write_text(json.dumps(doc, indent=1) + "\n", encoding="utf-8")
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    finally:
        ckpt.close()
    return doc


def verify_slice(out: str | Path, source: str | Path | None = None) -> dict[str, Any]:
    """Check a slice: every file's sha256, every tensor's bytes against slice.json, and with ``source`` every
    tensor against the source tensor it names (its rows where it keeps rows). ShardError on any mismatch."""
    import torch
    from safetensors import safe_open

    from adapt.shard.checkpoint import open_checkpoint

    out = Path(out)
    try:
        doc = json.loads((out / "slice.json").read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ShardError(f"{out}: no readable slice.json ({e})") from None
    if doc.get("format") != FORMAT:
        raise ShardError(f"{out}: slice.json is not an adapt slice manifest")
    bad = [f for f, h in doc["files"].items() if not (out / f).is_file() or _file_sha(out / f) != h]
    if bad:
        raise ShardError(f"{out}: {len(bad)} file(s) missing or changed: {', '.join(bad[:5])}")
    index = json.loads((out / "model.safetensors.index.json").read_text(encoding="utf-8"))["weight_map"]
    src = open_checkpoint(Path(source))[0] if source is not None else None
    checked = 0
    try:
        for name, rec in doc["tensors"].items():
            with safe_open(str(out / index[name]), framework="pt") as h:
                t = h.get_tensor(name)
            if _sha(t) != rec["sha256"]:
                raise ShardError(f"{out}: tensor {name} does not match its sha256 in slice.json")
            if src is not None:
                if rec["source"] not in src.tensors:
                    raise ShardError(f"{source}: has no tensor {rec['source']} (source of {name})")
                s = src.read(rec["source"])
                if _sha(s) != rec["source_sha256"]:
                    raise ShardError(f"{source}: tensor {rec['source']} changed since the slice was made")
                if rec["rows"] is not None:
                    s = s.index_select(0, torch.tensor(rec["rows"], dtype=torch.long))
                if s.dtype != t.dtype or s.shape != t.shape or _sha(s) != rec["sha256"]:
                    raise ShardError(f"{out}: tensor {name} is not the bytes of {source}'s {rec['source']}")
            checked += 1
    finally:
        if src is not None:
            src.close()
    return {"slice": str(out), "files": len(doc["files"]), "tensors": checked, "source_checked": src is not None}
