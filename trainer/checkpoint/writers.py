"""Who writes what: mesh coordinates, the DP-scattered writer plan, size balancing and the model's
checkpoint segments (whole weights and per-expert slices; see :mod:`trainer.checkpoint`)."""
from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import torch
import torch.nn as nn

from fastmoe_xpu.dist.sharding import is_expert_weight

from ..layout import DeviceMesh
from .slots import CheckpointError

#: A rank's position: the trainer's one mesh type, without process groups.
Coords = DeviceMesh


def coords_of(layout: Any) -> Coords:
    """Coords from anything with ``rank``, ``pp``, ``dp`` and ``ep`` attributes (None: one process).

    Under tensor parallelism (a layout with ``tp > 1``; TP sits innermost, where EP does for MoE
    models) the TP axis plays EP's part: TP-split weights are owned by their TP rank."""
    if layout is None:
        return Coords()
    inner = int(getattr(layout, "tp", 1) or 1)
    return Coords(rank=int(layout.rank), pp=int(layout.pp), dp=int(layout.dp),
                  ep=inner if inner > 1 else int(layout.ep))


def tp_size(layout: Any) -> int:
    return int(getattr(layout, "tp", 1) or 1) if layout is not None else 1


def tp_rank_of(layout: Any) -> int | None:
    """This rank's TP index when the layout is tensor-parallel, else None."""
    if layout is not None and int(getattr(layout, "tp", 1) or 1) > 1:
        return int(layout.tp_rank)
    return None


def layout_rank(pp_rank: int, dp_rank: int, ep_rank: int, *, dp: int, ep: int) -> int:
    """Global rank of mesh coordinates ``(pp_rank, dp_rank, ep_rank)``."""
    return (pp_rank * dp + dp_rank) * ep + ep_rank


def model_shard_writer(pp_rank: int, ep_rank: int, *, pp: int, dp: int, ep: int) -> int:
    """The rank that writes model-parallel shard ``m = pp_rank * EP + ep_rank``: DP rank ``m % DP``."""
    if not (0 <= pp_rank < pp and 0 <= ep_rank < ep) or dp < 1:
        raise ValueError(f"shard (pp {pp_rank}, ep {ep_rank}) is outside PP x DP x EP = {pp} x {dp} x {ep}")
    m = pp_rank * ep + ep_rank
    return layout_rank(pp_rank, m % dp, ep_rank, dp=dp, ep=ep)


def shard_chunks(pp: int, dp: int, ep: int) -> int:
    """Writers per model-parallel shard: ``max(1, DP // (PP*EP))``, so that with few shards (EP=1)
    the weights still spread over all DP ranks instead of landing on one."""
    return max(1, dp // (pp * ep))


def chunk_writer_dp(pp_rank: int, ep_rank: int, chunk: int, *, pp: int, dp: int, ep: int) -> int:
    """DP rank that writes chunk ``chunk`` of shard ``m = pp_rank*EP + ep_rank``: ``(m + chunk*PP*EP) % DP``
    (chunk 0 is the shard writer ``m % DP``; distinct chunks of one shard go to distinct DP ranks)."""
    if not 0 <= chunk < shard_chunks(pp, dp, ep):
        raise ValueError(f"chunk {chunk} is outside [0, {shard_chunks(pp, dp, ep)})")
    return (pp_rank * ep + ep_rank + chunk * pp * ep) % dp


def writer_plan(pp: int, dp: int, ep: int) -> dict[tuple[int, int], int]:
    """``{(pp_rank, ep_rank): writer rank}`` for every model-parallel shard."""
    return {(p, e): model_shard_writer(p, e, pp=pp, dp=dp, ep=ep) for p in range(pp) for e in range(ep)}


def balance(sizes: Sequence[int], bins: int) -> list[int]:
    """Bin of every item, largest first into the emptiest bin (ties: lowest index): deterministic,
    so every rank computes the same assignment, and within the largest item of perfect balance."""
    if bins < 1:
        raise ValueError(f"bins must be >= 1, got {bins}")
    load = [0] * bins
    out = [0] * len(sizes)
    for i in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        b = min(range(bins), key=lambda k: (load[k], k))
        out[i] = b
        load[b] += sizes[i]
    return out


def checkpoint_bytes(n_dense: int, n_expert: int, *, pp: int = 1, dp: int = 1, ep: int = 1, weight_bytes: int = 4,
                     model_only_bytes: int = 2) -> dict[str, float]:
    """Sizes of a full and a model-only checkpoint and the bytes one rank writes, for ``n_dense``
    non-expert and ``n_expert`` expert weights (whole model), stages of equal size.

    Full checkpoint: weights (``weight_bytes`` each) + fp32 master, exp_avg, exp_avg_sq (12 bytes).
    Per rank: its 1/(PP*DP*EP) share of the optimizer state (EPSO and ShardedAdamW alike), plus,
    on the ``PP*EP*c`` ranks that write weights (``c`` = :func:`shard_chunks`), a 1/c chunk of one
    model-parallel shard's weights ``N / (PP*EP)``."""
    n = n_dense + n_expert
    c = shard_chunks(pp, dp, ep)
    state = 12 * n / (pp * dp * ep)
    chunk = weight_bytes * n / (pp * ep * c)
    return {
        "params": n, "full": (weight_bytes + 12) * n, "model_only": model_only_bytes * n,
        "full_over_model_only": (weight_bytes + 12) / model_only_bytes,
        "rank_writer": state + chunk, "rank_other": state, "writers": pp * ep * c, "ranks": pp * dp * ep,
    }


@dataclass(frozen=True)
class Segment:
    """One checkpoint tensor: a whole weight, or one global expert's slice of a merged expert weight."""

    key: str
    """``<param>`` or ``<param>/<global expert id>``."""
    param: str
    """Parameter name in the model."""
    local_index: int | None
    """Index along dim 0 of the local parameter (expert slices), None for a whole weight."""
    shape: tuple[int, ...]
    inner: bool = False
    """Held by one inner-axis rank only (an expert slice under EP, a TP-split weight under TP),
    rather than replicated over that axis."""

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def is_expert(self) -> bool:
        return self.local_index is not None


def expert_ids(model: nn.Module, name: str, local_experts: int) -> list[int]:
    """Global ids of the experts an expert weight holds: the block's ``experts.expert_ids`` buffer
    under expert parallelism, ``0..E-1`` otherwise."""
    prefix = name.rsplit(".", 1)[0]
    for bname, buf in model.named_buffers():
        if bname == prefix + ".expert_ids":
            ids = [int(i) for i in buf.tolist()]
            if len(ids) != local_experts:
                raise CheckpointError(f"{bname} lists {len(ids)} experts but {name} holds {local_experts}")
            return ids
    return list(range(local_experts))


def param_segments(model: nn.Module, name: str, p: torch.Tensor,
                   is_expert: Callable[[str], bool] = is_expert_weight, tp_rank: int | None = None) -> list[Segment]:
    """A weight's checkpoint segments: one per global expert for merged expert weights; under TP a
    split weight is keyed ``<param>/tp<r>`` (a checkpoint then loads at the same TP size only)."""
    if is_expert(name) and p.dim() >= 2:
        ids = expert_ids(model, name, p.shape[0])
        return [Segment(f"{name}/{e}", name, i, tuple(p.shape[1:]), inner=True) for i, e in enumerate(ids)]
    if tp_rank is not None and getattr(p, "tp_split", False):
        return [Segment(f"{name}/tp{tp_rank}", name, None, tuple(p.shape), inner=True)]
    return [Segment(name, name, None, tuple(p.shape))]


def model_segments(model: nn.Module, is_expert: Callable[[str], bool] = is_expert_weight,
                   tp_rank: int | None = None) -> list[Segment]:
    """Checkpoint segments of the model's trainable weights, in parameter order."""
    out: list[Segment] = []
    for name, p in model.named_parameters():
        if p.requires_grad:
            out.extend(param_segments(model, name, p, is_expert, tp_rank))
    return out


def model_writes(segments: Sequence[Segment], coords: Coords) -> list[Segment]:
    """The model segments this rank writes under the DP-scattered plan.

    Segments belong to the model-parallel shard of their EP (or TP) rank; replicated ones to the
    EP rank :func:`balance` gives them. The shard's writers are its :func:`shard_chunks` DP replicas
    (:func:`chunk_writer_dp`), each writing one size-balanced chunk."""
    c = coords
    dense = [s for s in segments if not s.inner]
    dense_ep = iter(balance([s.numel for s in dense], c.ep))
    mine = [s for s in segments if s.inner or next(dense_ep) == c.ep_rank]  # this rank's shard
    chunk = balance([s.numel for s in mine], shard_chunks(c.pp, c.dp, c.ep))
    return [s for s, j in zip(mine, chunk)
            if chunk_writer_dp(c.pp_rank, c.ep_rank, j, pp=c.pp, dp=c.dp, ep=c.ep) == c.dp_rank]


def segment_tensor(model_params: Mapping[str, torch.Tensor], s: Segment) -> torch.Tensor:
    p = model_params[s.param]
    return p if s.local_index is None else p[s.local_index]


def checkpoint_space_warning(trainer: Any) -> str | None:
    """A warning (the run goes on) when the two full checkpoint slots the run keeps would take more
    than the free space of their file system, less what the slots there hold already."""
    from ..ft.space import space_warning
    from ..model.build import torch_dtype

    root = Path(trainer.checkpoints.root)
    c = trainer.counts
    weight = torch_dtype(trainer.cfg.model.param_dtype).itemsize
    planned = 2 * int(checkpoint_bytes(c.total - c.expert, c.expert, weight_bytes=weight)["full"])
    held = sum(f.stat().st_size for f in root.glob("slot-*/*") if f.is_file()) if root.is_dir() else 0
    return space_warning(root, planned - held, "the two full checkpoint slots of this run")
