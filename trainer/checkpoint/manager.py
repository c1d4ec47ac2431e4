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
from .dcp_io import broadcast_object
from .restore import NoValidCheckpoint, RestoreResult, choose_slot, find_latest, restore_full
from .save import SaveStats, save_full, save_model
from .slots import CheckpointError, CheckpointInfo

class CheckpointManager:
    """Periodic full checkpoints in alternating slots plus persistent model-only ones.

    ``interval``: full checkpoint every this many steps (0: never); ``model_interval``: model-only
    checkpoint every this many steps (0: never), cast to ``model_dtype`` (None: parameter dtype)."""

    def __init__(self, root: str | os.PathLike, *, layout: Any = None, interval: int = 0, model_interval: int = 0,
                 model_dtype: str | None = "bf16", is_expert: Callable[[str], bool] = is_expert_weight,
                 allow_fresh_start: bool = False, failures_dir: str | os.PathLike | None = None) -> None:
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
             rank_extra: Any = None) -> SaveStats:
        if self.last_index is None:
            # never overwrite the newest valid slot, even in a run that did not resume from it
            self.latest()
        index = 0 if self.last_index is None else self.last_index + 1
        try:
            stats = save_full(self.root, step=step, index=index, model=model, optimizer=optimizer, layout=self.layout,
                              meta=meta, rank_extra=rank_extra, is_expert=self.is_expert)
        except CheckpointError as e:
            prev = (f"the previous checkpoint {self.last.path} (step {self.last.step}) is untouched"
                    if self.last is not None else "there is no previous checkpoint")
            raise CheckpointError(f"{e}; {prev}") from e
        self.last_index = index
        self.last = CheckpointInfo(stats.path, "full", step, index, {})
        return stats

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
