"""`adapt validate TARGET --reference REF|GOLDEN --out DIR` and `adapt validate dump MODEL --out GOLDEN`.

Exit codes: 0 every required item passes (or skips) and nothing regressed; 1 a required item failed or
regressed against --baseline; 2 validate could not run (bad input, bad signature).
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer
from typer.core import TyperGroup

from adapt.cli.options import DeviceOpt, DtypeOpt
from adapt.cli.output import err_console

_STYLE = {"pass": "green", "fail": "red", "skip": "yellow", "error": "magenta"}


class _ValidateGroup(TyperGroup):
    """`adapt validate TARGET ...` runs the hidden `run` command; `adapt validate dump ...` the dump."""

    def parse_args(self, ctx, args):
        if args and args[0] not in self.commands and args[0] not in ("--help", "-h"):
            args = ["run", *args]
        return super().parse_args(ctx, args)


validate_app = typer.Typer(cls=_ValidateGroup, no_args_is_help=True, add_completion=False,
                           help="Validate a target against the reference (checklist-driven, layered) or dump a "
                                "golden reference. `adapt validate TARGET --reference REF --out DIR`.")


def print_report(report, notes: list[str] = ()) -> None:
    """The per-item table and the first divergence, on stderr."""
    from rich.table import Table

    table = Table(title=f"adapt validate: {report.environment.get('model', '')}", show_lines=False)
    for col in ("section", "item", "status", "message"):
        table.add_column(col, overflow="fold")
    for it in report.items:
        st = f"[{_STYLE[it.status]}]{it.status}[/]" + ("" if it.required else " (optional)")
        table.add_row(it.section, it.id, st, it.message[:160], )
    err_console.print(table)
    for n in notes:
        err_console.print(f"note: {n}", markup=False, highlight=False)
    fd = report.first_divergence
    if fd:
        err_console.print(f"first divergence: layer {fd.get('layer')} module {fd.get('module')} "
                          f"({fd.get('why', '')})", markup=False, highlight=False)
    for r in report.regressions:
        err_console.print(f"regression: {r.message}", markup=False, highlight=False)


@validate_app.command("run", hidden=True)
def run_cmd(
    reference: Annotated[Path, typer.Option("--reference", "-r", help="Reference HF checkpoint directory "
                                            "(run by transformers, CPU, float32) or a golden directory.")],
    out: Annotated[Path, typer.Option("--out", "-o", help="Directory for report.json, report.html, junit.xml, "
                                      "summary.md.")],
    checklist: Annotated[Optional[Path], typer.Option("--checklist", help="Checklist YAML (default: day0).")] = None,
    device: DeviceOpt = "cpu",
    dtype: DtypeOpt = "float32",
    runtime: Annotated[str, typer.Option("--runtime", help="Target runtime: auto (adapt's engine when present, "
                                         "else transformers), adapt, transformers.")] = "auto",
    only: Annotated[Optional[list[str]], typer.Option("--only", help="Run only these item ids or sections.")] = None,
    baseline: Annotated[Optional[Path], typer.Option("--baseline", help="Signed baseline to gate against.")] = None,
    write_baseline: Annotated[Optional[Path], typer.Option("--write-baseline", help="Sign this run as a "
                                                           "baseline into FILE.")] = None,
    signer: Annotated[Optional[str], typer.Option("--signer", help="Sign-off name for --write-baseline.")] = None,
    sign_key: Annotated[Optional[Path], typer.Option("--sign-key", help="Ed25519 private key (PEM); default "
                                                     "$ADAPT_SIGNING_KEY, else one under the config dir.")] = None,
    fmt: Annotated[str, typer.Option("--format", "-f", help="text | json (the report on stdout).")] = "text",
    endpoint: Annotated[Optional[str], typer.Option("--endpoint", help="Validate a running OpenAI-compatible "
                        "server at URL (vLLM, SGLang, adapt serve, ...) as a black box instead of TARGET.")] = None,
    api_key: Annotated[Optional[str], typer.Option("--api-key", envvar="ADAPT_API_KEY", help="Bearer key for "
                       "--endpoint (default $ADAPT_API_KEY).")] = None,
    served_model_name: Annotated[Optional[str], typer.Option("--served-model-name", help="Model id to request "
                                 "from --endpoint (default: the one /v1/models lists).")] = None,
    timeout: Annotated[float, typer.Option("--timeout", min=0.1, help="Seconds --endpoint may stay silent "
                       "before a request counts as stalled.")] = 60.0,
    tokenizer: Annotated[Optional[Path], typer.Option("--tokenizer", help="Tokenizer directory for --endpoint's "
                         "token texts and chat template (default: the reference's).")] = None,
    target: Annotated[Optional[Path], typer.Argument(help="HF checkpoint directory or `adapt shard` output "
                                                     "(or --endpoint URL instead).")] = None,
) -> None:
    """Validate TARGET (or --endpoint URL) against the reference; exit 0 pass, 1 fail or regression, 2 could
    not run."""
    from adapt.errors import ValidationInputError
    from adapt.validate.runner import EndpointOptions, validate

    if (target is None) == (endpoint is None):
        raise ValidationInputError("give TARGET (a checkpoint or shard directory) or --endpoint URL, not both"
                                   if target is not None else "give TARGET or --endpoint URL")
    ep = EndpointOptions(endpoint, api_key, served_model_name, timeout, tokenizer) if endpoint else None
    res = validate(target, reference, out, checklist=checklist, device=device, dtype=dtype, runtime=runtime,
                   only=set(only) if only else None, baseline=baseline, write_baseline_to=write_baseline,
                   signer=signer, sign_key=sign_key, endpoint=ep)
    if fmt == "json":
        typer.echo(res.report.to_json())
    print_report(res.report, res.notes)
    s = res.report.summary["by_status"]
    err_console.print(f"{s['pass']} pass, {s['fail']} fail, {s['skip']} skip, {s['error']} error in "
                      f"{res.seconds:.1f}s; wrote {', '.join(str(p) for p in res.paths.values())}",
                      markup=False, highlight=False)
    w = res.baseline_written
    if w is not None:
        where = f"{w.key_path}" if w.key_path else "$ADAPT_SIGNING_KEY"
        made = " (created now; keep it private, back it up)" if w.key_created else ""
        err_console.print(f"signed baseline {w.path} with key {where}{made}; public key {w.public_key}",
                          markup=False, highlight=False)
    raise typer.Exit(res.exit_code)


def _lengths(text: str | None, option: str) -> list[int] | None:
    if text is None:
        return None
    try:
        out = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        out = []
    if not out and text.strip() not in ("", "none") or any(n < 1 for n in out):
        raise typer.BadParameter(f"{option} takes comma-separated positive token counts, e.g. 8,16; got {text!r}")
    return out


@validate_app.command("dump")
def dump_cmd(
    model: Annotated[Path, typer.Argument(help="Reference HF checkpoint directory (with --dry-run also a "
                                          "config.json or hub id; with --endpoint the model's config: a "
                                          "checkpoint directory, config.json or hub id).")],
    out: Annotated[Optional[Path], typer.Option("--out", "-o", help="Golden directory to write.")] = None,
    max_new_tokens: Annotated[int, typer.Option("--max-new-tokens", min=1)] = 16,
    top_n: Annotated[int, typer.Option("--top-n", min=1, help="Logprobs kept per generated token.")] = 20,
    long_budget_s: Annotated[float, typer.Option("--long-budget-s", help="Time budget of the long-context "
                                                 "rungs (estimated per rung).")] = 60.0,
    long_lengths: Annotated[Optional[str], typer.Option("--long-lengths", help="Long-context rungs, e.g. "
                            "1024,8192 or none (default 1024,8192,32768; none with --stream).")] = None,
    prompt_lengths: Annotated[Optional[str], typer.Option("--prompt-lengths", help="Lengths of the seeded "
                              "prompts (default 8,16,24,32).")] = None,
    stream: Annotated[bool, typer.Option("--stream", help="Layer-streamed reference: one layer and the "
                                         "experts the prompts touch in memory, not the model.")] = False,
    memory_budget: Annotated[Optional[str], typer.Option("--memory-budget", help="With --stream: bytes of "
                             "float32 weights held at once, e.g. 32GB (default: no limit).")] = None,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="With --stream: print the bytes it will read, "
                                          "the peak memory and the time; read nothing.")] = False,
    read_bandwidth: Annotated[Optional[str], typer.Option("--read-bandwidth", help="--dry-run: bytes/s to "
                              "time the reads at (default: measured on the checkpoint's files).")] = None,
    fmt: Annotated[str, typer.Option("--format", "-f", help="text | json.")] = "text",
    endpoint: Annotated[Optional[str], typer.Option("--endpoint", help="Record the golden from a running "
                        "OpenAI-compatible server at URL (e.g. vLLM on the reference hardware) instead of "
                        "transformers: prompts, greedy tokens, top-N logprobs.")] = None,
    api_key: Annotated[Optional[str], typer.Option("--api-key", envvar="ADAPT_API_KEY", help="Bearer key for "
                       "--endpoint (default $ADAPT_API_KEY).")] = None,
    served_model_name: Annotated[Optional[str], typer.Option("--served-model-name", help="Model id to request "
                                 "from --endpoint (default: the one /v1/models lists).")] = None,
    timeout: Annotated[float, typer.Option("--timeout", min=0.1, help="Seconds --endpoint may stay silent.")] = 60.0,
    tokenizer: Annotated[Optional[Path], typer.Option("--tokenizer", help="Tokenizer directory that maps "
                         "--endpoint's token texts to ids where it sends none (default: MODEL's).")] = None,
) -> None:
    """Dump the float32 CPU reference of MODEL (prompts, top-k logprobs, per-layer samples) into GOLDEN, or
    record one from --endpoint URL."""
    from adapt.cli.output import check_choice, to_json
    from adapt.units import parse_bytes
    from adapt.validate.golden import DEFAULT_LONG, dump_golden

    check_choice(fmt, ("text", "json"), "--format")
    if endpoint is not None:
        if stream or memory_budget or dry_run or read_bandwidth:
            raise typer.BadParameter("--stream, --memory-budget, --dry-run and --read-bandwidth run the reference "
                                     "here; --endpoint records it from a server")
        _dump_endpoint(endpoint, model, out, fmt, api_key=api_key, served_model_name=served_model_name,
                       timeout=timeout, tokenizer_dir=tokenizer, max_new_tokens=max_new_tokens, top_n=top_n,
                       long_lengths=_lengths(long_lengths, "--long-lengths"), long_budget_s=long_budget_s,
                       prompt_lengths=_lengths(prompt_lengths, "--prompt-lengths"))
        return
    if api_key or served_model_name or tokenizer:
        raise typer.BadParameter("--api-key, --served-model-name and --tokenizer go with --endpoint")
    if (memory_budget or dry_run or read_bandwidth) and not stream:
        raise typer.BadParameter("--memory-budget, --dry-run and --read-bandwidth go with --stream")
    budget = None
    if memory_budget is not None:
        budget = parse_bytes(memory_budget)
        if budget is None or budget <= 0:
            raise typer.BadParameter(f"--memory-budget takes a size like 32GB; got {memory_budget!r}")
    longs = _lengths(long_lengths, "--long-lengths")
    longs = longs if longs is not None else ([] if stream else list(DEFAULT_LONG))
    prompts = _lengths(prompt_lengths, "--prompt-lengths") or None
    if dry_run:
        from adapt.validate.stream_estimate import dry_run as estimate, fmt_bytes

        bw = parse_bytes(read_bandwidth.removesuffix("/s")) if read_bandwidth else None
        est = estimate(str(model), max_new_tokens, prompts, longs, budget, bw)
        if fmt == "json":
            typer.echo(to_json(est))
            return
        chunked = [r["layer"] for r in est["layers"] if r["experts_chunked"]]
        err_console.print(
            f"{est['model']}: {est['passes']} passes, reads {fmt_bytes(est['bytes_read'])}, peak memory "
            f"{fmt_bytes(est['peak_memory_bytes'])} (weights {fmt_bytes(est['peak_weight_bytes'])}, KV "
            f"{fmt_bytes(est['kv_cache_bytes'])}, baseline {fmt_bytes(est['baseline_bytes'])}), about "
            f"{est['est_time_s']:.0f} s at {fmt_bytes(est['read_bandwidth'])}/s ({est['read_bandwidth_source']})"
            + (f"; experts in chunks in layers {chunked[0]}-{chunked[-1]}" if chunked else ""),
            markup=False, highlight=False)
        return
    if out is None:
        raise typer.BadParameter("--out is required (the golden directory to write)")
    kw = {"prompt_lengths": prompts} if prompts else {}
    doc = dump_golden(model, out, max_new_tokens=max_new_tokens, top_n=top_n, long_lengths=longs,
                      long_budget_s=long_budget_s, stream=stream, memory_budget=budget, **kw)
    if fmt == "json":
        typer.echo(to_json({k: doc[k] for k in ("model", "num_layers", "prompts", "long_context", "streamed")
                            if k in doc}))
    err_console.print(f"wrote {out}/golden.json and tensors.safetensors: {len(doc['prompts'])} prompts, "
                      f"{doc['num_layers']} layers, long context {doc['long_context']['lengths']}",
                      markup=False, highlight=False)
    st = doc.get("streamed")
    if st:
        from adapt.validate.stream_estimate import fmt_bytes

        err_console.print(f"streamed: read {fmt_bytes(st['bytes_read'])} in {st['passes']} passes, peak "
                          f"weights {fmt_bytes(st['peak_weight_bytes'])}, peak RSS "
                          f"{fmt_bytes(st['rss']['peak_bytes'])} (baseline {fmt_bytes(st['rss']['baseline_bytes'])})",
                          markup=False, highlight=False)


def _dump_endpoint(url: str, model: Path, out: Path | None, fmt: str, long_lengths, prompt_lengths, **kw) -> None:
    from adapt.cli.output import to_json
    from adapt.validate.golden import DEFAULT_LONG
    from adapt.validate.golden_endpoint import dump_endpoint_golden

    if out is None:
        raise typer.BadParameter("--out is required (the golden directory to write)")
    doc = dump_endpoint_golden(url, model, out, long_lengths=DEFAULT_LONG if long_lengths is None else long_lengths,
                               **({"prompt_lengths": prompt_lengths} if prompt_lengths else {}), **kw)
    ep = doc["endpoint"]
    if fmt == "json":
        typer.echo(to_json({k: doc[k] for k in ("model", "source", "endpoint", "prompts", "long_context")}))
    err_console.print(f"wrote {out}/golden.json and tensors.safetensors from {ep['url']} ({ep['served_model_name']}): "
                      f"{len(doc['prompts'])} prompts x {doc['generation']['max_new_tokens']} greedy tokens, top-"
                      f"{doc['generation']['top_n']} logprobs; token ids from {', '.join(ep['token_ids'])}; prompt "
                      f"logprobs from {ep['prompt_logprobs']}; long context {doc['long_context']['lengths']}",
                      markup=False, highlight=False)


def register(app: typer.Typer) -> None:
    app.add_typer(validate_app, name="validate")
