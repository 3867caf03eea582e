"""Fault handling: a failing rank says ``rank N: <cause>`` and exits non-zero at once; never a hang.

How a failure ends every rank in bounded time:
  * the failing rank prints ``rank N: <cause>`` to stderr, writes it to torchrun's error file
    (TORCHELASTIC_ERROR_FILE) and leaves with ``os._exit`` (no process-group teardown that could block);
  * torchrun's agent sees a child exit non-zero or die by a signal within ``--monitor-interval`` and
    terminates the other ranks of the job;
  * a rank blocked in a collective whose peer vanished gets a gloo/nccl error, or at worst the
    ``--dist-timeout`` collective timeout, and fails the same way (as a PeerFailure: collateral).
``describe_failure`` turns torchrun's ChildFailedError into one message naming the root-cause rank.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from contextlib import contextmanager
from typing import Iterator

from adapt.errors import AdaptError

from .context import PeerFailure


def rank_label() -> str:
    return os.environ.get("RANK", "?")


def cause(e: BaseException) -> str:
    """One line: the AdaptError's message, or the exception type and message."""
    msg = str(e).strip().splitlines()[0] if str(e).strip() else ""
    if isinstance(e, AdaptError):
        return msg or type(e).__name__
    return f"{type(e).__name__}: {msg}" if msg else type(e).__name__


def report(e: BaseException) -> str:
    """Print ``rank N: cause`` to stderr and record it in torchrun's error file; returns the line."""
    rank = rank_label()
    line = cause(e)
    if not line.startswith(f"rank {rank}:"):
        line = f"rank {rank}: {line}"
    print(line, file=sys.stderr, flush=True)
    if os.environ.get("ADAPT_DEBUG", "") not in ("", "0"):
        traceback.print_exception(e, file=sys.stderr)
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if path:
        data = {"message": {"message": line, "extraInfo": {
            "py_callstack": "".join(traceback.format_exception(e)), "timestamp": str(int(time.time())),
            "adapt_collateral": isinstance(e, PeerFailure), "adapt_time": time.time()}}}
        try:
            with open(path, "w") as fp:
                json.dump(data, fp)
        except OSError:
            pass
    return line


@contextmanager
def rank_guard() -> Iterator[None]:
    """Run a rank's work; on any failure report it and exit at once (1, or 130 on Ctrl-C)."""
    try:
        yield
    except SystemExit as e:
        if e.code in (0, None):
            raise
        sys.stderr.flush()
        sys.stdout.flush()
        os._exit(e.code if isinstance(e.code, int) else 1)
    except BaseException as e:  # noqa: BLE001 - every failure of a rank ends the job
        report(e)
        sys.stdout.flush()
        os._exit(130 if isinstance(e, KeyboardInterrupt) else 1)


def describe_failure(err) -> str:
    """torchrun's ChildFailedError -> 'rank N: cause' for the root cause (collateral failures last)."""
    lines = []
    for rank, f in sorted(err.failures.items(), key=lambda kv: _order(kv[1])):
        msg = f.message
        if isinstance(msg, dict):
            msg = msg.get("message", "")
        if f.exitcode < 0 and not isinstance(f.message, dict):
            msg = f"killed by {f.signal_name()} (exit code {f.exitcode}, pid {f.pid})"
        elif not msg or "To enable traceback" in str(msg):
            msg = (f"killed by {f.signal_name()} (exit code {f.exitcode})" if f.exitcode < 0
                   else f"exited with code {f.exitcode}")
        msg = str(msg)
        lines.append(msg if msg.startswith(f"rank {rank}:") else f"rank {rank}: {msg}")
    if not lines:
        return f"{err}"
    extra = f" (then: {'; '.join(lines[1:])})" if len(lines) > 1 else ""
    return f"{lines[0]}{extra}"


def _order(f) -> tuple[int, float]:
    info = f.error_file_data.get("message", {}) if isinstance(f.error_file_data, dict) else {}
    extra = info.get("extraInfo", {}) if isinstance(info, dict) else {}
    collateral = 1 if extra.get("adapt_collateral") else 0
    return collateral, float(extra.get("adapt_time", f.timestamp))
