"""The trainer's checkpoints: periodic full-state ones in alternating slots, persistent model-only
ones, and resuming from the newest valid slot with every damaged one reported."""
from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any, Callable

import torch.distributed as dist
import torch.nn as nn

from fastmoe_xpu.dist.groups import dist_on
from fastmoe_xpu.dist.sharding import is_expert_weight

from ..ft.fault import FAILURES_FILE, append_jsonl
from .background import BackgroundWriter, frozen, stage
from .dcp_io import broadcast_object
from .restore import NoValidCheckpoint, RestoreResult, choose_slot, find_latest, restore_full
from .save import FullWrite, SaveStats, save_full, save_model
from .slots import CheckpointError, CheckpointInfo

class CheckpointManager:
    """Periodic full checkpoints in alternating slots plus persistent model-only ones.

    ``interval``: full checkpoint every this many steps (0: never); ``model_interval``: model-only
    checkpoint every this many steps (0: never), cast to ``model_dtype`` (None: parameter dtype);
    ``async_save``: full checkpoints are staged in host memory and written in the background
    (:mod:`.background`), at most one at a time, each wait bounded by ``async_timeout_s``.

    ``timings``: one record per full checkpoint, ``{"step", "async", "stall_s", "write_s"}``: the
    seconds the caller waited and the seconds the write took (an asynchronous one's once collected)."""

    def __init__(self, root: str | os.PathLike, *, layout: Any = None, interval: int = 0, model_interval: int = 0,
                 model_dtype: str | None = "bf16", is_expert: Callable[[str], bool] = is_expert_weight,
                 allow_fresh_start: bool = False, failures_dir: str | os.PathLike | None = None,
                 async_save: bool = False, async_timeout_s: float = 1800.0) -> None:
        if interval < 0 or model_interval < 0:
            raise ValueError(f"checkpoint intervals must be >= 0, got {interval} and {model_interval}")
        self.root = Path(root)
        self.allow_fresh_start = allow_fresh_start
        self.failures_dir = Path(failures_dir) if failures_dir is not None else self.root.parent
        self.layout = layout
        self.interval = interval
        self.model_interval = model_interval
        self.model_dtype = model_dtype
        self.is_expert = is_expert
        self.last_index: int | None = None
        self.last: CheckpointInfo | None = None
        self.background = BackgroundWriter(async_timeout_s) if async_save else None
        self._pending: tuple[int, dict[str, Any]] | None = None  # (index, timing) of the running write
        self.timings: list[dict[str, Any]] = []
        self._fields: dict[str, Any] = {}  # for the step's metrics record: pop_fields()

    def latest(self) -> CheckpointInfo | None:
        info = find_latest(self.root)
        if info is not None:
            self.last, self.last_index = info, info.index
        return info

    def due(self, step: int) -> bool:
        return self.interval > 0 and step > 0 and step % self.interval == 0

    def model_due(self, step: int) -> bool:
        return self.model_interval > 0 and step > 0 and step % self.model_interval == 0

    def save(self, step: int, model: nn.Module, optimizer: Any, *, meta: dict[str, Any] | None = None,
             rank_extra: Any = None, background: bool | None = None) -> SaveStats:
        """A full checkpoint of ``step`` (collective), in the background when this manager is
        asynchronous (unless ``background=False``: the run's last checkpoint); a running background
        write is waited for first. An asynchronous save returns once the state is staged: its
        ``seconds`` is the stall, its byte counts are 0 until :meth:`wait` collects the write."""
        t0 = time.perf_counter()
        self.wait()
        if self.last_index is None:
            # never overwrite the newest valid slot, even in a run that did not resume from it
            self.latest()
        index = 0 if self.last_index is None else self.last_index + 1
        timing: dict[str, Any] = {"step": step, "async": False}
        if self.background is not None and background is not False:
            def staged(w: FullWrite) -> Callable[[], SaveStats]:
                w.tensors, w.rank_state, w.meta = stage(w.tensors), frozen(w.rank_state), frozen(w.meta)
                group = self.background.group()
                return lambda: w.write(group)

            write = save_full(self.root, step=step, index=index, model=model, optimizer=optimizer,
                              layout=self.layout, meta=meta, rank_extra=rank_extra, is_expert=self.is_expert,
                              staged=staged)
            self.background.start(write)
            self._pending = (index, timing)
            timing.update({"async": True, "stall_s": time.perf_counter() - t0})
            self.timings.append(timing)
            self._fields.update(checkpoint_stall_s=timing["stall_s"], checkpoint_async=True)
            return SaveStats(path=self.root / f"slot-{'AB'[index % 2]}", step=step, seconds=timing["stall_s"],
                             rank_bytes=0, total_bytes=0)
        try:
            stats = save_full(self.root, step=step, index=index, model=model, optimizer=optimizer, layout=self.layout,
                              meta=meta, rank_extra=rank_extra, is_expert=self.is_expert)
        except CheckpointError as e:
            raise self._failed(e) from e
        self._done(index, stats)
        timing.update({"stall_s": time.perf_counter() - t0, "write_s": stats.seconds})
        self.timings.append(timing)
        self._fields.update(checkpoint_stall_s=timing["stall_s"], checkpoint_async=False,
                            checkpoint_write_s=stats.seconds, checkpoint_write_step=step)
        return stats

    def poll(self) -> None:
        """Collect the background write if it has finished well (never waits, never raises)."""
        if self._pending is not None and self.background.succeeded:
            self.wait()

    def pop_fields(self) -> dict[str, Any]:
        """The checkpoint timings since the last call, for the step's metrics record:
        ``checkpoint_stall_s`` (the step loop's wait for the checkpoint of this step) and
        ``checkpoint_write_s`` of the checkpoint of step ``checkpoint_write_step`` (an asynchronous
        one's on the record of the step its write was collected at)."""
        out, self._fields = self._fields, {}
        return out

    def wait(self) -> float:
        """Wait for the running background write, if any (bounded; its error is raised here);
        the seconds waited."""
        if self._pending is None:
            return 0.0
        index, timing = self._pending
        self._pending = None
        try:
            stats, waited, took = self.background.wait()
        except CheckpointError as e:
            raise self._failed(e) from e
        timing["write_s"] = took
        self._fields.update(checkpoint_write_s=took, checkpoint_write_step=timing["step"])
        self._done(index, stats)
        return waited

    def _done(self, index: int, stats: SaveStats) -> None:
        self.last_index = index
        self.last = CheckpointInfo(stats.path, "full", stats.step, index, {})

    def _failed(self, e: CheckpointError) -> CheckpointError:
        prev = (f"the previous checkpoint {self.last.path} (step {self.last.step}) is untouched"
                if self.last is not None else "there is no previous checkpoint")
        return CheckpointError(f"{e}; {prev}")

    def save_model(self, step: int, model: nn.Module, *, meta: dict[str, Any] | None = None) -> SaveStats:
        return save_model(self.root, step=step, model=model, layout=self.layout, dtype=self.model_dtype, meta=meta,
                          is_expert=self.is_expert)

    def restore(self, model: nn.Module, optimizer: Any, info: CheckpointInfo | None = None) -> RestoreResult | None:
        """Restore the newest valid checkpoint (or ``info``); None when there is none.

        Slots that exist but do not verify are never passed over silently: when a valid one is
        left, one line per skipped slot is printed (rank 0) and recorded in ``failures.jsonl``
        (``failures_dir``, default the checkpoint root's parent); when none is left, a
        :class:`NoValidCheckpoint` lists every slot and why, unless ``allow_fresh_start``."""
        if info is None:
            info, rejected = broadcast_object(choose_slot(self.root) if not dist_on() or dist.get_rank() == 0 else None)
            if rejected and info is None and not self.allow_fresh_start:
                raise NoValidCheckpoint(
                    f"{self.root} holds checkpoints but none is valid: "
                    + "; ".join(f"{p.name}: {why}" for p, why in rejected)
                    + ". Fix or remove them, or pass --allow-fresh-start to start again from step 0")
            if rejected and (not dist_on() or dist.get_rank() == 0):
                for p, why in rejected:
                    then = f"resuming from {info.path.name} (step {info.step})" if info is not None else \
                        "starting again from step 0 (--allow-fresh-start)"
                    print(f"checkpoint: skipped damaged {p}: {why}; {then}", flush=True)
                    try:
                        append_jsonl(Path(self.failures_dir) / FAILURES_FILE, {
                            "time": time.time(), "kind": "checkpoint_skipped", "slot": str(p), "reason": why,
                            "used": str(info.path) if info is not None else None})
                    except OSError:
                        pass  # the record is a courtesy; the printed line already says it
            if info is not None:
                self.last, self.last_index = info, info.index
        if info is None:
            return None
        result = restore_full(info, model, optimizer, self.layout, is_expert=self.is_expert)
        self.last, self.last_index = info, info.index
        return result
