"""`adapt run MODEL --prompt TEXT | --prompt-ids 1,2,3`: generate with adapt's own runtime."""

from __future__ import annotations

import os
import sys
from typing import Annotated, Optional

import typer

from adapt.cli.launch import (CollectiveStatsOpt, DistBackendOpt, DistTimeoutOpt, MicroBatchesOpt, NnodesOpt,
                              NodeRankOpt, NprocOpt, RdzvOpt, TorchrunArgOpt)
from adapt.cli.options import KERNELS_HELP, DeviceOpt, DtypeOpt, FormatOpt, PrepackOpt
from adapt.cli.output import check_choice, emit, err_console, note_cpu_kernel_build, to_json
from adapt.errors import RuntimeConfigError


def parse_ids(text: str) -> list[int]:
    try:
        ids = [int(x) for x in text.replace(" ", "").split(",") if x != ""]
    except ValueError:
        raise RuntimeConfigError(f"--prompt-ids takes comma-separated integers, got {text!r}") from None
    if not ids:
        raise RuntimeConfigError("--prompt-ids is empty")
    return ids


def run(
    model: Annotated[str, typer.Argument(help="Checkpoint dir, `adapt shard` output dir, or built-in name "
                                              "(tiny-k2, tiny-llama, tiny-qwen3-moe).")],
    prompt: Annotated[Optional[list[str]], typer.Option("--prompt", "-p", help="Prompt text (repeatable).")] = None,
    prompt_ids: Annotated[Optional[list[str]], typer.Option("--prompt-ids", help="Token ids 1,2,3 (repeatable); "
                                                            "bypasses the tokenizer.")] = None,
    image: Annotated[Optional[list[str]], typer.Option("--image", help="Image path, data: URL or http(s) URL "
                                                      "(repeatable, in placeholder order); needs adapt[vision].")] = None,
    allow_remote_images: Annotated[bool, typer.Option("--allow-remote-images",
                                                      help="Let --image fetch http(s) URLs.")] = False,
    chat: Annotated[bool, typer.Option("--chat", help="Wrap each --prompt as a user message (chat template).")] = False,
    max_tokens: Annotated[int, typer.Option("--max-tokens", "-n", min=1)] = 32,
    temperature: Annotated[float, typer.Option("--temperature", "-t", help="0 is greedy.")] = 0.0,
    top_k: Annotated[Optional[int], typer.Option("--top-k")] = None,
    top_p: Annotated[float, typer.Option("--top-p")] = 1.0,
    seed: Annotated[Optional[int], typer.Option("--seed")] = None,
    stop: Annotated[Optional[list[str]], typer.Option("--stop", help="Stop string (repeatable).")] = None,
    ignore_eos: Annotated[bool, typer.Option("--ignore-eos")] = False,
    device: DeviceOpt = "cpu",
    dtype: DtypeOpt = "float32",
    kernels: Annotated[str, typer.Option("--kernels", help=KERNELS_HELP)] = "auto",
    kv_cache_memory: Annotated[Optional[str], typer.Option("--kv-cache-memory", help="KV cache budget: bytes "
                               "(2GiB, 512MiB) or a fraction of free memory (0.5).")] = None,
    kv_cache_dtype: Annotated[str, typer.Option("--kv-cache-dtype", help="auto | int8")] = "auto",
    prepack: PrepackOpt = "auto",
    weights_dtype: Annotated[str, typer.Option("--weights-dtype", help="auto | bf16 | fp16 | fp32: a quantized "
                             "checkpoint's linears stay quantized (auto) or are dequantized at load to that dtype "
                             "(= --dtype).")] = "auto",
    fmt: FormatOpt = "text",
    nproc: NprocOpt = 0,
    nnodes: NnodesOpt = None,
    node_rank: NodeRankOpt = None,
    rdzv_endpoint: RdzvOpt = None,
    torchrun_arg: TorchrunArgOpt = None,
    dist_backend: DistBackendOpt = None,
    dist_timeout: DistTimeoutOpt = 300.0,
    micro_batches: MicroBatchesOpt = None,
    collective_stats: CollectiveStatsOpt = False,
) -> None:
    """Generate for all prompts as one batch; --format json prints {"outputs": [...], "stats": {...}}."""
    from adapt.runtime.run import run_generation

    check_choice(fmt, ("text", "json"), "--format")
    from adapt.cli.launch import launch_or_rank, print_collective_stats

    mode = launch_or_rank(nproc, nnodes, node_rank, rdzv_endpoint, torchrun_arg)  # multi-rank: see cli/launch.py
    if mode == "launched":
        return
    if mode != "rank" or os.environ.get("RANK", "0") == "0":
        note_cpu_kernel_build(device, kernels)
    kw = dict(chat=chat, max_tokens=max_tokens, temperature=temperature, top_k=top_k, top_p=top_p, seed=seed,
              stop=stop, ignore_eos=ignore_eos, device=device, dtype=dtype, kernels=kernels,
              kv_cache_memory=kv_cache_memory, kv_cache_dtype=kv_cache_dtype, prepack=prepack, images=image,
              weights_dtype=weights_dtype,
              allow_remote_images=allow_remote_images)
    if mode == "rank":
        from adapt.runtime.distributed.faults import rank_guard
        from adapt.runtime.distributed.generate import run_distributed

        with rank_guard():
            doc = run_distributed(model, prompt, [parse_ids(p) for p in prompt_ids or []], dist_backend=dist_backend,
                                  dist_timeout=dist_timeout, micro_batches=micro_batches,
                                  collective_stats=collective_stats, **kw)
        if doc is None:  # not rank 0: rank 0 prints
            _leave_rank()
    else:
        doc = run_generation(model, prompt, [parse_ids(p) for p in prompt_ids or []], **kw)
    if fmt == "json":
        emit(to_json(doc), None)
    else:
        _print_text(doc)
    if mode == "rank":
        _leave_rank()


def _leave_rank() -> None:
    """A rank whose run finished (its process group already destroyed, rank 0's output written) exits at once:
    letting the interpreter's exit tear down what gloo left intermittently aborts a rank of a dp x ep run with
    "terminate called without an active exception" (tiny-k2 dp2.ep2: 2 of 8 runs on a 2-core host), which the
    launcher reports as a failed run; distributed/layout.py leaves the same way."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _print_text(doc: dict) -> None:
    from adapt.cli.launch import print_collective_stats

    for i, o in enumerate(doc["outputs"]):
        body = o["text"] if o["text"] is not None else " ".join(map(str, o["token_ids"]))
        emit(f"[{i}] {body}", None)
    s = doc["stats"]
    err_console.print(f"prefill {s['prefill_tokens']} tok @ {s['prefill_tokens_per_s']} tok/s, decode "
                      f"{s['decode_tokens']} tok @ {s['decode_tokens_per_s']} tok/s, KV peak "
                      f"{s['kv_cache']['blocks_peak_used']}/{s['kv_cache']['blocks_total']} blocks", highlight=False)
    print_collective_stats(s.get("collectives"), err_console)


def register(app: typer.Typer) -> None:
    app.command("run")(run)
