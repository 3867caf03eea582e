"""The layer-streamed reference: transformers' own modules in float32, one decoder layer in memory at a time.

For models no host holds (Kimi-K2: 1.03 T parameters), ``adapt validate dump --stream`` runs the same
reference as ``HFReference`` without loading the model. The transformers model is built on the meta
device; a forward runs layer-major over every prompt of a pass: each layer's attention, norms, router
and dense / shared MLP are read from the checkpoint (``stream_weights.WeightStream``), run for every
prompt, then dropped. Routed experts are read when the router first selects them, so a pass holds one
layer plus the experts its tokens touch. The prompts' own arguments to each layer (masks, rotary
embeddings, positions, KV cache) come from transformers' model forward itself, run once per pass with
the layers replaced by stubs that record their arguments: no family's forward is re-implemented, and
the results are transformers' bit for bit (the experts see a compact stack of the touched experts,
their ids remapped in order: the same GEMMs in the same order).

When a call's experts do not fit the memory budget they run in chunks, each expert as transformers'
eager experts loop computes it (index_add in ascending expert order): equal to the eager path bit for
bit and within float32 rounding of the grouped one; the record names those layers.

Passes: one prefill (all prompts, KV cache kept per prompt: bounded by the prompts' length), then one
per greedy step (one token per prompt), and one per long-context rung (logits of its last positions).
"""

from __future__ import annotations

import inspect
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

from adapt.errors import ValidationInputError
from adapt.validate.memory import available_memory, long_prefill_bytes
from adapt.validate.rss import MemoryMeter
from adapt.validate.reference import (LONG_TAIL, PROMPT_LENGTHS, _first, _quiet_transformers, fixed_prompts,
                                      long_prompt)
from adapt.validate.stream_estimate import StreamBudgetError, check_budget, fmt_bytes
from adapt.validate.stream_weights import WeightStream, is_experts
from adapt.validate.target import Generation, layer_names

_STUB_ATTRS = ("attention_type", "layer_idx", "is_sliding", "sliding_window", "use_sliding")


class _Stub(nn.Module):
    """Stands in for a decoder layer during the arguments pass: records them, returns its input."""

    def __init__(self, like: nn.Module, sink: list):
        super().__init__()
        for a in _STUB_ATTRS:
            if hasattr(like, a):
                setattr(self, a, getattr(like, a))
        self.sink = sink

    def forward(self, hidden_states, *args, **kwargs):
        self.sink.append((args, kwargs))
        return hidden_states


@dataclass
class _Item:
    """One sequence of a pass."""

    ids: list[int]
    cache: Any = None  # the prompt's KV cache (None: none, unless new_cache)
    new_cache: bool = False  # a generation's prefill: keep the KV cache transformers' forward makes
    keep: int = 0  # logits of the last ``keep`` positions; 0 = all of them
    record: bool = False  # capture the layer outputs
    hidden: torch.Tensor | None = None
    calls: list = field(default_factory=list)
    outputs: dict = field(default_factory=dict)
    logits: torch.Tensor | None = None


# model types transformers does not know whose checkpoints name an architecture it does (Kimi-K2 ships remote code
# for DeepseekV3ForCausalLM): read as that architecture's config, never running the checkpoint's code
_ALIASES = {"kimi_k2": "deepseek_v3"}


def _hf_config(path: Path):
    import transformers

    from adapt.source import read_config

    raw = read_config(path / "config.json")
    alias = _ALIASES.get(raw.get("model_type"))
    if alias is None or raw.get("model_type") in transformers.models.auto.configuration_auto.CONFIG_MAPPING_NAMES:
        return transformers.AutoConfig.from_pretrained(path)
    kw = {k: v for k, v in raw.items() if k not in ("model_type", "auto_map", "transformers_version")}
    return transformers.AutoConfig.for_model(alias, **kw)


class StreamedModel:
    """A checkpoint run layer by layer by transformers' modules; every pass re-reads what it needs."""

    def __init__(self, path: str | Path, memory_budget: int | None = None):
        import transformers

        from adapt.layout import WeightLayout
        from adapt.source import read_config
        from adapt.spec import ModelSpec

        _quiet_transformers()
        self.path = Path(path)
        if not (self.path / "config.json").is_file():
            raise ValidationInputError(f"reference {self.path}: no config.json (an HF checkpoint directory)")
        spec = ModelSpec.from_hf_config(read_config(self.path / "config.json"), name=self.path.name)
        if spec.vision is not None:
            raise ValidationInputError(f"{spec.model_type}: the streamed reference covers the text families")
        self.spec = spec
        self.budget = memory_budget
        check_budget(spec, memory_budget)  # before anything is read
        self.w = WeightStream(self.path, spec, WeightLayout.from_spec(spec))
        config = _hf_config(self.path)
        try:
            with torch.device("meta"):
                model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        except (OSError, ValueError) as e:
            raise ValidationInputError(f"reference {self.path}: transformers cannot build it ({e})") from None
        self.model = model.eval()
        self.config = model.config
        self.base = model.get_decoder() if hasattr(model, "get_decoder") else model.model
        self.base.rotary_emb = type(self.base.rotary_emb)(config=self.base.config)  # its buffers, on the CPU
        self.layers = list(self.base.layers)
        self.num_layers = len(self.layers)
        self.vocab_size = int(spec.vocab_size)
        self.max_position_embeddings = int(spec.max_position_embeddings or 0)
        self.resident = self.w.load(self.base.norm, "model.norm")
        self.held = self.resident
        self.peak_held = self.held
        self.experts_used: dict[int, set[int]] = {}
        self.chunked_layers: set[int] = set()
        self.layer_bytes_read: dict[str, int] = {}
        self.passes = 0
        params = inspect.signature(self.base.forward).parameters
        self._cache_kw = "cache" if "cache" in params else "past_key_values"
        self._expert_cache: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    # ------------------------------------------------------------------------------------------ memory

    def _hold(self, nbytes: int) -> None:
        self.held += nbytes
        self.peak_held = max(self.peak_held, self.held)

    def _check(self, need: int, what: str) -> None:
        if self.budget is not None and self.held + need > self.budget:
            raise StreamBudgetError(f"{what} needs {fmt_bytes(need)} of float32 weights beside "
                                    f"{fmt_bytes(self.held)} held; --memory-budget {fmt_bytes(self.budget)} "
                                    f"cannot hold it")

    # ------------------------------------------------------------------------------------------ experts

    def _experts_forward(self, mod: nn.Module, layer: int):
        """Replacement forward of a fused-experts module: load the touched experts, run transformers' own."""
        cls_forward = type(mod).forward
        total = int(mod.num_experts)
        shape_gu, shape_d = tuple(mod.gate_up_proj.shape[1:]), tuple(mod.down_proj.shape[1:])
        per_expert = (shape_gu[0] * shape_gu[1] + shape_d[0] * shape_d[1]) * 4

        def forward(hidden_states, top_k_index, top_k_weights):
            ids = [int(e) for e in torch.unique(top_k_index) if 0 <= int(e) < total]
            used = self.experts_used.setdefault(layer, set())
            used.update(ids)
            missing = [e for e in ids if e not in self._expert_cache]
            fits = self.budget is None or self.held + (len(missing) + len(ids)) * per_expert <= self.budget
            if not fits:
                return self._chunked(mod, layer, hidden_states, top_k_index, top_k_weights, ids, per_expert)
            for e in missing:
                self._expert_cache[e] = self.w.expert(layer, e)
                self._hold(per_expert)
            gate_up = torch.stack([self._expert_cache[e][0] for e in ids])  # [k, 2I, H]
            down = torch.stack([self._expert_cache[e][1] for e in ids])  # [k, H, I]
            self._hold(len(ids) * per_expert)
            remap = torch.full((total + 1,), len(ids), dtype=top_k_index.dtype)
            remap[torch.tensor(ids, dtype=torch.long)] = torch.arange(len(ids), dtype=top_k_index.dtype)
            mod._parameters["gate_up_proj"] = nn.Parameter(gate_up, requires_grad=False)
            mod._parameters["down_proj"] = nn.Parameter(down, requires_grad=False)
            mod.num_experts = len(ids)
            try:
                return cls_forward(mod, hidden_states, remap[top_k_index], top_k_weights)
            finally:
                mod.num_experts = total
                mod._parameters["gate_up_proj"] = nn.Parameter(torch.empty((total, *shape_gu), device="meta"),
                                                               requires_grad=False)
                mod._parameters["down_proj"] = nn.Parameter(torch.empty((total, *shape_d), device="meta"),
                                                            requires_grad=False)
                self.held -= len(ids) * per_expert

        return forward

    def _chunked(self, mod, layer, hidden_states, top_k_index, top_k_weights, ids, per_expert):
        """transformers' eager experts loop over the touched experts, loading as many at a time as fit."""
        self.chunked_layers.add(layer)
        self._drop_experts()
        room = (self.budget - self.held) // per_expert if self.budget is not None else len(ids)
        if room < 1:
            self._check(per_expert, f"layer {layer}: one routed expert")
        out = torch.zeros_like(hidden_states)
        for c in range(0, len(ids), room):
            chunk = {e: self.w.expert(layer, e) for e in ids[c:c + room]}
            self._hold(len(chunk) * per_expert)
            for e, (gate_up, down) in chunk.items():
                top_k_pos, token_idx = torch.where(top_k_index.t() == e)  # eager's order: slot, then token
                gate, up = nn.functional.linear(hidden_states[token_idx], gate_up).chunk(2, dim=-1)
                h = nn.functional.linear(mod.act_fn(gate) * up, down)
                h = h * top_k_weights[token_idx, top_k_pos, None]
                out.index_add_(0, token_idx, h.to(out.dtype))
            self.held -= len(chunk) * per_expert
        return out

    def _drop_experts(self) -> None:
        sizes = sum(g.numel() * 4 + d.numel() * 4 for g, d in self._expert_cache.values())
        self._expert_cache.clear()
        self.held -= sizes

    # ------------------------------------------------------------------------------------------ passes

    def _embed(self, items: list[_Item]) -> None:
        name = self.w.checkpoint_name("model.embed_tokens.weight")
        rows = self.w.rows(name, [t for it in items for t in it.ids])
        self._hold(sum(r.numel() * 4 for r in rows.values()))
        for it in items:
            it.hidden = torch.stack([rows[t] for t in it.ids]).unsqueeze(0)  # [1, T, H]
            if it.record:
                it.outputs["embedding"] = it.hidden[0].clone()
        self.held -= sum(r.numel() * 4 for r in rows.values())

    def _arguments(self, it: _Item) -> None:
        """Run transformers' model forward with stub layers: each layer's arguments for this sequence."""
        sinks: list[list] = [[] for _ in self.layers]
        real = self.base.layers
        self.base.layers = nn.ModuleList(_Stub(layer, s) for layer, s in zip(self.layers, sinks))
        try:
            kw = {self._cache_kw: it.cache} if it.cache is not None else {}
            self.base(inputs_embeds=it.hidden, use_cache=it.cache is not None or it.new_cache, **kw)
        finally:
            self.base.layers = real
        it.calls = [s[0] for s in sinks]
        if it.new_cache:
            it.cache = it.calls[0][1].get(self._cache_kw)
            it.new_cache = False

    def _hooks(self, it: _Item, i: int, layer: nn.Module) -> list:
        mods = [(f"layers.{i}.input_norm", layer.input_layernorm), (f"layers.{i}.attention", layer.self_attn),
                (f"layers.{i}.post_attention_norm", layer.post_attention_layernorm),
                (f"layers.{i}.mlp", layer.mlp), (f"layers.{i}", layer)]

        def hook(name):
            def fn(_mod, _inp, out):
                it.outputs[name] = _first(out)[0].float().clone()
            return fn

        return [m.register_forward_hook(hook(n)) for n, m in mods]

    @torch.inference_mode()
    def run(self, items: list[_Item]) -> None:
        """One layer-major pass over ``items``: logits (and layer outputs where asked) into each item."""
        self.passes += 1
        self._embed(items)
        for it in items:
            self._arguments(it)
        for i, layer in enumerate(self.layers):
            prefix = f"model.layers.{i}"
            before = self.w.bytes_read
            self._check(self.w.module_bytes(layer, prefix), f"layer {i}")
            self._hold(self.w.load(layer, prefix))
            experts = [m for m in layer.modules() if is_experts(m)]
            for m in experts:
                m.forward = self._experts_forward(m, i)
            try:
                for it in items:
                    handles = self._hooks(it, i, layer) if it.record else []
                    try:
                        args, kwargs = it.calls[i]
                        it.hidden = _first(layer(it.hidden, *args, **kwargs))
                    finally:
                        for h in handles:
                            h.remove()
            finally:
                for m in experts:
                    del m.forward
                self._drop_experts()
                held = self.w.module_bytes(layer, prefix)
                self.w.unload(layer)
                self.held -= held
            self.layer_bytes_read[str(i)] = self.layer_bytes_read.get(str(i), 0) + self.w.bytes_read - before
        self._head(items)

    def _head(self, items: list[_Item]) -> None:
        head = self.model.get_output_embeddings()
        self._check(self.w.module_bytes(head, "lm_head"), "lm_head")
        before = self.w.bytes_read
        self._hold(self.w.load(head, "lm_head"))
        try:
            for it in items:
                h = self.base.norm(it.hidden)
                if it.record:
                    it.outputs["final_norm"] = h[0].float().clone()
                sl = slice(-it.keep, None) if it.keep > 0 else slice(0, None)
                it.logits = head(h[:, sl, :])[0].float()
                it.hidden = None
        finally:
            held = self.w.module_bytes(head, "lm_head")
            self.w.unload(head)
            self.held -= held
        self.layer_bytes_read["lm_head"] = self.layer_bytes_read.get("lm_head", 0) + self.w.bytes_read - before


class StreamedReference:
    """The streamed model as a reference (same questions as ``HFReference``), computed in few passes:
    the prefill and greedy continuation of every prompt at the first question, a long rung when asked."""

    kind = "streamed"

    def __init__(self, path: str | Path, max_new_tokens: int = 16, top_n: int = 20,
                 memory_budget: int | None = None, prompt_lengths=PROMPT_LENGTHS):
        self.meter = MemoryMeter()
        self.meter.reset_peak()
        self.path = Path(path)
        self.model = StreamedModel(path, memory_budget)
        self.config = self.model.config
        self.num_layers = self.model.num_layers
        self.vocab_size = self.model.vocab_size
        self.max_position_embeddings = self.model.max_position_embeddings
        self.prompts = fixed_prompts(self.vocab_size, prompt_lengths)
        self.max_new_tokens, self.top_n = max_new_tokens, top_n
        self.description = f"transformers float32 cpu, layer-streamed: {self.path}"
        self._results: list[tuple[torch.Tensor, dict, Generation]] | None = None
        self._long: dict[int, torch.Tensor] = {}
        self.seconds = 0.0

    def _compute(self) -> None:
        t0 = time.perf_counter()
        items = [_Item(list(p), new_cache=True, record=True) for p in self.prompts]
        self.model.run(items)
        logits = [it.logits for it in items]
        layers = [{n: it.outputs[n] for n in layer_names(self.num_layers) if n in it.outputs} for it in items]
        gens = [Generation([], []) for _ in items]
        last = [lg[-1] for lg in logits]
        for step in range(self.max_new_tokens):
            toks = []
            for p, row in enumerate(last):
                lp = torch.log_softmax(row.double(), dim=-1)  # [V]
                top = lp.topk(min(self.top_n, lp.numel()))
                tok = int(lp.argmax())
                gens[p].tokens.append(tok)
                gens[p].logprobs.append({int(i): float(v) for v, i in zip(top.values, top.indices)})
                toks.append(tok)
            if step + 1 < self.max_new_tokens:
                steps = [_Item([t], cache=it.cache) for t, it in zip(toks, items)]
                self.model.run(steps)
                last = [s.logits[-1] for s in steps]
        for it in items:
            it.cache = None
        self._results = list(zip(logits, layers, gens))
        self.seconds += time.perf_counter() - t0

    def _get(self, i: int):
        if self._results is None:
            self._compute()
        return self._results[i]

    def logits(self, i: int) -> torch.Tensor:
        return self._get(i)[0]

    def layers(self, i: int) -> dict[str, torch.Tensor]:
        return self._get(i)[1]

    def generation(self, i: int, max_new_tokens: int, top_n: int) -> Generation | None:
        if max_new_tokens > self.max_new_tokens or top_n > self.top_n:
            return None
        g = self._get(i)[2]
        lps = [dict(sorted(d.items(), key=lambda kv: -kv[1])[:top_n]) for d in g.logprobs[:max_new_tokens]]
        return Generation(g.tokens[:max_new_tokens], lps)

    def layer_index(self) -> torch.Tensor | None:
        return None

    def long_prompt(self, length: int) -> list[int]:
        return long_prompt(self.vocab_size, length)

    def long_rung_too_big(self, length: int, budget: float | None = None) -> str | None:
        """As ``HFReference.long_rung_too_big``: the same transformers attention holds every head's L x L scores."""
        need = long_prefill_bytes(self.config, length)
        budget = 0.8 * available_memory() if budget is None else budget
        if need <= budget:
            return None
        return f"the reference needs ~{need / 1e9:.1f} GB for its attention scores > {budget / 1e9:.1f} GB free"

    def long_logits(self, length: int) -> torch.Tensor | None:
        if length not in self._long:
            t0 = time.perf_counter()
            it = _Item(self.long_prompt(length), keep=LONG_TAIL)
            self.model.run([it])
            self._long[length] = it.logits
            self.seconds += time.perf_counter() - t0
        return self._long[length]

    def plain_torch(self, dtype: str):
        return None

    def record(self) -> dict[str, Any]:
        """What the stream read and held: golden.json's ``streamed`` section (memory measured, not assumed)."""
        m, w = self.model, self.model.w
        return {
            "memory_budget": m.budget, "bytes_read": w.bytes_read, "tensors_read": w.tensors_read,
            "passes": m.passes, "seconds": round(self.seconds, 3),
            "peak_weight_bytes": m.peak_held, "rss": self.meter.as_dict(),
            "experts_per_layer": {str(i): sorted(s) for i, s in sorted(m.experts_used.items())},
            "experts_chunked_layers": sorted(m.chunked_layers),
            "bytes_read_per_layer": m.layer_bytes_read,
        }
