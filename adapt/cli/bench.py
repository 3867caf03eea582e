"""`adapt bench serve --endpoint URL`: load an OpenAI-compatible server and measure it (adapt/bench/load.py)."""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Annotated, Optional

import typer

from adapt.cli.output import err_console

bench_app = typer.Typer(no_args_is_help=True, add_completion=False,
                        help="Measure a running server: `adapt bench serve --endpoint URL`.")


def _fmt(v) -> str:
    return "-" if v is None or (isinstance(v, float) and math.isnan(v)) else f"{v:.4g}"


def print_result(res: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    t = Table(title=f"adapt bench serve: {res['endpoint']['url']} ({res['endpoint']['served_model_name']})")
    for c in ("metric", "mean", "p50", "p90", "p99"):
        t.add_column(c)
    for k in ("ttft_s", "itl_s", "tpot_s", "e2e_s"):
        s = res[k]
        t.add_row(k, *(_fmt(s[q]) for q in ("mean", "p50", "p90", "p99")))
    out = Console()
    out.print(t)
    out.print(f"completed {res['completed']}, failed {res['failed']} {res['errors'] or ''} in {res['duration_s']:.2f} s; "
              f"{res['request_throughput']:.3g} req/s, {res['output_tokens_per_s']:.4g} output tok/s, goodput "
              f"{res['goodput']:.3g} req/s ({res['goodput_fraction']:.0%} within {res['slo'] or 'no SLO'})",
              highlight=False)
    sv = res.get("server_metrics")
    if sv:
        out.print("server /metrics: " + ", ".join(f"{k} {_fmt(v)}" for k, v in sv.items()), highlight=False)


@bench_app.command("serve")
def serve_cmd(
    endpoint: Annotated[str, typer.Option("--endpoint", help="Server URL (http://HOST:PORT).")],
    requests: Annotated[int, typer.Option("--requests", "-n", min=1, help="Requests to send.")] = 64,
    concurrency: Annotated[Optional[int], typer.Option("--concurrency", "-c", min=1, help="Requests in flight "
                           "(closed loop); with --rate, the most in flight.")] = None,
    rate: Annotated[Optional[float], typer.Option("--rate", min=0.001, help="Poisson arrivals at this mean "
                    "rate (requests/s; open loop).")] = None,
    input_len: Annotated[int, typer.Option("--input-len", min=1, help="Prompt tokens (seeded ids).")] = 128,
    output_len: Annotated[int, typer.Option("--output-len", min=1, help="Tokens to generate per request.")] = 64,
    dataset: Annotated[Optional[Path], typer.Option("--dataset", help="JSONL of {\"prompt\": text or ids, "
                       "\"max_tokens\"?: n}, instead of --input-len prompts.")] = None,
    slo: Annotated[Optional[str], typer.Option("--slo", help="Goodput SLO in seconds: ttft=0.5,itl=0.05 "
                   "(keys ttft, itl, tpot, e2e).")] = None,
    soak: Annotated[Optional[float], typer.Option("--soak", min=1.0, help="Run for SECONDS instead of "
                    "--requests and sample the server's /metrics for drift.")] = None,
    api_key: Annotated[Optional[str], typer.Option("--api-key", envvar="ADAPT_API_KEY",
                       help="Bearer key (default $ADAPT_API_KEY).")] = None,
    served_model_name: Annotated[Optional[str], typer.Option("--served-model-name", help="Model id to request "
                                 "(default: the one /v1/models lists).")] = None,
    vocab_size: Annotated[int, typer.Option("--vocab-size", min=4, help="Prompt ids are drawn from "
                          "[3, VOCAB).")] = 256,
    seed: Annotated[int, typer.Option("--seed", help="Seed of the prompts and arrival times.")] = 0,
    timeout: Annotated[float, typer.Option("--timeout", min=0.1, help="Seconds a request may stay silent.")] = 120.0,
    fmt: Annotated[str, typer.Option("--format", "-f", help="text | json (stdout).")] = "text",
) -> None:
    """Load the server at --endpoint: TTFT, ITL, TPOT, e2e percentiles, throughput, goodput, errors by kind."""
    from adapt.bench.load import LoadConfig, aggregate, run_load
    from adapt.bench.prom import Sampler, drift, scrape, server_view
    from adapt.bench.stats import BenchInputError, parse_slo
    from adapt.validate.endpoint import probe
    from adapt.validate.openai_client import Client

    if fmt not in ("text", "json"):
        raise BenchInputError(f"--format must be text or json; got {fmt!r}")
    if dataset is not None and not dataset.is_file():
        raise BenchInputError(f"--dataset {dataset}: no such file")
    slo_bounds = parse_slo(slo)  # every flag is checked before the server is contacted
    if dataset is not None:
        from adapt.bench.load import load_dataset

        load_dataset(dataset, 1)
    try:
        client = Client(endpoint, api_key=api_key, timeout=timeout)
    except ValueError as e:
        raise BenchInputError(str(e)) from None
    info = probe(client, served_model_name)  # nothing reachable: exit 2
    cfg = LoadConfig(requests=requests, concurrency=concurrency, rate=rate, input_len=input_len,
                     output_len=output_len, dataset=dataset, slo=slo_bounds, seed=seed, vocab_size=vocab_size,
                     model=info.model, soak_s=soak)
    before = scrape(client)
    sampler = Sampler(client, max(1.0, soak / 10)).start() if soak and before is not None else None
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    with Progress(TextColumn("bench serve"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.fields[err]}"),
                  TimeElapsedColumn(), console=err_console, transient=True) as bar:
        task = bar.add_task("requests", total=None if soak else requests, err="")
        failed = [0]

        def done(rec: dict) -> None:
            failed[0] += 0 if rec["ok"] else 1
            bar.update(task, advance=1, err=f"{failed[0]} failed" if failed[0] else "")

        t0 = time.perf_counter()
        records = run_load(client, cfg, on_done=done)
        duration = time.perf_counter() - t0
    res = aggregate(records, cfg, duration)
    after = scrape(client)
    res["server_metrics"] = server_view(before, after, duration)
    if soak:
        res["soak"] = _soak(records, sampler, drift)
    res["endpoint"] = info.to_dict() | {"extensions_refused": sorted(client.dropped)}
    if fmt == "json":
        typer.echo(json.dumps(res, indent=1, default=str))
    else:
        print_result(res)
    raise typer.Exit(0 if res["completed"] else 1)


def _soak(records: list[dict], sampler, drift) -> dict:
    from adapt.bench.stats import percentile

    ok = sorted((r for r in records if r["ok"]), key=lambda r: r["start"])
    third = max(1, len(ok) // 3)
    first, last = ok[:third], ok[-third:]
    client_drift = {}
    for k in ("ttft", "e2e"):
        a, b = percentile([r[k] for r in first], 50), percentile([r[k] for r in last], 50)
        client_drift[f"{k}_p50_first_third_s"], client_drift[f"{k}_p50_last_third_s"] = a, b
        client_drift[f"{k}_ratio"] = b / a if a and not math.isnan(a) else None
    out = {"client": client_drift}
    if sampler is not None:
        sampler.stop()
        out["server"] = drift(sampler.samples)
    else:
        out["server"] = {"note": "the server has no /metrics page"}
    return out


def register(app: typer.Typer) -> None:
    app.add_typer(bench_app, name="bench")
