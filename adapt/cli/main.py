"""The `adapt` command: one typer app; each command lives in its own file under adapt/cli/.

Every file in this package that defines ``register(app)`` adds its commands, so a stage's command is
added without touching this file. Errors a user can cause (AdaptError) become one line on stderr and
a non-zero exit; ``ADAPT_DEBUG=1`` shows the traceback instead.
"""

from __future__ import annotations

import importlib
import os
import pkgutil
import sys

import typer

try:  # typer >= 0.26 carries its own copy of click: its parser raises that copy's exceptions, not click's
    from typer._click import exceptions as cx
except ImportError:  # pragma: no cover
    from click import exceptions as cx

# what the parser raises for a usage error (unknown option, bad value, missing argument), to exit and to abort;
# the copy has no Exit / Abort of its own (typer's are raised instead)
_USAGE = cx.ClickException
_EXIT = tuple({typer.Exit, getattr(cx, "Exit", typer.Exit)})
_ABORT = tuple({typer.Abort, getattr(cx, "Abort", typer.Abort)})

from adapt import __version__
from adapt.errors import AdaptError

app = typer.Typer(
    name="adapt",
    help="Day-0 bring-up of very large language models on new accelerators: profile, plan, shard, run, "
    "serve, validate, day0.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode="rich",
)


def _version(value: bool) -> None:
    if value:
        typer.echo(f"adapt {__version__}")
        raise typer.Exit()


@app.callback()
def _root(version: bool = typer.Option(False, "--version", callback=_version, is_eager=True,
                                       help="Print the version and exit.")) -> None:
    """adapt: profile / plan / shard / run / serve / validate / day0."""


def _register_commands() -> None:
    import adapt.cli as pkg

    for mod in sorted(pkgutil.iter_modules(pkg.__path__), key=lambda m: m.name):
        if mod.name in ("main", "options", "output") or mod.name.startswith("_"):
            continue
        module = importlib.import_module(f"adapt.cli.{mod.name}")
        register = getattr(module, "register", None)
        if register is not None:
            register(app)


_register_commands()


def _debug() -> bool:
    return os.environ.get("ADAPT_DEBUG", "") not in ("", "0")


def main(argv: list[str] | None = None) -> None:
    """Entry point of the console script and of ``python -m adapt``."""
    try:
        rv = app(args=argv, prog_name="adapt", standalone_mode=False)
    except AdaptError as e:
        if _debug():
            raise
        print(f"error: {e}", file=sys.stderr)
        sys.exit(e.exit_code)
    except _EXIT as e:
        sys.exit(e.exit_code)
    except _ABORT:
        print("aborted", file=sys.stderr)
        sys.exit(130)
    except _USAGE as e:  # one line too, pointing at the command's help; exit 2
        ctx = getattr(e, "ctx", None)
        hint = f" (see '{ctx.command_path} --help')" if ctx is not None else ""
        print(f"error: {e.format_message()}{hint}", file=sys.stderr)
        sys.exit(e.exit_code)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        sys.exit(130)
    except BrokenPipeError:
        sys.exit(1)
    except Exception as e:  # an internal bug: still one line unless debugging
        if _debug():
            raise
        print(f"internal error: {type(e).__name__}: {e} (set ADAPT_DEBUG=1 for the traceback)", file=sys.stderr)
        sys.exit(1)
    if isinstance(rv, int) and rv:
        sys.exit(rv)
