"""The stage-4 (expert MLP) shapes the kernel tests run, one table, picked by name.

Each is awkward in one way: odd H and I, a prime expert count, T below one token block, K=1, K=E, every
token on one expert, empty experts, an expert-parallel slice, low precision. The ``tma-`` ones keep
H and I multiples of 4 (16-byte aligned fp32 rows, what the TMA descriptors need) while the tiles
still do not divide them.

Columns: (T, K, E, expert_start, num_local, H, I, routing pattern, dtype).
"""
from __future__ import annotations

import pytest
import torch

SHAPES = {
    "odd-H-I-prime-E": (37, 3, 7, 0, 7, 33, 21, "random", torch.float32),
    "T-below-block": (5, 2, 4, 0, 4, 16, 8, "random", torch.float32),
    "K1-I-above-H": (19, 1, 5, 0, 5, 24, 40, "random", torch.float32),
    "all-tokens-to-one-expert": (24, 2, 6, 0, 6, 17, 9, "one_expert", torch.float32),
    "empty-experts-zero-weight-grad": (24, 2, 8, 0, 8, 20, 12, "low_half", torch.float32),
    "expert-parallel-start-3": (37, 3, 7, 3, 2, 33, 21, "random", torch.float32),
    "bf16-fp32-accumulation": (21, 2, 5, 0, 5, 32, 16, "random", torch.bfloat16),
    "K-equals-E": (11, 5, 5, 0, 5, 20, 12, "random", torch.float32),
    "tma-ragged-tiles-prime-E": (37, 3, 7, 0, 7, 36, 20, "random", torch.float32),
    "tma-one-expert-many-row-tiles": (40, 2, 6, 0, 6, 24, 44, "one_expert", torch.float32),
    "tma-expert-parallel-slice": (37, 3, 7, 3, 2, 28, 20, "random", torch.float32),
    "tma-fp16": (21, 2, 5, 0, 5, 40, 24, "random", torch.float16),
}


def stage4_cases(*names: str) -> list:
    """``pytest.param`` rows of the named shapes, each with its name as the test id."""
    return [pytest.param(*SHAPES[name], id=name) for name in names]
