"""Learning-rate schedule: linear warmup to the peak, then cosine decay to the minimum."""
from __future__ import annotations

import math


def lr_at(step: int, *, peak: float, minimum: float, warmup: int, total: int) -> float:
    """Learning rate of optimizer step ``step`` (0-based).

    Warmup: ``peak * (step + 1) / warmup`` for ``step < warmup`` (the first step already moves);
    then ``minimum + (peak - minimum) * (1 + cos(pi * p)) / 2`` with ``p`` going from 0 at the first
    post-warmup step to 1 at the last step ``total - 1``."""
    if step < warmup:
        return peak * (step + 1) / warmup
    span = max(total - 1 - warmup, 1)
    p = min(max(step - warmup, 0) / span, 1.0)
    return minimum + (peak - minimum) * 0.5 * (1.0 + math.cos(math.pi * p))


def clipping_active(step: int, warmup: int) -> bool:
    """Gradient clipping applies only once warmup is over (the paper's recipe)."""
    return step >= warmup
