"""Run a function on W real processes with a gloo process group (tests, the byte-count check).

``run_distributed(fn, world_size, *args)`` starts W spawned processes set up as ``torchrun``
would (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT`` on a free port),
calls :func:`fastmoe_xpu.dist.init_distributed` in each, then ``fn(*args)``, and returns the W
return values in rank order. A process that raises, dies or outlives ``timeout_s`` makes it raise
with that rank's traceback; leftover processes are terminated. ``context`` swaps the start method
(a ``forkserver`` context that preloads torch saves each process seconds of imports).
"""
from __future__ import annotations

import importlib
import os
import pickle
import queue as queue_mod
import socket
import time
import traceback
from datetime import timedelta
from typing import Any, Callable

import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, world: int, port: int, target: tuple[str, str], args: tuple, env: dict, result_q, comm_timeout_s: float) -> None:
    # Environment first: some variables (TRITON_INTERPRET) must be set before their module imports.
    os.environ.update(env)
    os.environ.update(
        RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
    )
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    if any(k.startswith("FASTMOE_") for k in env):
        # A preloaded server process may have read the switches already: read them again.
        from .. import settings

        settings.reload()
    try:
        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)
        from fastmoe_xpu.dist.env import init_distributed

        init_distributed(backend="gloo", device_type="cpu", timeout=timedelta(seconds=comm_timeout_s))
        module_name, qualname = target
        fn: Any = importlib.import_module(module_name)
        for part in qualname.split("."):
            fn = getattr(fn, part)
        value = fn(*args)
        result_q.put((rank, True, pickle.dumps(value)))
        dist.barrier()
        dist.destroy_process_group()
    except BaseException:
        result_q.put((rank, False, traceback.format_exc()))


def run_distributed(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    env: dict[str, str] | None = None,
    timeout_s: float = 240.0,
    comm_timeout_s: float = 60.0,
    context: Any = None,
    fail_fast: bool = False,
) -> list[Any]:
    """``fn(*args)`` on ``world_size`` gloo processes; returns their results in rank order.

    ``fn`` must be importable by name (a module-level function). ``env`` is set in each child
    before anything else is imported there. ``context``: a multiprocessing context (default
    ``spawn``). ``fail_fast``: raise at the first failed rank instead of waiting for the others'
    results (they are usually stuck in a collective with it).
    """
    ctx = context if context is not None else mp.get_context("spawn")
    result_q = ctx.Queue()
    port = free_port()
    target = (fn.__module__, fn.__qualname__)
    procs = [
        ctx.Process(
            target=_entry,
            args=(r, world_size, port, target, args, dict(env or {}), result_q, comm_timeout_s),
            daemon=True,
        )
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    failures: dict[int, str] = {}
    deadline = time.monotonic() + timeout_s
    try:
        while len(results) + len(failures) < world_size:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                missing = sorted(set(range(world_size)) - set(results) - set(failures))
                raise TimeoutError(f"run_distributed: ranks {missing} gave no result within {timeout_s:.0f} s")
            try:
                rank, ok, payload = result_q.get(timeout=min(remaining, 1.0))
            except queue_mod.Empty:
                dead = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0) and r not in results and r not in failures]
                for r in dead:
                    failures[r] = f"process exited with code {procs[r].exitcode} before reporting"
                continue
            if ok:
                results[rank] = pickle.loads(payload)
            else:
                failures[rank] = payload
            if failures and fail_fast:
                break
        for p in procs:
            p.join(timeout=max(min(deadline - time.monotonic(), 30.0) if fail_fast else deadline - time.monotonic(), 1.0))
    finally:
        for p in procs:
            if p.is_alive():
                p.terminate()
                p.join(5)
    if failures:
        detail = "\n".join(f"--- rank {r} ---\n{tb}" for r, tb in sorted(failures.items()))
        raise RuntimeError(f"run_distributed: {len(failures)} of {world_size} ranks failed\n{detail}")
    return [results[r] for r in range(world_size)]
