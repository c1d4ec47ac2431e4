"""Asynchronous full checkpoints: the state is copied into host memory while the step loop waits
(pinned buffers under an accelerator), then a background thread writes the slot with the same
files, manifest last and rename as a synchronous save, so the two-slot scheme holds: a crash
during the background write leaves the previous slot valid.

The background write's collectives (DCP's planning, the ranks' agreements) run on a process group
of their own (gloo, made once by every rank in the step loop), so they never interleave with the
training's collectives on the default group; every collective on it times out (``timeout_s``), and
every wait for the thread is bounded by the same figure. One write at a time: a second checkpoint
(and the run's last one) first waits for the running write.
"""
from __future__ import annotations

import copy
import threading
import time
from datetime import timedelta
from typing import Any, Callable

import torch
import torch.distributed as dist

from fastmoe_xpu.dist.groups import dist_on

from .dcp_io import is_dtensor
from .slots import CheckpointError


def _host_copy(t: torch.Tensor) -> tuple[torch.Tensor, bool]:
    """``(host copy of the plain tensor t, whether it was copied without blocking from CUDA)``."""
    if t.device.type == "cpu":
        return t.clone(), False
    pinned = t.device.type == "cuda"
    host = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=pinned)
    return host.copy_(t, non_blocking=pinned), pinned


def stage(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Host copies of ``tensors`` that later training steps do not change: pinned and copied
    without blocking under CUDA (one synchronize at the end), plain clones on the CPU. A DTensor (an
    FSDP2 shard) stays a DTensor over the same mesh and placements with its local piece on the host,
    so the write records the same global shape and pieces as a synchronous one."""
    out: dict[str, torch.Tensor] = {}
    on_cuda = False
    for k, t in tensors.items():
        t = t.detach()
        if is_dtensor(t):
            from torch.distributed.tensor import DTensor

            local, pinned = _host_copy(t.to_local())
            out[k] = DTensor.from_local(local, t.device_mesh, t.placements, run_check=False, shape=t.shape,
                                        stride=t.stride())
        else:
            out[k], pinned = _host_copy(t)
        on_cuda = on_cuda or pinned
    if on_cuda:
        torch.cuda.synchronize()
    return out


def stage_bytes(tensors: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors.values())


class BackgroundWriter:
    """At most one checkpoint write running in a background thread; :meth:`wait` collects it."""

    def __init__(self, timeout_s: float = 1800.0) -> None:
        self.timeout_s = timeout_s
        self._thread: threading.Thread | None = None
        self._outcome: dict[str, Any] = {}
        self._group: Any = None

    def group(self) -> Any:
        """The background writes' own process group (None on one process); collective the first time."""
        if dist_on() and self._group is None:
            self._group = dist.new_group(backend="gloo", timeout=timedelta(seconds=self.timeout_s))
        return self._group

    @property
    def succeeded(self) -> bool:
        """A write was started and has ended without an error (:meth:`wait` returns at once). A
        failed one is left to the next :meth:`wait` that every rank makes at the same step (the
        next checkpoint, the run's end), so that all ranks raise the error at the same point."""
        return self._thread is not None and not self._thread.is_alive() and "error" not in self._outcome

    def start(self, write: Callable[[], Any]) -> None:
        if self._thread is not None:
            raise RuntimeError("a background checkpoint write is still running: wait() for it first")
        outcome: dict[str, Any] = {"t0": time.perf_counter()}

        def run() -> None:
            try:
                outcome["result"] = write()
            except BaseException as e:  # handed to the step loop by wait()
                outcome["error"] = e
            outcome["seconds"] = time.perf_counter() - outcome["t0"]

        self._outcome = outcome
        self._thread = threading.Thread(target=run, name="checkpoint-writer", daemon=True)
        self._thread.start()

    def wait(self) -> tuple[Any, float, float]:
        """``(result, seconds waited, seconds the write took)`` of the running write (``(None, 0, 0)``
        when none runs); its error is raised here, in the step loop."""
        if self._thread is None:
            return None, 0.0, 0.0
        t0 = time.perf_counter()
        self._thread.join(self.timeout_s)
        waited = time.perf_counter() - t0
        if self._thread.is_alive():
            raise CheckpointError(f"the background checkpoint write did not finish within {self.timeout_s:.0f}s")
        self._thread = None
        out = self._outcome
        if "error" in out:
            raise out["error"]
        return out["result"], waited, out["seconds"]


def frozen(obj: Any) -> Any:
    """A deep copy of the save's metadata and per-rank extras, so later steps cannot change them."""
    return copy.deepcopy(obj)
