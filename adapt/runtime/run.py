"""The core of ``adapt run`` as a library function, callable per rank by the distributed launcher."""

from __future__ import annotations

import time
from pathlib import Path

from adapt.errors import RuntimeConfigError
from adapt.runtime.engine import Engine
from adapt.runtime.parallel import SINGLE, ParallelContext
from adapt.runtime.sampling import SamplingParams
from adapt.runtime.vision.processor import expand_placeholders, preprocess, split_images


def preprocess_images(eng: Engine, sources: list[str], allow_remote: bool = False) -> list:
    """Each image source loaded (vision/inputs.py) and preprocessed by the checkpoint's processor."""
    if not sources:
        return []
    from adapt.runtime.vision.inputs import ImageLimits

    proc = eng.image_processor()
    limits = ImageLimits(allow_remote=allow_remote)
    return [preprocess(proc, src, limits) for src in sources]


def run_generation(model: str | Path, prompts: list[str] | None = None, prompt_ids: list[list[int]] | None = None,
                   *, chat: bool = False, max_tokens: int = 32, temperature: float = 0.0, top_k: int | None = None,
                   top_p: float = 1.0, seed: int | None = None, stop: list[str] | None = None,
                   ignore_eos: bool = False, device: str = "cpu", dtype: str = "float32", kernels: str = "auto",
                   kv_cache_memory: str | None = None, kv_cache_dtype: str = "auto", prepack: str = "auto",
                   ctx: ParallelContext = SINGLE, engine: Engine | None = None, images: list[str] | None = None,
                   allow_remote_images: bool = False, weights_dtype: str = "auto") -> dict:
    """Load MODEL (unless ``engine`` is given), run all prompts as one batch, return the JSON document
    ``{"outputs": [{"prompt_token_ids", "token_ids", "text", "finish_reason"}], "stats": {...}}``.

    ``prompts`` are text (tokenized with the checkpoint's tokenizer.json; ``chat`` wraps each as a user
    message through the chat template); ``prompt_ids`` bypass the tokenizer. Both may be given.
    ``images`` (paths, data: URLs, http(s) URLs when ``allow_remote_images``) go to the prompts' image
    placeholders in order (vision/processor.py); with ``chat`` they are content parts of the one prompt.
    """
    if not prompts and not prompt_ids:
        raise RuntimeConfigError("give at least one --prompt or --prompt-ids")
    t0 = time.perf_counter()
    eng = engine or Engine.from_pretrained(model, device=device, dtype=dtype, kernels=kernels, ctx=ctx,
                                           kv_cache_memory=kv_cache_memory, kv_cache_dtype=kv_cache_dtype,
                                           prepack=prepack, weights_dtype=weights_dtype)
    load_s = time.perf_counter() - t0
    ids: list[list[int]] = []
    pre = preprocess_images(eng, images or [], allow_remote_images)
    if chat and pre and (len(prompts or []) != 1 or prompt_ids):
        raise RuntimeConfigError("--chat with --image takes exactly one --prompt (its images are its content parts)")
    if prompts:
        tok = eng.tokenizer
        if tok is None:
            raise RuntimeConfigError(f"{eng.path} has no tokenizer (tokenizer.json or tiktoken.model): pass --prompt-ids instead of --prompt")
        for p in prompts:
            content = [{"type": "image"} for _ in pre] + [{"type": "text", "text": p}] if pre else p
            ids.append(tok.encode_chat([{"role": "user", "content": content}]) if chat else tok.encode(p))
    ids.extend(prompt_ids or [])
    per_prompt = [[] for _ in ids]
    if eng.spec.vision is not None:
        tid = eng.spec.vision.image_token_id
        per_prompt = split_images(ids, pre, tid)
        ids = [expand_placeholders(p, im, tid) for p, im in zip(ids, per_prompt)]
    if stop and eng.tokenizer is None:
        raise RuntimeConfigError("--stop needs a tokenizer (the checkpoint has neither tokenizer.json nor tiktoken.model)")
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, seed=seed, max_tokens=max_tokens,
                            stop=tuple(stop or ()), ignore_eos=ignore_eos)
    results = eng.generate(ids, params, images=per_prompt)
    stats = dict(eng.last_stats, model=str(eng.path), model_type=eng.spec.model_type, device=str(eng.device),
                 dtype=str(eng.dtype).replace("torch.", ""), load_s=round(load_s, 4),
                 num_prompts=len(ids))
    outputs = [{"prompt_token_ids": r.prompt_token_ids, "token_ids": r.token_ids, "text": r.text,
                "finish_reason": r.finish_reason} for r in results]
    return {"outputs": outputs, "stats": stats}
