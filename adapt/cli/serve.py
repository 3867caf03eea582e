"""`adapt serve MODEL`: an OpenAI-compatible HTTP service (/v1/completions, /v1/chat/completions)."""

from __future__ import annotations

from typing import Annotated, Optional

import typer

from adapt.cli.options import DeviceOpt, DtypeOpt, PrepackOpt
from adapt.cli.output import err_console, note_cpu_kernel_build


def serve(
    model: Annotated[str, typer.Argument(help="Checkpoint dir, `adapt shard` output dir, or built-in name "
                                              "(tiny-k2, tiny-llama, tiny-qwen3-moe).")],
    host: Annotated[str, typer.Option("--host", help="Address to bind; 0.0.0.0 exposes the service to the "
                                      "network (it has no authentication).")] = "127.0.0.1",
    port: Annotated[int, typer.Option("--port", min=0, max=65535, help="0 picks a free port.")] = 8000,
    device: DeviceOpt = "cpu",
    dtype: DtypeOpt = "float32",
    kernels: Annotated[str, typer.Option("--kernels", help="adapt | reference (the plain-torch twins).")] = "adapt",
    kv_cache_memory: Annotated[Optional[str], typer.Option("--kv-cache-memory", help="KV cache budget: bytes "
                               "(2GiB, 512MiB) or a fraction of free memory (0.5).")] = None,
    kv_cache_dtype: Annotated[str, typer.Option("--kv-cache-dtype", help="auto | int8")] = "auto",
    prepack: PrepackOpt = "auto",
    served_model_name: Annotated[Optional[str], typer.Option("--served-model-name", help="The model id clients "
                                 "send and /v1/models lists (default: the model directory's name).")] = None,
    max_model_len: Annotated[Optional[int], typer.Option("--max-model-len", min=2, help="Context limit, prompt "
                             "plus completion (default: the model's max_position_embeddings).")] = None,
    max_num_seqs: Annotated[int, typer.Option("--max-num-seqs", min=1, help="Sequences batched per step.")] = 256,
    max_request_bytes: Annotated[int, typer.Option("--max-request-bytes", min=1, help="Larger bodies get 413.")
                                 ] = 8 << 20,
    request_timeout: Annotated[float, typer.Option("--request-timeout", min=0.1, help="Seconds a request may run "
                               "before it is aborted (504).")] = 600.0,
    verbose: Annotated[bool, typer.Option("--verbose", "-v", help="Log every request on stderr.")] = False,
) -> None:
    """Serve MODEL over HTTP until Ctrl-C / SIGTERM; requests from all clients are batched together."""
    from adapt.runtime.engine import Engine
    from adapt.runtime.server import ServiceConfig, serve as run_service

    note_cpu_kernel_build(device, kernels)
    engine = Engine.from_pretrained(model, device=device, dtype=dtype, kernels=kernels,
                                    kv_cache_memory=kv_cache_memory, kv_cache_dtype=kv_cache_dtype,
                                    max_num_seqs=max_num_seqs, max_model_len=max_model_len, prepack=prepack)
    name = served_model_name or (engine.path.name if engine.path is not None else model)
    cfg = ServiceConfig(model_name=name, max_request_bytes=max_request_bytes, request_timeout_s=request_timeout)

    def ready(srv) -> None:
        err_console.print(f"serving {name} on {srv.url}", highlight=False, soft_wrap=True)

    run_service(engine, host=host, port=port, config=cfg, on_ready=ready, verbose=verbose)
    err_console.print("stopped", highlight=False)


def register(app: typer.Typer) -> None:
    app.command("serve")(serve)
