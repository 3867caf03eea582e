"""Launch: ``adapt run SHARDS --nproc N`` starts torchrun; inside torchrun each process is one rank.

``launch(argv, nproc)`` runs torchrun's own entry (``torch.distributed.run``, the code behind
``python -m torch.distributed.run``) in this process with ``--nproc-per-node N -m adapt <argv>``,
where argv is the same command line minus ``--nproc`` and the launcher flags. Multi-node jobs pass
torchrun's rendezvous flags through (``torchrun_args``: --nnodes, --node-rank, --rdzv-endpoint, ...).
A child failure comes back as DistributedError naming the root-cause rank (see faults.py).
"""

from __future__ import annotations

import os
import sys
from typing import Sequence

from adapt.errors import DistributedError

from .faults import describe_failure

# adapt run options that belong to the launcher (stripped from the ranks' command line), with arity
LAUNCHER_FLAGS: dict[str, int] = {"--nproc": 1, "--nnodes": 1, "--node-rank": 1, "--rdzv-endpoint": 1,
                                  "--rdzv-backend": 1, "--rdzv-id": 1, "--master-addr": 1, "--master-port": 1}


def in_launcher() -> bool:
    """True inside a rank started by torchrun (or any launcher that sets RANK and WORLD_SIZE)."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def strip_launcher_flags(argv: Sequence[str]) -> tuple[list[str], list[str]]:
    """(argv for the ranks, torchrun flags) from an adapt command line; --nproc is dropped from both."""
    rest, launcher = [], []
    it = iter(argv)
    for a in it:
        name = a.split("=", 1)[0]
        if name in LAUNCHER_FLAGS:
            value = a.split("=", 1)[1] if "=" in a else next(it, "")
            if name != "--nproc":
                launcher += [name, value]
            continue
        rest.append(a)
    return rest, launcher


def torchrun_argv(argv: Sequence[str], nproc: int, torchrun_args: Sequence[str] = (), module: str = "adapt"
                  ) -> list[str]:
    """torchrun's command line for ``python -m <module> <argv>`` (default ``adapt``) on nproc local ranks."""
    rest, launcher = strip_launcher_flags(argv)
    return ["--nproc-per-node", str(nproc), *launcher, *torchrun_args, "-m", module, *rest]


def launch(argv: Sequence[str], nproc: int, torchrun_args: Sequence[str] = (), module: str = "adapt") -> int:
    """Run ``python -m <module> <argv>`` (default ``adapt <argv>``) on nproc ranks under torchrun; 0 on
    success, else DistributedError."""
    if in_launcher():
        raise DistributedError("--nproc given inside a launched rank (RANK is set): run `adapt run` without "
                               "--nproc under torchrun")
    if nproc < 1:
        raise DistributedError(f"--nproc must be at least 1, got {nproc}")
    from torch.distributed import run as torchrun
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    os.environ.setdefault("OMP_NUM_THREADS", "1")  # torchrun's own default, said once, without the warning
    args = torchrun.parse_args(torchrun_argv(argv, nproc, torchrun_args, module))
    try:
        torchrun.run(args)
    except ChildFailedError as e:
        raise DistributedError(describe_failure(e)) from None
    return 0


def maybe_launch(argv: Sequence[str] | None, nproc: int | None) -> int | None:
    """For ``adapt run``: with --nproc N (N > 1, outside a launcher) start torchrun and return its exit
    code; otherwise None, and the caller goes on as this process (one rank, or the only one).
    ``argv`` is the adapt command line after the program name (default ``sys.argv[1:]``)."""
    if not nproc or in_launcher():
        return None
    if nproc == 1 and not any(a.split("=", 1)[0] in LAUNCHER_FLAGS and a.split("=", 1)[0] != "--nproc"
                              for a in (argv or [])):
        return None
    return launch(list(sys.argv[1:] if argv is None else argv), nproc)
