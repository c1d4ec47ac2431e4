"""Run a function in real processes on gloo (the trainer's distributed tests).

``spawn(fn, world, tmp_dir, *args)`` starts ``world`` processes, initialises a gloo process group
from a rendezvous file in ``tmp_dir`` and calls ``fn(rank, world, tmp_dir, *args)`` in each; ``fn``
must be a module-level function. Results travel through files under ``tmp_dir``.
"""
from __future__ import annotations

import os
import sys
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _entry(rank: int, fn: Callable[..., Any], world: int, tmp_dir: str, args: tuple) -> None:
    if REPO not in sys.path:
        sys.path.insert(0, REPO)
    torch.set_num_threads(1)  # the processes share a couple of cores
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    dist.init_process_group("gloo", init_method=f"file://{tmp_dir}/rendezvous", rank=rank, world_size=world)
    try:
        fn(rank, world, tmp_dir, *args)
    finally:
        dist.destroy_process_group()


def spawn(fn: Callable[..., Any], world: int, tmp_dir: str, *args: Any) -> None:
    os.makedirs(tmp_dir, exist_ok=True)
    mp.spawn(_entry, args=(fn, world, str(tmp_dir), args), nprocs=world, join=True)
