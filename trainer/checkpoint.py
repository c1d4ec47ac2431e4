"""Per-rank checkpoint files of the full training state (one slot, written atomically).

Each rank writes ``DIR/rank{r:05d}.pt`` holding ``Trainer.state_dict()``: its model weights (its
own experts under EP), its optimizer shards, the step, the data position and the RNG states.
"""
from __future__ import annotations

import os
from typing import Any

import torch


def rank_file(directory: str, rank: int) -> str:
    return os.path.join(directory, f"rank{rank:05d}.pt")


def save_rank_state(directory: str, rank: int, state: dict[str, Any]) -> str:
    """Write ``state`` under a temporary name, fsync, then rename, so a crash never leaves half a file."""
    os.makedirs(directory, exist_ok=True)
    path = rank_file(directory, rank)
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return path


def load_rank_state(directory: str, rank: int) -> dict[str, Any] | None:
    """The state this rank saved in ``directory``, or None when there is none."""
    path = rank_file(directory, rank)
    if not os.path.isfile(path):
        return None
    return torch.load(path, map_location="cpu", weights_only=False)
