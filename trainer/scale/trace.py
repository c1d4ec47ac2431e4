"""The trainer's own set-up and one training step, run as one rank of a large world on torch's fake
process group with the model on the meta device; every collective and the compute per op kind are
recorded as :class:`trainer.scale.profile.StepProfile` records."""
from __future__ import annotations

from typing import Sequence

from .profile import StepProfile


def trace_profiles(preset: str, *, world: int, pp: int = 1, ep: int = 1, dp: int = 0, tp: int = 1,
                   ac: str | Sequence[str] = "", fsdp: bool = False, optimizer: str | None = None,
                   ranks: str | Sequence[int] = "auto", micro_batch: int | None = None,
                   global_batch: int | None = None, context: int | None = None,
                   ep_comm: str | None = None, progress: bool = False) -> dict[int, StepProfile]:
    """One :class:`StepProfile` (source ``"trace"``) per traced rank of the layout.

    ``ranks``: ``"auto"`` (the first and last rank of every pipeline stage, one rank at each expert
    position, the world's last rank) or the global ranks to trace. ``fsdp``: FSDP2 on the non-expert
    weights (``--parallel.dp_shard fsdp``); ``optimizer``: adamw, sharded (ZeRO-1) or epso (default:
    the preset's). ``ep_comm``: the EP token exchange (``all_to_all`` or ``allgather``; default the
    preset's)."""
    raise NotImplementedError("trace_profiles: the tracer is being written; this is its signature")
