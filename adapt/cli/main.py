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
from adapt.cli.missing import missing_package_line
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


_MODULES: list[str] | None = None  # the command modules of this package (pkgutil), found once
_registered: set[str] = set()


def _command_modules() -> list[str]:
    global _MODULES
    if _MODULES is None:
        import adapt.cli as pkg

        _MODULES = sorted(m.name for m in pkgutil.iter_modules(pkg.__path__)
                          if m.name not in ("main", "options", "output") and not m.name.startswith("_"))
    return _MODULES


def _register(names: list[str]) -> None:
    for name in names:
        if name in _registered:
            continue
        _registered.add(name)
        register = getattr(importlib.import_module(f"adapt.cli.{name}"), "register", None)
        if register is not None:
            register(app)


def _commands() -> set[str]:
    return ({c.name for c in app.registered_commands} | {g.name for g in app.registered_groups}) - {None}


def _register_for(argv: list[str]) -> None:
    """Register what ``argv`` runs: the module named like its command (``init-model`` is init_model.py) when
    that module provides it, else every command module (``adapt --help``, an unknown command). Importing
    every command file and building all their parameters cost 0.1 s of each run's start."""
    word = next((a for a in argv if not a.startswith("-")), None)
    mod = word.replace("-", "_") if word else None
    if mod in _command_modules():
        _register([mod])
        if word in _commands():
            return
    _register(_command_modules())


def _debug() -> bool:
    return os.environ.get("ADAPT_DEBUG", "") not in ("", "0")


def _internal_error(e: BaseException) -> None:
    print(f"internal error: {type(e).__name__}: {e} (set ADAPT_DEBUG=1 for the traceback)", file=sys.stderr)
    sys.exit(1)


def main(argv: list[str] | None = None) -> None:
    """Entry point of the console script and of ``python -m adapt``."""
    args = sys.argv[1:] if argv is None else list(argv)
    try:
        _register_for(args)
        rv = app(args=args, prog_name="adapt", standalone_mode=False)
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
    except ModuleNotFoundError as e:  # a package this environment lacks: name it and how to install it
        line = missing_package_line(e)
        if _debug():
            raise
        if line is None:
            _internal_error(e)
        print(f"error: {line}", file=sys.stderr)
        sys.exit(1)
    except Exception as e:  # an internal bug: still one line unless debugging
        if _debug():
            raise
        _internal_error(e)
    if isinstance(rv, int) and rv:
        sys.exit(rv)
