"""ParallelContext: what a model layer needs to know about parallelism.

A model is built for one rank of a ParallelPlan. Layers read their sizes from the context (``tp_size``,
``experts``, ``layers``) and call its collectives; the single-rank context makes every collective the
identity, so the same model code runs on one device or many. ``adapt.runtime.distributed`` provides the
torch.distributed implementation with process groups built from the plan's rank map.

Groups:
  tp     ranks of one (pp stage, dp replica): attention heads, dense MLP, vocab splits
  stage  all tp x dp ranks of one pp stage: expert parallelism and MoE combine
  pp     ranks with the same (dp, tp) coordinates across stages: send/recv of hidden states
  dp     ranks with the same (pp, tp) coordinates across replicas
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from adapt.plan import ParallelPlan


@dataclass
class ParallelContext:
    """A world of one rank. Subclasses override the collectives."""

    plan: ParallelPlan | None = None
    rank: int = 0
    tp_rank: int = 0
    tp_size: int = 1
    pp_rank: int = 0
    pp_size: int = 1
    dp_rank: int = 0
    dp_size: int = 1
    ep_rank: int = 0
    ep_size: int = 1
    layers: tuple[int, int] | None = None  # [start, stop) of this rank's decoder layers; None: all
    experts: tuple[int, ...] | None = None  # routed experts this rank holds; None: all
    bytes_by_collective: dict[str, int] = field(default_factory=dict)

    @classmethod
    def for_rank(cls, plan: ParallelPlan, rank: int, **kw) -> "ParallelContext":
        info = plan.rank_info(rank)
        return cls(plan=plan, rank=rank, tp_rank=info.tp, tp_size=plan.tp, pp_rank=info.pp, pp_size=plan.pp,
                   dp_rank=info.dp, dp_size=plan.dp, ep_rank=info.ep, ep_size=plan.ep, layers=info.layers,
                   experts=info.experts if plan.num_experts else None, **kw)

    @property
    def world_size(self) -> int:
        return self.tp_size * self.pp_size * self.dp_size

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1

    @property
    def is_driver(self) -> bool:
        """The rank that prints and returns results (global rank 0)."""
        return self.rank == 0

    def count(self, name: str, t: torch.Tensor) -> None:
        """Account the bytes a collective moves from this rank (for the planner comparison)."""
        self.bytes_by_collective[name] = self.bytes_by_collective.get(name, 0) + t.numel() * t.element_size()

    # Collectives: identity in a world of one.
    def all_reduce(self, x: torch.Tensor, group: str = "tp") -> torch.Tensor:
        return x

    def all_gather(self, x: torch.Tensor, dim: int = -1, group: str = "tp") -> torch.Tensor:
        return x

    def all_to_all(self, x: torch.Tensor, send_counts: list[int], group: str = "stage"
                   ) -> tuple[torch.Tensor, list[int]]:
        """Send ``x`` split along dim 0 by send_counts to the group's ranks; returns (received, recv_counts)."""
        return x, list(send_counts)

    def send(self, x: torch.Tensor, dst_stage: int) -> None:
        raise RuntimeError("send needs a distributed context")

    def recv(self, shape: tuple[int, ...], dtype: torch.dtype, src_stage: int) -> torch.Tensor:
        raise RuntimeError("recv needs a distributed context")

    def broadcast_object(self, obj, src: int = 0):
        return obj

    def barrier(self) -> None:
        return None


SINGLE = ParallelContext()
