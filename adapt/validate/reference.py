"""The reference: transformers on CPU in float32 reading the reference checkpoint (DESIGN.md, Numerics).

``TransformersModel`` runs a checkpoint with transformers and implements ``target.ModelRunner``: prefill
logits, greedy tokens with top-k logprobs, and per-layer / per-sub-module outputs captured by forward
hooks on every decoder layer and on its ``input_layernorm``, ``self_attn``, ``post_attention_layernorm``
and ``mlp``. It is the reference (float32, CPU) and can be a target too (``--runtime transformers``).

``HFReference`` is the reference a validation compares against: the fixed prompts and, per prompt, the
reference's results, computed once and cached. ``golden.GoldenReference`` answers the same questions
from a directory dumped on another machine.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from adapt.errors import ValidationInputError
from adapt.validate.memory import available_memory, long_prefill_bytes
from adapt.validate.target import Generation, layer_names

_TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
PROMPT_LENGTHS = (8, 16, 24, 32)
PROMPT_SEED = 1234
LONG_TAIL = 32  # long-context rungs compare the logits of the last LONG_TAIL positions


def torch_dtype(name: str) -> torch.dtype:
    from adapt.validate.checklist import normalize_dtype

    dt = _TORCH_DTYPES.get(normalize_dtype(name))
    if dt is None:
        raise ValidationInputError(f"--dtype must be one of {', '.join(_TORCH_DTYPES)}; got {name!r}")
    return dt


def fixed_prompts(vocab_size: int, lengths: Sequence[int] = PROMPT_LENGTHS, seed: int = PROMPT_SEED) -> list[list[int]]:
    """The validation prompts as token ids: seeded, so every machine builds the same ones without a
    tokenizer (ids 3.. avoid the usual special tokens 0-2)."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab_size, (n,), generator=g).tolist() for n in lengths]


def long_prompt(vocab_size: int, length: int, seed: int = PROMPT_SEED) -> list[int]:
    """A seeded prompt of ``length`` tokens for the long-context ladder."""
    g = torch.Generator().manual_seed(seed + length)
    return torch.randint(3, vocab_size, (length,), generator=g).tolist()


def _cache_kw(out: Any) -> dict[str, Any]:
    # transformers 5 renamed past_key_values to cache; accept either spelling
    if getattr(out, "cache", None) is not None:
        return {"cache": out.cache}
    return {"past_key_values": out.past_key_values}


def _quiet_transformers() -> None:
    import transformers

    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()


def _first(out: Any) -> torch.Tensor:
    return out[0] if isinstance(out, (tuple, list)) else out


def _dequantized_model(auto: Any, path: Path, config: Any, dt: torch.dtype) -> Any:
    """transformers' model of ``config`` without its quantization_config, holding the checkpoint's weights
    dequantized by adapt (validate/dequant.py): the reference when transformers cannot load the format. The
    float weights go through a temporary directory so that transformers' own checkpoint conversions (per-expert
    tensors fused, renames) apply as for any checkpoint."""
    import tempfile

    from safetensors.torch import save_file

    from adapt.validate.dequant import dequantized_state_dict

    try:
        sd = dequantized_state_dict(path)
    except Exception as e:  # noqa: BLE001 (adapt's own errors name the tensor; anything else is reported too)
        raise ValidationInputError(f"reference {path}: transformers cannot load it quantized and dequantizing it "
                                   f"failed ({type(e).__name__}: {e})") from None
    del config.quantization_config
    with tempfile.TemporaryDirectory(prefix="adapt-dequant-") as tmp:
        save_file({k: v.contiguous() for k, v in sd.items()}, f"{tmp}/model.safetensors", metadata={"format": "pt"})
        del sd
        config.save_pretrained(tmp)
        try:
            return auto.from_pretrained(tmp, config=config, dtype=dt)
        except (OSError, ValueError) as e:
            raise ValidationInputError(f"reference {path}: transformers cannot load its dequantized weights ({e})"
                                       ) from None


class TransformersModel:
    """A checkpoint run by transformers (implements ``target.ModelRunner``)."""

    def __init__(self, model: Any, name: str, device: str, dtype: torch.dtype, stages: dict[str, float]):
        self.model = model
        self.name = name
        self.device = device
        self.dtype = dtype
        self.stages = stages
        cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
        self.num_layers = int(cfg.num_hidden_layers)
        self.vocab_size = int(cfg.vocab_size)
        self.max_position_embeddings = int(getattr(cfg, "max_position_embeddings", 0) or 0)
        self.dequantized_because: str | None = None  # set when a quantized checkpoint was dequantized at load

    @classmethod
    def load(cls, path: str | Path, device: str = "cpu", dtype: str = "float32") -> TransformersModel:
        """Load an HF directory with AutoModelForCausalLM; records config / weights timings."""
        import transformers

        _quiet_transformers()
        p = Path(path)
        if not (p / "config.json").is_file():
            raise ValidationInputError(f"reference {p}: no config.json (an HF checkpoint directory is needed)")
        dt = torch_dtype(dtype)
        stages: dict[str, float] = {}
        t0 = time.perf_counter()
        config = transformers.AutoConfig.from_pretrained(p)
        stages["config"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        auto = (transformers.AutoModelForImageTextToText if getattr(config, "vision_config", None) is not None
                else transformers.AutoModelForCausalLM)  # llava, Qwen2.5-VL: the whole multimodal model
        why_dequantized = None
        try:
            model = auto.from_pretrained(p, config=config, dtype=dt)
        except Exception as e:  # noqa: BLE001 (a quantized format's loader may raise anything; see below)
            if getattr(config, "quantization_config", None) is None:
                if isinstance(e, (OSError, ValueError)):
                    raise ValidationInputError(f"reference {p}: transformers cannot load it ({e})") from None
                raise
            why_dequantized = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}".strip()
            model = _dequantized_model(auto, p, config, dt)
        model = model.to(device).eval()
        stages["weights"] = time.perf_counter() - t0
        out = cls(model, p.name, device, dt, stages)
        out.dequantized_because = why_dequantized
        return out

    # ------------------------------------------------------------------------------------------ runs

    def _ids(self, ids: Sequence[int]) -> torch.Tensor:
        return torch.tensor([list(ids)], dtype=torch.long, device=self.device)

    @torch.inference_mode()
    def prefill_logits(self, ids: Sequence[int]) -> torch.Tensor:
        return self.model(self._ids(ids), use_cache=False).logits[0].float().cpu()  # [T, V]

    @torch.inference_mode()
    def tail_logits(self, ids: Sequence[int], tail: int = LONG_TAIL) -> torch.Tensor:
        """Logits [tail, V] of the last positions only (long prompts: the lm_head over all is waste)."""
        out = self.model(self._ids(ids), use_cache=False, logits_to_keep=tail)
        return out.logits[0, -tail:].float().cpu()

    @torch.inference_mode()
    def generate_greedy(self, ids: Sequence[int], max_new_tokens: int, top_n: int = 5) -> Generation:
        tokens: list[int] = []
        logprobs: list[dict[int, float]] = []
        out = self.model(self._ids(ids), use_cache=True)
        for step in range(max_new_tokens):
            lp = torch.log_softmax(out.logits[0, -1].double(), dim=-1)  # [V]
            top = lp.topk(min(top_n, lp.numel()))
            tok = int(lp.argmax())
            tokens.append(tok)
            logprobs.append({int(i): float(v) for v, i in zip(top.values, top.indices)})
            if step + 1 < max_new_tokens:
                out = self.model(self._ids([tok]), use_cache=True, **_cache_kw(out))
        return Generation(tokens, logprobs)

    def _modules(self) -> list[tuple[str, torch.nn.Module]]:
        base = self.model.get_decoder() if hasattr(self.model, "get_decoder") else self.model.model
        mods: list[tuple[str, torch.nn.Module]] = [("embedding", base.embed_tokens)]
        for i, layer in enumerate(base.layers):
            mods += [(f"layers.{i}.input_norm", layer.input_layernorm), (f"layers.{i}.attention", layer.self_attn),
                     (f"layers.{i}.post_attention_norm", layer.post_attention_layernorm),
                     (f"layers.{i}.mlp", layer.mlp), (f"layers.{i}", layer)]
        return mods + [("final_norm", base.norm)]

    @torch.inference_mode()
    def layer_outputs(self, ids: Sequence[int]) -> dict[str, torch.Tensor]:
        got: dict[str, torch.Tensor] = {}

        def hook(name: str):
            def fn(_mod, _inp, out):
                got[name] = _first(out)[0].float().cpu()  # [T, H]
            return fn

        handles = [m.register_forward_hook(hook(n)) for n, m in self._modules()]
        try:
            self.model(self._ids(ids), use_cache=False)
        finally:
            for h in handles:
                h.remove()
        return {n: got[n] for n in layer_names(self.num_layers) if n in got}


class HFReference:
    """The reference run live: transformers, CPU, float32 on REF; every answer computed once."""

    kind = "transformers"

    def __init__(self, path: str | Path, prompt_lengths: Sequence[int] = PROMPT_LENGTHS):
        self.path = Path(path)
        self.model = TransformersModel.load(self.path, "cpu", "float32")
        self.config = self.model.model.config
        self.num_layers = self.model.num_layers
        self.vocab_size = self.model.vocab_size
        self.max_position_embeddings = self.model.max_position_embeddings
        self.prompts = fixed_prompts(self.vocab_size, prompt_lengths)
        self._cache: dict[tuple, Any] = {}
        self.description = f"transformers float32 cpu: {self.path}"
        self.dequantized_because = self.model.dequantized_because
        if self.dequantized_because:
            self.description += (" (dequantized at load by adapt: transformers could not load the quantized "
                                 f"checkpoint, {self.dequantized_because})")

    def _memo(self, key: tuple, fn):
        if key not in self._cache:
            self._cache[key] = fn()
        return self._cache[key]

    def long_rung_too_big(self, length: int, budget: float | None = None) -> str | None:
        """Why a ``length``-token prefill would not fit ``budget`` bytes (default 80% of the memory free now), or
        None: transformers' CPU attention holds every head's L x L scores at once."""
        need = long_prefill_bytes(self.model.model.config, length)
        budget = 0.8 * available_memory() if budget is None else budget
        if need <= budget:
            return None
        return f"the reference needs ~{need / 1e9:.1f} GB for its attention scores > {budget / 1e9:.1f} GB free"

    def logits(self, i: int) -> torch.Tensor:
        return self._memo(("logits", i), lambda: self.model.prefill_logits(self.prompts[i]))

    def generation(self, i: int, max_new_tokens: int, top_n: int) -> Generation | None:
        return self._memo(("gen", i, max_new_tokens, top_n),
                          lambda: self.model.generate_greedy(self.prompts[i], max_new_tokens, top_n))

    def layers(self, i: int) -> dict[str, torch.Tensor]:
        return self._memo(("layers", i), lambda: self.model.layer_outputs(self.prompts[i]))

    def layer_index(self) -> torch.Tensor | None:
        """Hidden-dim indices the stored layer outputs keep (None: all of them)."""
        return None

    def long_prompt(self, length: int) -> list[int]:
        return long_prompt(self.vocab_size, length)

    def long_logits(self, length: int) -> torch.Tensor | None:
        return self._memo(("long", length), lambda: self.model.tail_logits(self.long_prompt(length)))

    def plain_torch(self, dtype: str) -> TransformersModel:
        """transformers at ``dtype`` on CPU: the "plain torch in the same precision" of the 2x rule."""
        return self._memo(("plain", dtype), lambda: TransformersModel.load(self.path, "cpu", dtype))
