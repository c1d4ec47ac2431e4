"""Input checks shared by both backends' launchers (raise, never assert: asserts vanish under -O)."""
from __future__ import annotations

import torch


def num_blocks(num_tokens: int, block_size: int) -> int:
    return (num_tokens + block_size - 1) // block_size


def check_count_inputs(topk_idx_TK: torch.Tensor, expert_start: int, num_local: int, block_size: int) -> None:
    if not isinstance(topk_idx_TK, torch.Tensor) or topk_idx_TK.dim() != 2:
        raise ValueError(f"topk_idx must be a [T, K] tensor, got {getattr(topk_idx_TK, 'shape', type(topk_idx_TK))}")
    if topk_idx_TK.dtype.is_floating_point or topk_idx_TK.dtype == torch.bool:
        raise TypeError(f"topk_idx must be an integer tensor, got {topk_idx_TK.dtype}")
    if num_local < 1:
        raise ValueError(f"num_local must be >= 1, got {num_local}")
    if expert_start < 0:
        raise ValueError(f"expert_start must be >= 0, got {expert_start}")
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")


def check_gemm_inputs(a: torch.Tensor, w: torch.Tensor, cum_token_counts: torch.Tensor, op: str) -> None:
    if a.dim() != 2 or w.dim() != 3:
        raise ValueError(f"{op}: expected a 2-D activation and 3-D weights, got {tuple(a.shape)} and {tuple(w.shape)}")
    if a.shape[1] != w.shape[2]:
        raise ValueError(f"{op}: activation width {a.shape[1]} does not match weight shape {tuple(w.shape)}")
    if a.dtype != w.dtype:
        raise TypeError(f"{op}: activation dtype {a.dtype} differs from weight dtype {w.dtype}")
    if a.device != w.device:
        raise ValueError(f"{op}: activation on {a.device} but weights on {w.device}")
    if cum_token_counts.numel() != w.shape[0] + 1:
        raise ValueError(
            f"{op}: cum_token_counts has {cum_token_counts.numel()} entries, expected {w.shape[0] + 1} "
            f"(one more than the {w.shape[0]} local experts)"
        )
