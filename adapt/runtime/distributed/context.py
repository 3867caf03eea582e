"""DistributedContext: ParallelContext over torch.distributed, with groups from the plan's rank map.

Every rank creates every group (tp, stage, pp, dp, in that order; see ``group_ranks``), as
``torch.distributed.new_group`` requires. Groups of one rank are never created: their collectives are
the identity and move no bytes. Every collective counts the bytes this rank sends, by the planner's
convention (adapt.profile.planner.comm): ring all-reduce ``2(n-1)/n x size``, all-gather ``(n-1) x
local size``, all-to-all the rows sent to other ranks, send the tensor; under ``"<collective>.<group>"``,
cumulatively in ``bytes_by_collective`` and per engine step (``step``). The count exchange before an
all-to-all is control traffic and not counted.
A collective that fails or passes ``timeout_s`` raises DistributedError naming the rank, the
collective and the group's ranks.
"""

from __future__ import annotations

import datetime
import math
import os
import re
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from adapt.errors import DistributedError
from adapt.plan import ParallelPlan
from adapt.runtime.parallel import ParallelContext

from .backends import device_type, resolve_backend

GROUP_KINDS = ("tp", "stage", "pp", "dp")
DEFAULT_TIMEOUT_S = 300.0


def group_ranks(plan: ParallelPlan) -> dict[str, list[list[int]]]:
    """Every group of every kind as lists of global ranks, in the order all ranks create them."""
    tp, pp, dp = plan.tp, plan.pp, plan.dp

    def r(p: int, d: int, t: int) -> int:
        return (p * dp + d) * tp + t

    return {
        "tp": [[r(p, d, t) for t in range(tp)] for p in range(pp) for d in range(dp)],
        "stage": [[r(p, d, t) for d in range(dp) for t in range(tp)] for p in range(pp)],
        "pp": [[r(p, d, t) for p in range(pp)] for d in range(dp) for t in range(tp)],
        "dp": [[r(p, d, t) for d in range(dp)] for p in range(pp) for t in range(tp)],
    }


class PeerFailure(DistributedError):
    """A collective failed on this rank because a peer failed or timed out (collateral, not the cause)."""


@dataclass
class DistributedContext(ParallelContext):
    """The ParallelContext of one torch.distributed rank. Build with :func:`init_distributed`."""

    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    backend: str = "gloo"
    timeout_s: float = DEFAULT_TIMEOUT_S
    members: dict[str, list[int]] = field(default_factory=dict)  # this rank's group per kind
    groups: dict[str, Any] = field(default_factory=dict, repr=False)  # kind -> ProcessGroup (None: WORLD)
    steps: list[dict] = field(default_factory=list, repr=False)  # {kind, batch, bytes: {collective: n}}

    # -- groups and accounting ------------------------------------------------------------------
    def build_groups(self) -> None:
        """Create all groups of the plan, in the same order on every rank; keep this rank's."""
        assert self.plan is not None
        world = self.plan.world_size
        timeout = datetime.timedelta(seconds=self.timeout_s)
        for kind, lists in group_ranks(self.plan).items():
            for ranks in lists:
                if len(ranks) == 1:
                    pg = None
                elif len(ranks) == world:
                    pg = dist.group.WORLD
                else:
                    pg = dist.new_group(ranks, timeout=timeout)
                if self.rank in ranks:
                    self.members[kind] = ranks
                    self.groups[kind] = pg

    def group_size(self, group: str) -> int:
        return len(self._members(group))

    def group_rank(self, group: str) -> int:
        """This rank's index in its group of that kind."""
        return self._members(group).index(self.rank)

    def _members(self, group: str) -> list[int]:
        if group == "world":
            return list(range(self.world_size))
        try:
            return self.members[group]
        except KeyError:
            raise ValueError(f"unknown group {group!r} (one of {', '.join(GROUP_KINDS)}, world)") from None

    def _pg(self, group: str):
        return dist.group.WORLD if group == "world" else self.groups[group]

    def step(self, kind: str, batch: int = 0) -> None:
        """Start accounting a new engine step (``prefill`` / ``decode`` of ``batch`` sequences); counts go
        to it until the next."""
        self.steps.append({"kind": kind, "batch": batch, "bytes": {}})

    def count(self, name: str, t: torch.Tensor) -> None:
        self.account(name, t.numel() * t.element_size())

    def account(self, name: str, n: int) -> None:
        """Add n bytes sent to collective ``name`` (cumulative and current step)."""
        n = int(round(n))
        self.bytes_by_collective[name] = self.bytes_by_collective.get(name, 0) + n
        if self.steps:
            d = self.steps[-1]["bytes"]
            d[name] = d.get(name, 0) + n

    def _fail(self, op: str, group: str, e: BaseException) -> PeerFailure:
        why = str(e).splitlines()[0] if str(e) else type(e).__name__
        why = re.sub(r"^\[[^\]]*\] ", "", why).split(". This is typically")[0]  # gloo's source location
        return PeerFailure(f"rank {self.rank}: {op} over {group} group (ranks {self._members(group)}) "
                           f"failed: {why} "
                           f"(a peer failed, or the collective passed --dist-timeout {self.timeout_s:g} s)")

    # -- collectives ----------------------------------------------------------------------------
    def all_reduce(self, x: torch.Tensor, group: str = "tp") -> torch.Tensor:
        if self.group_size(group) == 1:
            return x
        y = x.contiguous()
        n = self.group_size(group)
        self.account(f"all_reduce.{group}", 2 * (n - 1) / n * y.numel() * y.element_size())
        try:
            dist.all_reduce(y, group=self._pg(group))
        except RuntimeError as e:
            raise self._fail("all_reduce", group, e) from e
        return y

    def all_gather(self, x: torch.Tensor, dim: int = -1, group: str = "tp") -> torch.Tensor:
        n = self.group_size(group)
        if n == 1:
            return x
        y = x.contiguous()
        self.account(f"all_gather.{group}", (n - 1) * y.numel() * y.element_size())
        outs = [torch.empty_like(y) for _ in range(n)]
        try:
            dist.all_gather(outs, y, group=self._pg(group))
        except RuntimeError as e:
            raise self._fail("all_gather", group, e) from e
        return torch.cat(outs, dim=dim)

    def all_to_all(self, x: torch.Tensor, send_counts: list[int], group: str = "stage", tag: str = "all_to_all"
                   ) -> tuple[torch.Tensor, list[int]]:
        """Rows of x (dim 0) in order of destination, send_counts[i] rows to the group's i-th rank.
        Counts are exchanged first (all_to_all of one int64 per peer), then the rows; the bytes go to
        ``"<tag>.<group>"`` (routing metadata uses its own tag so that data bytes compare with the plan)."""
        n = self.group_size(group)
        if n == 1:
            return x, list(send_counts)
        if len(send_counts) != n or sum(send_counts) != x.shape[0]:
            raise ValueError(f"all_to_all: send_counts {send_counts} must have {n} entries summing to "
                             f"x.shape[0] = {x.shape[0]}")
        pg = self._pg(group)
        send_t = torch.tensor(send_counts, dtype=torch.int64, device=self.device)
        recv_t = torch.empty_like(send_t)
        y = x.contiguous()
        try:
            dist.all_to_all_single(recv_t, send_t, group=pg)
            recv_counts = [int(c) for c in recv_t.tolist()]
            out = y.new_empty((sum(recv_counts), *y.shape[1:]))
            row = math.prod(y.shape[1:]) * y.element_size()
            self.account(f"{tag}.{group}", (sum(send_counts) - send_counts[self.group_rank(group)]) * row)
            dist.all_to_all_single(out, y, recv_counts, list(send_counts), group=pg)
        except RuntimeError as e:
            raise self._fail("all_to_all", group, e) from e
        return out, recv_counts

    def stage_peer(self, stage: int) -> int:
        """Global rank of the rank with this rank's (dp, tp) coordinates in pipeline stage ``stage``."""
        return (stage * self.dp_size + self.dp_rank) * self.tp_size + self.tp_rank

    def send(self, x: torch.Tensor, dst_stage: int) -> None:
        y = x.contiguous()
        self.count("send.pp", y)
        try:
            dist.send(y, self.stage_peer(dst_stage))
        except RuntimeError as e:
            raise self._fail(f"send to stage {dst_stage}", "pp", e) from e

    def recv(self, shape: tuple[int, ...], dtype: torch.dtype, src_stage: int) -> torch.Tensor:
        buf = torch.empty(shape, dtype=dtype, device=self.device)
        try:
            dist.recv(buf, self.stage_peer(src_stage))
        except RuntimeError as e:
            raise self._fail(f"recv from stage {src_stage}", "pp", e) from e
        return buf

    def broadcast(self, x: torch.Tensor, src: int, group: str = "world") -> torch.Tensor:
        """Broadcast a tensor from global rank ``src`` of the group (x is filled in place elsewhere)."""
        if self.group_size(group) == 1:
            return x
        if self.rank == src:
            self.count(f"broadcast.{group}", x)
        try:
            dist.broadcast(x, src, group=self._pg(group))
        except RuntimeError as e:
            raise self._fail("broadcast", group, e) from e
        return x

    def any_work(self, mine: bool, group: str = "stage") -> bool:
        """Whether any rank of the group has work this step (an all-reduce of one flag; control plane,
        not counted). dp replicas that share the stage's experts call it before every step, in lockstep."""
        if self.group_size(group) == 1:
            return mine
        flag = torch.tensor([1 if mine else 0], dtype=torch.int64, device=self.device)
        try:
            dist.all_reduce(flag, group=self._pg(group))
        except RuntimeError as e:
            raise self._fail("all_reduce (has work)", group, e) from e
        return int(flag.item()) > 0

    def broadcast_object(self, obj, src: int = 0):
        """A picklable object from global rank ``src`` to every rank (control plane, not counted)."""
        if self.world_size == 1:
            return obj
        box = [obj]
        try:
            dist.broadcast_object_list(box, src=src, device=self.device if self.backend != "gloo" else None)
        except RuntimeError as e:
            raise self._fail("broadcast_object", "world", e) from e
        return box[0]

    def barrier(self) -> None:
        if self.world_size == 1:
            return
        try:
            dist.barrier()
        except RuntimeError as e:
            raise self._fail("barrier", "world", e) from e


def env_rank() -> tuple[int, int, int] | None:
    """(rank, world_size, local_rank) from torchrun's environment, or None outside a launcher."""
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        return None
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    return rank, world, int(os.environ.get("LOCAL_RANK", rank))


def rank_device(device: str, local_rank: int) -> torch.device:
    """'cuda' on local rank 3 -> cuda:3; an explicit index or cpu is kept."""
    kind = device_type(device)
    if kind == "cpu" or ":" in str(device):
        return torch.device(device)
    dev = torch.device(kind, local_rank)
    mod = getattr(torch, kind, None)
    if mod is not None and hasattr(mod, "set_device"):
        mod.set_device(dev)
    return dev


def init_distributed(plan: ParallelPlan, device: str = "cpu", backend: str | None = None,
                     timeout_s: float = DEFAULT_TIMEOUT_S, rank: int | None = None,
                     world_size: int | None = None, init_method: str | None = None) -> DistributedContext:
    """Join the process group (torchrun's env:// unless init_method) and build the plan's groups.

    Raises DistributedError when the launcher's world size is not the plan's."""
    env = env_rank()
    if rank is None or world_size is None:
        if env is None:
            raise DistributedError("not started by a launcher: RANK and WORLD_SIZE are unset (use "
                                   "`adapt run ... --nproc N` or `torchrun --nproc-per-node N -m adapt run ...`)")
        rank, world_size, local_rank = env
    else:
        local_rank = env[2] if env else rank
    if world_size != plan.world_size:
        raise DistributedError(f"rank {rank}: the launcher started {world_size} ranks but the plan "
                               f"{plan.label()} needs tp*pp*dp = {plan.tp}*{plan.pp}*{plan.dp} = {plan.world_size}")
    name = resolve_backend(device, backend)
    dev = rank_device(device, local_rank)
    if not dist.is_initialized():
        dist.init_process_group(name, init_method=init_method, rank=rank, world_size=world_size,
                                timeout=datetime.timedelta(seconds=timeout_s))
    ctx = DistributedContext.for_rank(plan, rank, device=dev, backend=name, timeout_s=timeout_s)
    ctx.build_groups()
    return ctx


def shutdown() -> None:
    """Leave the process group (after a clean run only: a failed rank exits without it)."""
    if dist.is_initialized():
        dist.destroy_process_group()
