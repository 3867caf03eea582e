"""Deterministic tiny checkpoints of the built-in configs, in HF layout, for demos, tests and day0.

``init_model(name, out_dir)`` writes config.json, generation_config.json, model.safetensors (every
tensor of the WeightLayout, each drawn from its own generator seeded by the tensor's name, so the bytes
never depend on order or platform), tokenizer.json and tokenizer_config.json with a ChatML template.
Scales: linears and embeddings N(0, 0.02); norms 1 + U(-0.1, 0.1); routers N(0, 0.1) so that routing
is spread; DeepSeek's correction bias N(0, 0.1). transformers' AutoModelForCausalLM loads the result.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import tempfile
import zlib
from pathlib import Path

import torch
from safetensors.torch import save_file

from adapt.builtin import BUILTIN_CONFIGS, BUILTIN_IMAGE_TOKENS, BUILTIN_PROCESSORS, builtin_config
from adapt.errors import AdaptError, ModelNotFoundError
from adapt.fileio import cache_root
from adapt.layout import TensorSpec, WeightLayout
from adapt.runtime.tiny_tokenizer import build_tiny_tokenizer
from adapt.spec import ModelSpec

FILES = ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")


_VISION_NORMS = ("norm.weight", "norm1.weight", "norm2.weight", "layernorm.weight", "layrnorm.weight", "ln_q.weight",
                 "layer_norm1.weight", "layer_norm2.weight")


def _tensor(t: TensorSpec, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed((zlib.crc32(t.name.encode()) + seed * 1_000_003) % 2**63)
    if t.role.endswith("norm") or t.role in ("norm", "q_norm", "k_norm") or (
            t.role in ("vision", "projector") and t.name.endswith(_VISION_NORMS)):
        return 1.0 + (torch.rand(t.shape, generator=g) - 0.5) * 0.2
    if t.role == "router":
        return torch.randn(t.shape, generator=g) * 0.1
    if t.role == "router_bias":
        return torch.randn(t.shape, generator=g) * 0.1
    if t.role.endswith("_bias"):
        return torch.randn(t.shape, generator=g) * 0.02
    return torch.randn(t.shape, generator=g) * 0.02


def init_model(name: str, out_dir: str | Path, seed: int = 0) -> Path:
    """Write the built-in model ``name`` to ``out_dir``; returns the directory. The files are written into a
    temporary directory beside it first, so a killed run leaves no partial checkpoint under the name."""
    cfg = builtin_config(name)
    if cfg is None:
        raise ModelNotFoundError(f"unknown built-in model {name!r}; choose one of {', '.join(BUILTIN_CONFIGS)}")
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise AdaptError(f"{out} exists and is not a directory")
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".tmp", dir=out.parent))
    except OSError as e:
        raise AdaptError(f"cannot write {out}: {e.strerror}") from e
    try:
        _write(cfg, name, tmp, seed)
        try:
            os.replace(tmp, out)  # a new or empty directory: one rename
        except OSError as e:
            if e.errno not in (errno.ENOTEMPTY, errno.EEXIST):
                raise
            for f in sorted(tmp.iterdir()):  # a directory with files (a rewrite): file by file
                os.replace(f, out / f.name)
    except OSError as e:
        raise AdaptError(f"cannot write {out}: {e.strerror}") from e
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return out


def _write(cfg: dict, name: str, out: Path, seed: int) -> None:
    spec = ModelSpec.from_hf_config(cfg, name=name)
    layout = WeightLayout.from_spec(spec)
    # adapt.builtin's special ids are the tiny tokenizer's: <s> 0, </s> 1, <pad> 2
    tensors = {t.name: _tensor(t, seed).to(getattr(torch, t.dtype)).contiguous() for t in layout.main() if t.is_param}
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    text = cfg.get("text_config") or cfg  # a multimodal built-in holds its special ids in text_config
    gen = {k: text[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id")} | {"do_sample": False}
    (out / "generation_config.json").write_text(json.dumps(gen, indent=2, sort_keys=True) + "\n")
    extra = BUILTIN_IMAGE_TOKENS.get(name, ())
    build_tiny_tokenizer(out, vocab_size=spec.vocab_size - len(extra))
    if extra:  # a multimodal built-in: its image tokens, a chat template taking image parts, its image processor
        _add_image_tokens(out, extra, name)


_IMAGE_PLACEHOLDER = {"tiny-llava": "<image>", "tiny-qwen2.5-vl": "<|vision_start|><|image_pad|><|vision_end|>"}
# ChatML with content parts: an image part renders as the model's placeholder text
_VLM_CHAT = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' }}{% if m['content'] is string %}"
             "{{ m['content'] }}{% else %}{% for p in m['content'] %}{% if p['type'] in ('image', 'image_url') %}"
             "PLACEHOLDER{% elif p['type'] == 'text' %}{{ p['text'] }}{% endif %}{% endfor %}{% endif %}"
             "{{ '<|im_end|>\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")


def _add_image_tokens(out: Path, tokens: tuple[str, ...], name: str) -> None:
    from tokenizers import AddedToken, Tokenizer

    tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in tokens])
    (out / "tokenizer.json").write_text(tok.to_str(pretty=True) + "\n", encoding="utf-8")
    cfg = json.loads((out / "tokenizer_config.json").read_text())
    cfg["chat_template"] = _VLM_CHAT.replace("PLACEHOLDER", _IMAGE_PLACEHOLDER[name])
    (out / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    (out / "preprocessor_config.json").write_text(json.dumps(BUILTIN_PROCESSORS[name], indent=2, sort_keys=True) + "\n")


def builtin_checkpoint(name: str) -> Path:
    """The cached checkpoint of a built-in model, written on first use (atomically, by rename)."""
    target = cache_root() / "models" / name
    files = FILES + (("preprocessor_config.json",) if name in BUILTIN_PROCESSORS else ())
    if all((target / f).is_file() for f in files):
        return target
    init_model(name, target)  # atomic: a reader sees the files whole or not at all
    return target
