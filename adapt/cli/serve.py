"""`adapt serve MODEL`: an OpenAI-compatible HTTP service (/v1/completions, /v1/chat/completions)."""

from __future__ import annotations

from typing import Annotated, Optional

import typer

from adapt.cli.options import KERNELS_HELP, DeviceOpt, DtypeOpt, PrepackOpt
from adapt.errors import RuntimeConfigError
from adapt.cli.output import err_console, note_cpu_kernel_build


def serve(
    model: Annotated[str, typer.Argument(help="Checkpoint dir, `adapt shard` output dir, or built-in name "
                                              "(tiny-k2, tiny-llama, tiny-qwen3-moe).")],
    host: Annotated[str, typer.Option("--host", help="Address to bind; 0.0.0.0 exposes the service to the "
                                      "network (set --api-key then).")] = "127.0.0.1",
    port: Annotated[int, typer.Option("--port", min=0, max=65535, help="0 picks a free port.")] = 8000,
    device: DeviceOpt = "cpu",
    dtype: DtypeOpt = "float32",
    kernels: Annotated[str, typer.Option("--kernels", help=KERNELS_HELP)] = "auto",
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
    max_num_batched_tokens: Annotated[int, typer.Option("--max-num-batched-tokens", min=16, help="Tokens one "
                                      "prefill step computes: a longer prompt is prefilled in chunks between the "
                                      "running streams' decode steps.")] = 2048,
    no_chunked_prefill: Annotated[bool, typer.Option("--no-chunked-prefill", help="Prefill every prompt whole "
                                  "in one step.")] = False,
    no_prefix_caching: Annotated[bool, typer.Option("--no-prefix-caching", help="Do not reuse the KV blocks of "
                                 "prompt prefixes seen before.")] = False,
    api_key: Annotated[Optional[str], typer.Option("--api-key", envvar="ADAPT_API_KEY", help="Require "
                       "'Authorization: Bearer KEY' on every route but /health, /health/golden and /metrics.")
                       ] = None,
    metrics_auth: Annotated[bool, typer.Option("--metrics-auth", help="Put /metrics behind --api-key too.")
                            ] = False,
    metrics_prefix: Annotated[str, typer.Option("--metrics-prefix", help="Prefix of the Prometheus series: "
                              "adapt or vllm (for dashboards that hard-code vllm:).")] = "adapt",
    max_pending: Annotated[int, typer.Option("--max-pending", min=1, help="Generation requests in flight; "
                           "more get 429 with Retry-After.")] = 512,
    max_connections: Annotated[int, typer.Option("--max-connections", min=1, help="Open HTTP requests; more "
                               "get 429 with Retry-After.")] = 2048,
    backlog: Annotated[int, typer.Option("--backlog", min=1, help="Listen backlog (connections the kernel "
                       "queues before the server accepts them).")] = 2048,
    health_golden: Annotated[Optional[str], typer.Option("--health-golden", help="A golden directory (adapt "
                             "validate dump) or cases file replayed by GET /health/golden: 200 only while the "
                             "served greedy tokens equal the recorded ones.")] = None,
    health_golden_interval: Annotated[float, typer.Option("--health-golden-interval", min=1.0, help="Seconds "
                                      "a golden answer is reused before the prompts are replayed again.")] = 300.0,
    allow_remote_images: Annotated[bool, typer.Option("--allow-remote-images", help="Let image_url parts be "
                                   "http(s) URLs the server fetches (off: data: URLs only).")] = False,
    limit_images_per_prompt: Annotated[int, typer.Option("--limit-images-per-prompt", min=1, help="Images one "
                                       "chat request may hold.")] = 4,
    max_image_bytes: Annotated[str, typer.Option("--max-image-bytes", help="Encoded size of one image (20MiB); "
                               "a data: URL is also bounded by --max-request-bytes.")] = "20MiB",
    max_image_pixels: Annotated[int, typer.Option("--max-image-pixels", min=1, help="Decoded width x height of "
                                "one image, read from its header before decoding.")] = 64 << 20,
    image_fetch_timeout: Annotated[float, typer.Option("--image-fetch-timeout", min=0.1, help="Seconds one "
                                   "remote image's whole fetch may take.")] = 10.0,
    batch_window_ms: Annotated[float, typer.Option("--batch-window-ms", min=0.0, help="An idle engine waits "
        "this long after each arrival of a burst (at most 10x in all) so the burst is prefilled together; 0: "
        "never wait.")] = 2.0,
    verbose: Annotated[bool, typer.Option("--verbose", "-v", help="Log every request on stderr.")] = False,
) -> None:
    """Serve MODEL over HTTP until Ctrl-C / SIGTERM; requests from all clients are batched together."""
    from adapt.runtime.engine import Engine
    from adapt.runtime.server import ServiceConfig, serve as run_service

    if metrics_prefix not in ("adapt", "vllm"):
        raise RuntimeConfigError(f"--metrics-prefix must be adapt or vllm; got {metrics_prefix!r}")
    if metrics_auth and not api_key:
        raise RuntimeConfigError("--metrics-auth needs --api-key (or ADAPT_API_KEY)")
    image_bytes = _bytes(max_image_bytes, "--max-image-bytes")
    note_cpu_kernel_build(device, kernels)
    engine = Engine.from_pretrained(model, device=device, dtype=dtype, kernels=kernels,
                                    kv_cache_memory=kv_cache_memory, kv_cache_dtype=kv_cache_dtype,
                                    max_num_seqs=max_num_seqs, max_model_len=max_model_len, prepack=prepack,
                                    max_num_batched_tokens=max_num_batched_tokens,
                                    enable_prefix_caching=not no_prefix_caching,
                                    enable_chunked_prefill=not no_chunked_prefill)
    name = served_model_name or (engine.path.name if engine.path is not None else model)
    cfg = ServiceConfig(model_name=name, max_request_bytes=max_request_bytes, request_timeout_s=request_timeout,
                        max_pending=max_pending, max_connections=max_connections, backlog=backlog,
                        api_key=api_key or None, metrics_auth=metrics_auth, metrics_prefix=metrics_prefix,
                        health_golden=health_golden, health_golden_interval_s=health_golden_interval,
                        allow_remote_images=allow_remote_images, limit_images_per_prompt=limit_images_per_prompt,
                        max_image_bytes=image_bytes,
                        max_image_pixels=max_image_pixels, image_fetch_timeout_s=image_fetch_timeout,
                        batch_window_s=batch_window_ms / 1000)

    def ready(srv) -> None:
        if host not in ("127.0.0.1", "::1", "localhost") and not api_key:
            err_console.print(f"warning: {host} is reachable from the network and no --api-key is set",
                              highlight=False, soft_wrap=True)
        err_console.print(f"serving {name} on {srv.url}", highlight=False, soft_wrap=True)

    run_service(engine, host=host, port=port, config=cfg, on_ready=ready, verbose=verbose)
    err_console.print("stopped", highlight=False)


def _bytes(text: str, flag: str) -> int:
    from adapt.units import parse_bytes

    n = parse_bytes(text)
    if n is None:
        raise RuntimeConfigError(f"{flag} takes a size like 20MiB or 5000000; got {text!r}")
    return n


def register(app: typer.Typer) -> None:
    app.command("serve")(serve)
