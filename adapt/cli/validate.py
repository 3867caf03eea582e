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
    target: Annotated[Path, typer.Argument(help="HF checkpoint directory or `adapt shard` output.")],
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
) -> None:
    """Validate TARGET against the reference; exit 0 pass, 1 fail or regression, 2 could not run."""
    from adapt.validate.runner import validate

    res = validate(target, reference, out, checklist=checklist, device=device, dtype=dtype, runtime=runtime,
                   only=set(only) if only else None, baseline=baseline, write_baseline_to=write_baseline,
                   signer=signer, sign_key=sign_key)
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


@validate_app.command("dump")
def dump_cmd(
    model: Annotated[Path, typer.Argument(help="Reference HF checkpoint directory.")],
    out: Annotated[Path, typer.Option("--out", "-o", help="Golden directory to write.")],
    max_new_tokens: Annotated[int, typer.Option("--max-new-tokens", min=1)] = 16,
    top_n: Annotated[int, typer.Option("--top-n", min=1, help="Logprobs kept per generated token.")] = 20,
    long_budget_s: Annotated[float, typer.Option("--long-budget-s", help="Time budget of the long-context "
                                                 "rungs (estimated per rung).")] = 60.0,
) -> None:
    """Dump the float32 CPU reference of MODEL (prompts, top-k logprobs, per-layer samples) into GOLDEN."""
    from adapt.validate.golden import dump_golden

    doc = dump_golden(model, out, max_new_tokens=max_new_tokens, top_n=top_n, long_budget_s=long_budget_s)
    err_console.print(f"wrote {out}/golden.json and tensors.safetensors: {len(doc['prompts'])} prompts, "
                      f"{doc['num_layers']} layers, long context {doc['long_context']['lengths']}",
                      markup=False, highlight=False)


def register(app: typer.Typer) -> None:
    app.add_typer(validate_app, name="validate")
