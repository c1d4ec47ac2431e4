"""Reading a checkpoint: the newest valid slot (chosen by rank 0), model weights into any layout,
and the full training state (weights, optimizer shards and steps; RNG states on the same layout)."""
from __future__ import annotations

import os
import random
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn

from fastmoe_xpu.dist.groups import dist_on
from fastmoe_xpu.dist.sharding import is_expert_weight

from .dcp_io import broadcast_object, check_keys, dcp_load, is_dtensor
from .optim_state import OPTIM_STATES, optimizer_reads
from .slots import CheckpointError, CheckpointInfo, latest_valid, rank_file, read_info, scan, verify
from .writers import coords_of, model_segments, segment_tensor, tp_rank_of, tp_size

@dataclass
class RestoreResult:
    info: CheckpointInfo
    seconds: float
    same_layout: bool
    """Whether the saving run had this run's PP x DP x EP (then RNG and rank extras were restored)."""
    rank_extra: Any = None

    @property
    def meta(self) -> dict[str, Any]:
        return self.info.meta.get("meta", {})


class NoValidCheckpoint(CheckpointError):
    """Checkpoint slots exist but none verifies (and no fresh start was asked for)."""


def choose_slot(root: str | os.PathLike) -> tuple[CheckpointInfo | None, list[tuple[Path, str]]]:
    """The newest valid full slot and the ``(slot, reason)`` of every slot that does not verify."""
    slots = scan(root)
    good = [info for _, info, _ in slots if info is not None]
    rejected = [(p, why) for p, info, why in slots if info is None]
    return max(good, key=lambda i: (i.step, i.index), default=None), rejected


def find_latest(root: str | os.PathLike) -> CheckpointInfo | None:
    """:func:`latest_valid`, verified by rank 0 and broadcast (collective when distributed)."""
    info = None
    if not dist_on() or dist.get_rank() == 0:
        info = latest_valid(root)
    return broadcast_object(info)


@torch.no_grad()
def load_model(path: str | os.PathLike, model: nn.Module, *, layout: Any = None, verify_first: bool = True,
               is_expert: Callable[[str], bool] = is_expert_weight) -> CheckpointInfo:
    """Load model weights (only) from a full or model-only checkpoint into ``model`` (collective).
    Any DP size and any EP size dividing E can read it; a different model gives a clear error."""
    path = Path(path)
    if verify_first:
        reason = None
        if not dist_on() or dist.get_rank() == 0:
            reason = verify(path) if path.is_dir() else f"{path} is not a checkpoint directory"
        reason = broadcast_object(reason)
        if reason is not None:
            raise CheckpointError(f"cannot initialise from {path}: {reason}")
    info = read_info(path)
    params = dict(model.named_parameters())
    segments = model_segments(model, is_expert, tp_rank_of(layout))
    want = {f"model/{s.key}": torch.empty_like(params[s.param]) if is_dtensor(params[s.param]) else
            torch.empty(s.shape, dtype=params[s.param].dtype, device=params[s.param].device) for s in segments}
    check_keys(path, want)
    dcp_load(want, path)
    for s in segments:
        segment_tensor(params, s).copy_(want[f"model/{s.key}"])
    return info


@torch.no_grad()
def restore_full(info: CheckpointInfo, model: nn.Module, optimizer: Any, layout: Any = None,
                 is_expert: Callable[[str], bool] = is_expert_weight) -> RestoreResult:
    """Restore weights, optimizer shards and steps (and, on the same layout, RNG states and rank
    extras) from a verified full checkpoint (collective)."""
    t0 = time.perf_counter()
    if info.kind != "full":
        raise CheckpointError(f"{info.path} is a {info.kind}-only checkpoint; use it with --init-from")
    coords = coords_of(layout)
    want, copies = optimizer_reads(model, optimizer, is_expert, tp_rank_of(layout))
    check_keys(info.path, want)
    dcp_load(want, info.path)
    for b, at, seg_at, n, key in copies:
        for state, dst in zip(OPTIM_STATES, (b.master_view(), b.exp_avg, b.exp_avg_sq)):
            dst[at:at + n].copy_(want[f"optim/{state}/{key}"].reshape(-1)[seg_at:seg_at + n])
    for b in optimizer.buckets:
        if hasattr(b, "load_states"):
            b.load_states({st: {n: want[f"optim/{st}/{n}"] for n in b.names} for st in OPTIM_STATES})
    steps = info.meta.get("optimizer", {}).get("steps", {})
    for b in optimizer.buckets:
        b.step_t.fill_(float(steps.get(b.name, max(steps.values(), default=0))))
        b.publish()  # the weights are the master weights cast to the parameter dtype
    saved = info.meta["layout"]
    same = ((saved["pp"], saved["dp"], saved["ep"], saved.get("tp", 1))
            == (coords.pp, coords.dp, coords.ep, tp_size(layout)))
    extra = None
    if same:
        state = torch.load(info.path / rank_file(coords.rank), map_location="cpu", weights_only=False)
        restore_rng(state["rng"])
        if "optimizer_rounding" in state["rng"] and hasattr(optimizer, "generator"):
            optimizer.generator.set_state(state["rng"]["optimizer_rounding"])
        extra = state["extra"]
    return RestoreResult(info=info, seconds=time.perf_counter() - t0, same_layout=same, rank_extra=extra)


def restore_rng(state: Mapping[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    if "xpu" in state and hasattr(torch, "xpu") and torch.xpu.is_available():
        torch.xpu.set_rng_state_all(state["xpu"])
