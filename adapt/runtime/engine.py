"""The inference engine: load a model, then generate for a batch of prompts over a paged KV cache.

Library API (``adapt run`` is a thin layer over it)::

    eng = Engine.from_pretrained("tiny-k2" | CHECKPOINT_DIR | SHARD_DIR, device="cpu", dtype="float32")
    results = eng.generate([[1, 2, 3], [1, 5]], SamplingParams(temperature=0, max_tokens=32))
    results[0].token_ids, results[0].text, eng.last_stats
    logits = eng.prefill_logits([1, 2, 3])                     # [T, V] float32, no cache involved
    out = eng.prefill([1, 2, 3], return_hidden_states=True)   # out.logits, out.hidden_states[name]

``hidden_states`` names are listed in adapt/runtime/models/decoder.py (embed, layers.{i}.input_norm,
layers.{i}.attn, layers.{i}.post_attn_norm, layers.{i}.router_logits, layers.{i}.mlp, layers.{i}, norm).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from adapt.errors import ImageInputError, RuntimeConfigError
from adapt.layout import WeightLayout
from adapt.runtime.cache.block_manager import BlockManager
from adapt.runtime.cache.kv_pool import KVCacheSpec, KVPool, available_memory_bytes
from adapt.runtime.host_memory import huge_pages_status, tune_malloc
from adapt.runtime import cpu_kernels
from adapt.plan import tensor_slice
from adapt.runtime.backends import prepare_weights, select_kernels
from adapt.runtime.loader import load_weights, materialize
from adapt.runtime.backends.cpu_layouts import experts_form, linears_form, routers_form
from adapt.runtime.model_runner import ModelRunner, prefill_tiles
from adapt.runtime.models.batch import ForwardBatch
from adapt.runtime.models.registry import model_class
from adapt.runtime.parallel import SINGLE, ParallelContext
from adapt.runtime.sampling import SamplingParams, make_generator, sample
from adapt.runtime.scheduler import Scheduler, Sequence
from adapt.runtime.vision.processor import ImageProcessor
from adapt.runtime.vision.request import make_request, step_inputs
from adapt.runtime.tactics import STRATEGIES, STRATEGY_ENV
from adapt.runtime.checkpoint import open_model
from adapt.spec import ModelSpec
from adapt.units import parse_bytes, size_number

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
          "fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
DEFAULT_CPU_KV_BYTES = 512 << 20  # on CPU the default budget is capped: free RAM is shared with the weights


def parse_memory(value: str | int | float | None) -> tuple[int | None, float | None]:
    """'2GiB' / '512MiB' / '1000000' -> (bytes, None); '0.5' (a number <= 1) -> (None, fraction of free)."""
    if value is None:
        return None, None
    if isinstance(value, (int, float)) and not isinstance(value, bool) and 0 < value <= 1:
        return None, float(value)
    got = size_number(value)
    if got is None or (got[1] and parse_bytes(value) is None):
        raise RuntimeConfigError(f"--kv-cache-memory: cannot parse {value!r}; give bytes (e.g. 2GiB, 512MiB, "
                                 "1000000) or a fraction of free memory in (0, 1]")
    if not got[1] and got[0] <= 1:
        return None, got[0]
    return parse_bytes(value), None


def resolve_dtype(name: str | torch.dtype) -> torch.dtype:
    if isinstance(name, torch.dtype):
        return name
    if name not in DTYPES:
        raise RuntimeConfigError(f"--dtype must be one of float32, bfloat16, float16; got {name!r}")
    return DTYPES[name]


def resolve_device(name: str | torch.device, dtype: torch.dtype) -> torch.device:
    """The torch device, checked to exist and to compute in dtype; one-line errors otherwise."""
    try:
        dev = torch.device(name)
    except (RuntimeError, TypeError) as e:
        raise RuntimeConfigError(f"--device {name!r} is not a torch device string ({e})") from None
    try:
        a = torch.ones(4, 4, dtype=dtype, device=dev)
        (a @ a).sum().item()
    except (RuntimeError, AssertionError, AttributeError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise RuntimeConfigError(f"device {str(dev)!r} cannot run {str(dtype).replace('torch.', '')}: {first}") from None
    return dev


@dataclass
class GenerationResult:
    """One prompt's outcome; ``text`` is None without a tokenizer."""

    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str | None
    finish_reason: str | None
    stop_reason: str | int | None = None


@dataclass
class PrefillOutput:
    logits: torch.Tensor  # [T, V] float32
    hidden_states: dict[str, torch.Tensor] = field(default_factory=dict)


class Engine:
    """A loaded model, its kernels and KV pool. Build with :meth:`from_pretrained`."""

    def __init__(self, model, spec: ModelSpec, ctx: ParallelContext, kernels, device: torch.device,
                 dtype: torch.dtype, pool: KVPool, block_size: int, tokenizer=None, eos_token_ids=(),
                 max_num_seqs: int = 256, max_num_batched_tokens: int = 8192, max_model_len: int | None = None,
                 path: Path | None = None, enable_prefix_caching: bool = False, enable_chunked_prefill: bool = False):
        self.model, self.spec, self.ctx, self.kernels = model, spec, ctx, kernels
        self.device, self.dtype, self.pool, self.tokenizer = device, dtype, pool, tokenizer
        # every layer windowed (Mistral v0.1): blocks that left the window go back to the pool
        windows = {spec.attention.window_of(i) for i in range(spec.num_layers)}
        window = windows.pop() if len(windows) == 1 else None
        # prefix caching reuses whole blocks, which a sliding window frees as it moves: off under a window;
        # both off for image models (their prefill places image features and M-RoPE over whole prompts)
        vision = getattr(spec, "vision", None) is not None
        self.enable_prefix_caching = enable_prefix_caching and window is None and not _windowed(spec) and not vision
        self.enable_chunked_prefill = enable_chunked_prefill and not vision
        self.block_manager = BlockManager(pool.num_blocks, block_size, window=window,
                                          prefix_caching=self.enable_prefix_caching)
        self.runner = ModelRunner(model, kernels, device, pool)
        self.eos_token_ids = tuple(eos_token_ids)
        self.max_num_seqs, self.max_num_batched_tokens = max_num_seqs, max_num_batched_tokens
        self.max_model_len = max_model_len
        self.path = path
        self.last_stats: dict = {}
        from adapt.runtime.quant.load import weights_summary

        self.weight_bytes, self.weights_held = weights_summary(model)

    @classmethod
    def from_pretrained(cls, model: str | Path, device: str | torch.device = "cpu", dtype: str | torch.dtype = "float32",
                        kernels: str = "auto", ctx: ParallelContext = SINGLE, kv_cache_memory: str | int | None = None,
                        kv_cache_dtype: str = "auto", block_size: int = 16, max_num_seqs: int = 256,
                        max_num_batched_tokens: int = 8192, max_model_len: int | None = None,
                        prepack: str = "auto", enable_prefix_caching: bool = False,
                        enable_chunked_prefill: bool = False, weights_dtype: str = "auto") -> "Engine":
        """Load a checkpoint dir, an ``adapt shard`` output dir or a built-in name for ``ctx``'s rank.

        kernels: "auto" (each op from the best backend for the device and dtype), a backend's name ("cpu",
        "triton", "torch", "reference" or a plugin's: its ops, the rest from "torch"); see adapt/runtime/backends/.

        kv_cache_memory: bytes, a size string ('2GiB') or a fraction of free memory ('0.5'); default 90% of
        free device memory (CPU: at most 512 MiB). kv_cache_dtype: 'auto' (the model dtype) or 'int8'.
        prepack: on CPU, pack linear weights once at load: 'auto' for every dtype (bfloat16 / float16 for
        oneDNN, F.linear's results bitwise; float32 in column panels for the fused kernels' FMA GEMM where
        they are built, else for oneDNN, either summing in another order, a few ulp away), and MoE experts for
        the fused tiled CPU kernel where a trial says it wins (not bitwise either); 'exact' only the
        bitwise-exact dtypes (oneDNN); 'off' never. enable_prefix_caching: reuse the KV blocks of prompt
        prefixes seen before (not for sliding-window models); enable_chunked_prefill: prefill at most
        max_num_batched_tokens tokens per step, alternating with decode steps. weights_dtype: for a quantized
        checkpoint (fp8 blocks, compressed-tensors int8 / int4), 'auto' holds its linears quantized as stored
        (runtime/quant/), 'bf16' / 'fp16' / 'fp32' dequantize every weight at load (that dtype must be ``dtype``).
        """
        if prepack not in ("auto", "exact", "off"):
            raise RuntimeConfigError(f"--prepack must be auto, exact or off; got {prepack!r}")
        tdtype = resolve_dtype(dtype)
        dev = resolve_device(device, tdtype)
        if dev.type == "cpu":
            tune_malloc()  # large temporaries reused, not page-faulted in again (host_memory.py)
        if kv_cache_dtype not in ("auto", "int8"):
            raise RuntimeConfigError(f"--kv-cache-dtype must be auto or int8; got {kv_cache_dtype!r}")
        pinned = os.environ.get(STRATEGY_ENV, "auto")
        if pinned not in ("auto",) + STRATEGIES:
            raise RuntimeConfigError(f"{STRATEGY_ENV} must be auto or one of {', '.join(STRATEGIES)}; got {pinned!r}")
        wdt = check_weights_dtype(weights_dtype, tdtype)
        k = select_kernels(kernels, dev, tdtype)  # the backends set up (the cpu one builds its C++ kernels)
        src = open_model(model, ctx)
        spec = src.spec
        layout = WeightLayout.from_spec(spec)
        with torch.device("meta"):
            net = model_class(spec)(spec, layout, ctx, k)
        if spec.quant is not None and wdt == "auto":  # linears held quantized (runtime/quant/)
            from adapt.runtime.quant.load import prepare

            def slice_of(t):
                return None if ctx.plan is None or src.presliced else tensor_slice(t, ctx.plan, ctx.rank, spec)

            # the fused CPU dequant-GEMM where the cpu backend runs ops, else the twin (dequantize + F.linear)
            prepare(net, spec, layout, slice_of, fused=dev.type == "cpu" and "cpu" in set(k.backends.values()))
        materialize(net, dev, tdtype)
        load_weights(net, spec, layout, ctx, src.reader, presliced=src.presliced)
        prepare_weights(k, net, dev, tdtype, prepack=prepack)  # packing, per-device layouts (the backends')
        net.eval()
        max_len = max_model_len or spec.max_position_embeddings
        pool = _make_pool(spec, net, ctx, dev, tdtype, kv_cache_memory, kv_cache_dtype, block_size, max_len,
                          max_num_seqs)
        return cls(net, spec, ctx, k, dev, tdtype, pool, block_size, src.tokenizer, src.eos_token_ids,
                   max_num_seqs, max_num_batched_tokens, max_len, src.path, enable_prefix_caching,
                   enable_chunked_prefill)

    # -- generation -----------------------------------------------------------------------------------

    def generate(self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams] | None = None,
                 images: list[list] | None = None) -> list[GenerationResult]:
        """Generate for every prompt (token ids) as one batch; results in prompt order. ``images[i]``: prompt
        i's preprocessed images (vision.processor.ImageInput), its placeholders already expanded."""
        params = params or SamplingParams()
        plist = list(params) if isinstance(params, (list, tuple)) else [params] * len(prompts)
        if len(plist) != len(prompts):
            raise RuntimeConfigError(f"got {len(plist)} sampling params for {len(prompts)} prompts")
        detok = self.tokenizer.decode if self.tokenizer is not None else None
        sched = Scheduler(self.block_manager, max_num_seqs=self.max_num_seqs,
                          max_num_batched_tokens=self.max_num_batched_tokens, max_model_len=self.max_model_len,
                          eos_token_ids=self.eos_token_ids, detokenize=detok,
                          chunked_prefill=self.enable_chunked_prefill, prefix_caching=self.enable_prefix_caching)
        for p in prompts:
            bad = [t for t in p if not 0 <= int(t) < self.spec.vocab_size]
            if bad:
                raise RuntimeConfigError(f"token id {bad[0]} is outside the vocabulary [0, {self.spec.vocab_size})")
        images = images or [[] for _ in prompts]
        seqs = [sched.add([int(t) for t in p], sp, mm=make_request(self.spec, [int(t) for t in p], im))
                for p, sp, im in zip(prompts, plist, images)]
        gens = {s.seq_id: make_generator(sp, self.device) for s, sp in zip(seqs, plist)}
        st = dict(prefill_tokens=0, prefill_s=0.0, decode_tokens=0, decode_s=0.0, steps=0, peak_blocks=0,
                  preemptions=0)
        t_start = time.perf_counter()
        first_token_s = None
        while sched.has_unfinished:
            sb = sched.schedule()
            if sb is None:
                raise RuntimeConfigError("the scheduler cannot admit any waiting sequence (KV cache too small)")
            t0 = time.perf_counter()
            logits = self.runner.step(sb)
            done = [sb.seqs[i] for i in sb.sampled]  # the rest are mid-prefill (chunked)
            if len(done) != len(sb.seqs):
                logits = logits[sb.sampled]
            hist = [(s.prompt_ids, s.output_ids) for s in done] if any(s.params.has_penalties for s in done) else None
            out = sample(logits, [s.params for s in done], [gens[s.seq_id] for s in done], hist)
            tokens = out.token_ids.tolist()
            dt = time.perf_counter() - t0
            st["peak_blocks"] = max(st["peak_blocks"], self.block_manager.usage().used_blocks)
            st["preemptions"] += len(sb.preempted)
            key = "prefill" if sb.kind == "prefill" else "decode"
            st[f"{key}_tokens"] += sb.num_tokens
            st[f"{key}_s"] += dt
            st["steps"] += 1
            if first_token_s is None and done:
                first_token_s = time.perf_counter() - t_start
            sched.postprocess(done, tokens)
        self.last_stats = self._stats(st, time.perf_counter() - t_start, first_token_s)
        mm = [s.mm for s in seqs if s.mm is not None]
        if self.spec.vision is not None:  # the tower's share of the prefill time
            self.last_stats["vision"] = {"images": sum(len(r.images) for r in mm),
                                         "tokens": sum(im.num_tokens for r in mm for im in r.images),
                                         "encoder_s": round(sum(r.encode_s for r in mm), 6)}
        return [GenerationResult(s.prompt_ids, list(s.output_ids), s.text, s.finish_reason, s.stop_reason)
                for s in seqs]

    def _stats(self, st: dict, total_s: float, ttft: float | None) -> dict:
        bpt = self.pool.bytes_per_token
        bs = self.block_manager.block_size
        return {
            "prefill_tokens": st["prefill_tokens"], "prefill_s": round(st["prefill_s"], 6),
            "prefill_tokens_per_s": round(st["prefill_tokens"] / st["prefill_s"], 2) if st["prefill_s"] else None,
            "decode_tokens": st["decode_tokens"], "decode_s": round(st["decode_s"], 6),
            "decode_tokens_per_s": round(st["decode_tokens"] / st["decode_s"], 2) if st["decode_s"] else None,
            "time_to_first_token_s": round(ttft, 6) if ttft is not None else None,
            "total_s": round(total_s, 6), "steps": st["steps"], "preemptions": st["preemptions"],
            "kernels": {"requested": self.kernels.impl, "ops": dict(self.kernels.backends)},  # op -> backend
            "cpu_kernels": (None if self.device.type != "cpu" else cpu_kernels.status()
                            if "cpu" in self.kernels.backends.values() else f"off (--kernels {self.kernels.impl})"),
            "moe_experts": experts_form(self.model),  # tiled / oneDNN packed / stacked (backends/cpu_layouts.py)
            "moe_router": routers_form(self.model),  # fused / torch (backends/cpu_layouts.py)
            "linears": linears_form(self.model),  # {"fma panels" | "oneDNN packed" | "plain": count}
            "weight_bytes": self.weight_bytes,  # resident on the device, this rank (runtime/quant/load.py)
            "weights": self.weights_held,  # how each group is held: quantized forms, dense dtypes
            "huge_pages": huge_pages_status() if self.device.type == "cpu" else None,  # weights (host_memory.py)
            "kv_cache": {
                "dtype": "int8" if self.pool.spec.quant == "int8" else str(self.pool.spec.dtype).replace("torch.", ""),
                "block_size": bs, "blocks_total": self.pool.num_blocks, "blocks_peak_used": st["peak_blocks"],
                "blocks_used_after": self.block_manager.usage().used_blocks,
                "bytes_per_token": bpt, "pool_bytes": self.pool.total_bytes,
                "peak_used_bytes": st["peak_blocks"] * bs * bpt,
                "peak_usage_fraction": round(st["peak_blocks"] / self.pool.num_blocks, 6),
            },
        }

    # -- validation hooks -----------------------------------------------------------------------------

    @torch.inference_mode()
    def prefill(self, token_ids: list[int], return_hidden_states: bool = False, images: list | None = None,
                last_only: bool = False) -> PrefillOutput:
        """Logits of every position [T, V] (float32) of one prompt, computed without the cache (``last_only``:
        of the last position, [1, V], as serving needs); with ``return_hidden_states`` every captured
        intermediate too (see the module docstring; with images also the tower's: vision/clip.py,
        vision/qwen_vit.py)."""
        ids = torch.tensor([int(t) for t in token_ids], dtype=torch.long, device=self.device)
        n = ids.shape[0]
        if n == 0:
            raise RuntimeConfigError("prefill needs at least one token")
        fb = ForwardBatch("prefill", torch.arange(n, device=self.device), self.kernels,
                          cu_seqlens=torch.tensor([0, n], dtype=torch.int32, device=self.device),
                          capture={} if return_hidden_states else None, attn_tiles=prefill_tiles(n))
        req = make_request(self.spec, [int(t) for t in token_ids], images or [])
        if req is not None:
            req.features = self.model.encode_images(req.images, self.kernels, fb.capture)
            seq = Sequence(0, [int(t) for t in token_ids], None, mm=req)
            fb.mm_embeds, fb.mrope_positions = step_inputs(self.model, self.kernels, [seq], self.device)
        rows = torch.tensor([n - 1], device=self.device) if last_only else None
        logits = self.runner.execute(ids, fb, rows)
        return PrefillOutput(logits, fb.capture or {})

    def prefill_logits(self, token_ids: list[int], images: list | None = None) -> torch.Tensor:
        """[T, V] float32 logits of every position of one prompt."""
        return self.prefill(token_ids, images=images).logits

    def image_processor(self):
        """The checkpoint's image processor (vision/processor.py), loaded on first use."""
        if self.spec.vision is None:
            raise ImageInputError(f"{self.spec.model_type} has no vision tower: it takes no images")
        if getattr(self, "_image_processor", None) is None:
            self._image_processor = ImageProcessor(self.path, self.spec.vision)
        return self._image_processor


def check_weights_dtype(weights_dtype: str, dtype: torch.dtype) -> str:
    """``--weights-dtype``: auto (a quantized checkpoint's linears stay quantized) or the dtype every weight is
    dequantized to at load, which must be the compute dtype."""
    names = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
    if weights_dtype != "auto" and weights_dtype not in names:
        raise RuntimeConfigError(f"--weights-dtype must be auto, bf16, fp16 or fp32; got {weights_dtype!r}")
    if weights_dtype != "auto" and names[weights_dtype] != dtype:
        raise RuntimeConfigError(f"--weights-dtype {weights_dtype} needs --dtype "
                                 f"{str(names[weights_dtype]).replace('torch.', '')} (the runtime computes in the "
                                 f"weights' dtype; got --dtype {str(dtype).replace('torch.', '')})")
    return weights_dtype


def _windowed(spec: ModelSpec) -> bool:
    return any(spec.attention.window_of(i) is not None for i in range(spec.num_layers))


def _make_pool(spec: ModelSpec, net, ctx: ParallelContext, dev: torch.device, dtype: torch.dtype, memory,
               kv_dtype: str, block_size: int, max_len: int, max_num_seqs: int) -> KVPool:
    start, stop = net.layer_range
    n_layers = max(1, stop - start)
    quant = "int8" if kv_dtype == "int8" else None
    a = spec.attention
    if a.kind == "mla":
        kspec = KVCacheSpec.mla(n_layers, a.kv_lora_rank, a.qk_rope_head_dim, dtype, quant=quant)
    else:
        kspec = KVCacheSpec.mha(n_layers, max(1, a.num_kv_heads // ctx.tp_size), a.head_dim, dtype, a.v_head_dim,
                                quant=quant)
    nbytes, fraction = parse_memory(memory)
    if nbytes is None:
        free = available_memory_bytes(dev) if dev.type in ("cpu", "cuda") else None
        if free is None:
            raise RuntimeConfigError(f"cannot measure free memory on {dev.type!r}; pass --kv-cache-memory BYTES")
        nbytes = int(free * (fraction if fraction is not None else 0.9))
        if dev.type == "cpu" and fraction is None:
            nbytes = min(nbytes, DEFAULT_CPU_KV_BYTES)
    max_blocks = -(-max_len // block_size) * max_num_seqs
    return KVPool.from_budget(kspec, block_size, dev, memory_bytes=nbytes, max_blocks=max_blocks)
