"""Run a function on N forked gloo ranks (no re-import of torch per rank, so it is cheap on 2 cores)."""

from __future__ import annotations

import os
import pickle
import socket
import tempfile
from pathlib import Path

import torch
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, fn, world: int, port: int, out: str, args: tuple) -> None:
    import torch.distributed as dist

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    torch.set_num_threads(1)
    result = fn(rank, world, *args)
    Path(out, f"{rank}.pkl").write_bytes(pickle.dumps(result))
    if dist.is_initialized():
        dist.destroy_process_group()


def spawn(fn, world: int, *args) -> list:
    """fn(rank, world, *args) on world forked processes with torchrun's env set; returns their results."""
    with tempfile.TemporaryDirectory() as out:
        mp.start_processes(_entry, args=(fn, world, free_port(), out, args), nprocs=world, join=True,
                           start_method="fork")
        return [pickle.loads(Path(out, f"{r}.pkl").read_bytes()) for r in range(world)]
