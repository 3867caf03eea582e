"""Multi-rank runtime on torch.distributed: groups from the plan's rank map, collectives with byte
accounting, a backend registry by device, torchrun launch and fault handling."""

from .backends import BACKENDS, backend_for
from .context import DistributedContext, PeerFailure, group_ranks, init_distributed, shutdown
from .faults import rank_guard
from .launch import in_launcher, launch, maybe_launch
from .layout import LayoutRun, run_layout, run_layout_logits

__all__ = ["BACKENDS", "backend_for", "DistributedContext", "PeerFailure", "group_ranks", "init_distributed",
           "shutdown", "rank_guard", "in_launcher", "launch", "maybe_launch",
           "LayoutRun", "run_layout", "run_layout_logits"]
