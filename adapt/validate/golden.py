"""Golden directories: the reference's answers dumped on one machine, compared on another (llm.c style).

``adapt validate dump MODEL --out GOLDEN`` writes::

    GOLDEN/golden.json          format, model config, prompts, greedy tokens with top-k logprobs,
                                per-layer statistics (mean, std, absmax, l2) of every hooked output
    GOLDEN/tensors.safetensors  logits.{p} [T, V] prefill logits of prompt p;
                                layers.{p}.{name} [T, h] layer outputs at the sampled hidden dims;
                                layer_index [h] those dims; long.{L}.ids [L], long.{L}.logits [32, V]

JSON and safetensors only: loading a golden directory never runs code (no pickle).
``GoldenReference`` answers the same questions as ``reference.HFReference``.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from adapt.errors import ValidationInputError
from adapt.validate.checklist import Skip
from adapt.validate.reference import PROMPT_LENGTHS, HFReference
from adapt.validate.target import Generation

FORMAT = "adapt-golden"
VERSION = 1
MAX_SAMPLED_DIMS = 256  # hidden dims kept per layer output: all of them up to this, else a seeded sample
DEFAULT_LONG = (1024, 8192, 32768)


def sample_index(hidden_size: int, max_dims: int = MAX_SAMPLED_DIMS, seed: int = 0) -> torch.Tensor:
    """The hidden dims a golden keeps: all when few, else ``max_dims`` of them, seeded and sorted."""
    if hidden_size <= max_dims:
        return torch.arange(hidden_size)
    g = torch.Generator().manual_seed(seed)
    return torch.randperm(hidden_size, generator=g)[:max_dims].sort().values


def tensor_stats(x: torch.Tensor) -> dict[str, float]:
    x = x.double()
    return {"mean": float(x.mean()), "std": float(x.std()) if x.numel() > 1 else 0.0,
            "absmax": float(x.abs().max()), "l2": float(x.norm())}


def dump_golden(
    model: str | Path, out: str | Path, max_new_tokens: int = 16, top_n: int = 20,
    long_lengths: Sequence[int] = DEFAULT_LONG, long_budget_s: float = 60.0, stream: bool = False,
    memory_budget: float | None = None, prompt_lengths: Sequence[int] = PROMPT_LENGTHS,
) -> dict[str, Any]:
    """Run the float32 CPU reference on MODEL and write a golden directory; returns golden.json's content.

    Long-context rungs beyond ``max_position_embeddings`` are left out, so is every rung whose attention scores
    would not fit ``memory_budget`` bytes (default 80% of the memory free now), and so is every rung after one
    whose estimated time (quadratic in length from the last rung run) exceeds ``long_budget_s``.
    ``stream``: the layer-streamed reference (``streamed.StreamedReference``: one layer and the experts the
    prompts touch in memory; ``memory_budget`` then also bounds the float32 weights held at once); golden.json
    then records what it read and held.
    """
    from safetensors.torch import save_file

    if stream:
        from adapt.validate.streamed import StreamedReference

        ref = StreamedReference(model, max_new_tokens, top_n, memory_budget, prompt_lengths)
    else:
        ref = HFReference(model, prompt_lengths)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tensors: dict[str, torch.Tensor] = {}
    hidden = None
    gens, stats = [], []
    for p in range(len(ref.prompts)):
        tensors[f"logits.{p}"] = ref.logits(p).contiguous()
        layers = ref.layers(p)
        if hidden is None:
            hidden = sample_index(next(iter(layers.values())).shape[-1])
            tensors["layer_index"] = hidden
        stats.append({n: tensor_stats(t) for n, t in layers.items()})
        for n, t in layers.items():
            tensors[f"layers.{p}.{n}"] = t.index_select(-1, hidden).contiguous()
        g = ref.generation(p, max_new_tokens, top_n)
        gens.append({"tokens": g.tokens, "logprobs": [[[t, lp] for t, lp in d.items()] for d in g.logprobs]})
    long_done, skipped, last = [], [], None
    for length in sorted(long_lengths):
        if ref.max_position_embeddings and length > ref.max_position_embeddings:
            skipped.append({"length": length, "reason": f"beyond max_position_embeddings {ref.max_position_embeddings}"})
            continue
        too_big = ref.long_rung_too_big(length, memory_budget)
        if too_big:
            skipped.append({"length": length, "reason": too_big})
            continue
        if last is not None and last[1] * (length / last[0]) ** 2 > long_budget_s:
            skipped.append({"length": length, "reason": f"estimated {last[1] * (length / last[0]) ** 2:.0f}s "
                                                        f"> budget {long_budget_s:.0f}s"})
            continue
        t0 = time.perf_counter()
        tensors[f"long.{length}.ids"] = torch.tensor(ref.long_prompt(length), dtype=torch.long)
        tensors[f"long.{length}.logits"] = ref.long_logits(length).contiguous()
        last = (length, time.perf_counter() - t0)
        long_done.append(length)
    doc = {
        "format": FORMAT, "version": VERSION, "model": str(model),
        "config": ref.config.to_dict(),
        "num_layers": ref.num_layers, "vocab_size": ref.vocab_size,
        "max_position_embeddings": ref.max_position_embeddings,
        "reference": ref.description, "prompts": ref.prompts,
        "generation": {"max_new_tokens": max_new_tokens, "top_n": top_n, "prompts": gens},
        "layer_stats": stats, "long_context": {"lengths": long_done, "skipped": skipped},
        "tensors": "tensors.safetensors",
    }
    if stream:
        doc["streamed"] = ref.record()
    save_file(tensors, str(out / "tensors.safetensors"))
    (out / "golden.json").write_text(json.dumps(doc, indent=1, default=str) + "\n", encoding="utf-8")
    return doc


def id_ranges(ids) -> str:
    """[0, 1, 2, 5, 7, 8] -> '0-2,5,7-8'."""
    ids = sorted(int(i) for i in ids)
    parts, i = [], 0
    while i < len(ids):
        j = i
        while j + 1 < len(ids) and ids[j + 1] == ids[j] + 1:
            j += 1
        parts.append(str(ids[i]) if i == j else f"{ids[i]}-{ids[j]}")
        i = j + 1
    return ",".join(parts)


def streamed_summary(st: dict[str, Any]) -> dict[str, Any]:
    """What a report says of a streamed golden: bytes read, memory, and the experts loaded per layer."""
    return {"bytes_read": st.get("bytes_read"), "passes": st.get("passes"),
            "peak_weight_bytes": st.get("peak_weight_bytes"), "peak_rss_bytes": (st.get("rss") or {}).get("peak_bytes"),
            "memory_budget": st.get("memory_budget"),
            "experts_chunked_layers": st.get("experts_chunked_layers") or [],
            "experts_loaded": {k: f"{len(v)}: {id_ranges(v)}" for k, v in (st.get("experts_per_layer") or {}).items()}}


def is_golden(path: str | Path) -> bool:
    return (Path(path) / "golden.json").is_file()


class GoldenReference:
    """A golden directory as a reference (same questions as ``HFReference``; no plain-torch twin)."""

    kind = "golden"

    def __init__(self, path: str | Path):
        from safetensors import SafetensorError
        from safetensors.torch import load_file

        self.path = Path(path)
        try:
            doc = json.loads((self.path / "golden.json").read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError) as e:
            raise ValidationInputError(f"golden {self.path}: golden.json unreadable ({e})") from None
        if not isinstance(doc, dict) or doc.get("format") != FORMAT:
            raise ValidationInputError(f"golden {self.path}: not an adapt golden directory (format {FORMAT!r})")
        try:
            self.tensors = load_file(str(self.path / doc.get("tensors", "tensors.safetensors")))
        except (OSError, SafetensorError) as e:
            raise ValidationInputError(f"golden {self.path}: tensors unreadable ({e})") from None
        self.doc = doc
        self.num_layers = int(doc["num_layers"])
        self.vocab_size = int(doc["vocab_size"])
        self.max_position_embeddings = int(doc.get("max_position_embeddings") or 0)
        self.prompts = [list(map(int, p)) for p in doc["prompts"]]
        st = doc.get("streamed")
        self.streamed = streamed_summary(st) if isinstance(st, dict) else None
        self.source = str(doc.get("source") or "transformers")
        self.endpoint = doc.get("endpoint") if self.source == "endpoint" else None  # golden_endpoint.py
        self.has_logits = "logits.0" in self.tensors
        self.has_layers = any(k.startswith("layers.") for k in self.tensors)
        via = (", layer-streamed reference" if self.streamed else
               f", recorded from endpoint {(self.endpoint or {}).get('url', '?')}" if self.endpoint is not None else "")
        self.description = f"golden {self.path} (of {doc.get('model', '?')}{via})"

    def _missing(self, what: str) -> Skip:
        src = f"recorded from an endpoint ({(self.endpoint or {}).get('url', '?')})" if self.endpoint is not None \
            else "dumped without them"
        return Skip(f"needs the reference's {what}; the golden {self.path} was {src} and holds top-N logprobs only")

    def logits(self, i: int) -> torch.Tensor:
        t = self.tensors.get(f"logits.{i}")
        if t is None:
            raise self._missing("prefill logits")
        return t

    def prompt_top(self, i: int) -> list[dict[int, float]] | None:
        """Top-N logprobs per row of the prefill logits (rows 0..T-2), when the golden holds them instead of
        logits (an endpoint golden); else None."""
        ids, vals = self.tensors.get(f"prompt_top.{i}.ids"), self.tensors.get(f"prompt_top.{i}.logprobs")
        if ids is None or vals is None:
            return None
        return [{int(t): float(v) for t, v in zip(r, q) if t >= 0} for r, q in zip(ids.tolist(), vals.tolist())]

    def generation(self, i: int, max_new_tokens: int, top_n: int) -> Generation | None:
        """The stored generation cut to the length and top-N asked; None when it stored less."""
        g = self.doc["generation"]
        if max_new_tokens > g["max_new_tokens"] or top_n > g["top_n"]:
            return None
        rec = g["prompts"][i]
        lps = [dict(sorted(((int(t), float(v)) for t, v in step), key=lambda kv: -kv[1])[:top_n])
               for step in rec["logprobs"][:max_new_tokens]]
        return Generation([int(t) for t in rec["tokens"][:max_new_tokens]], lps)

    def chat_prompt_ids(self) -> list[int] | None:
        """The reference server's rendering of ``chat.messages`` (an endpoint golden), else None."""
        ids = (self.doc.get("chat") or {}).get("prompt_token_ids")
        return [int(t) for t in ids] if isinstance(ids, list) else None

    @property
    def chat_messages(self) -> list[dict[str, Any]] | None:
        return (self.doc.get("chat") or {}).get("messages")

    def layers(self, i: int) -> dict[str, torch.Tensor]:
        if not self.has_layers:
            raise self._missing("layer outputs")
        pre = f"layers.{i}."
        return {k[len(pre):]: v for k, v in self.tensors.items() if k.startswith(pre)}

    def layer_index(self) -> torch.Tensor | None:
        return self.tensors.get("layer_index")

    def long_prompt(self, length: int) -> list[int] | None:
        t = self.tensors.get(f"long.{length}.ids")
        return t.tolist() if t is not None else None

    def long_logits(self, length: int) -> torch.Tensor | None:
        return self.tensors.get(f"long.{length}.logits")

    def long_logprobs(self, length: int) -> dict[int, float] | None:
        """The next-token top-N logprobs after the rung's prompt, where the golden holds those instead of
        logits (an endpoint golden); else None."""
        ids, vals = self.tensors.get(f"long.{length}.top_ids"), self.tensors.get(f"long.{length}.top_logprobs")
        if ids is None or vals is None:
            return None
        return {int(t): float(v) for t, v in zip(ids.tolist(), vals.tolist()) if t >= 0}

    def plain_torch(self, dtype: str):
        return None


def open_reference(path: str | Path):
    """A golden directory or an HF checkpoint directory as the reference."""
    p = Path(path)
    if not p.is_dir():
        raise ValidationInputError(f"reference {p}: not a directory (an HF checkpoint or a golden directory)")
    return GoldenReference(p) if is_golden(p) else HFReference(p)
