"""Document masking (``--data.document_mask``): where each document of a packed instance starts.

An instance is a window of the token stream ``doc, EOS, doc, EOS, ...``; a document starts at the
instance's first token and after every EOS. The model is given ``position_ids`` that restart at 0
there, and transformers (5.x, ``masking_utils.find_packed_sequence_indices``) reads a restart of the
positions as the start of a packed sequence: it builds the block-diagonal causal mask for whichever
attention implementation the model uses (sdpa, eager, flex), so no token attends to an earlier
document. The labels stay as they are: the target after an EOS, the next document's first token,
is predicted from the EOS alone, and every other target lies in its token's own document.
"""
from __future__ import annotations

from typing import Any

import torch


def document_position_ids(input_ids: torch.Tensor, eos_id: int) -> torch.Tensor:
    """Positions [B, C] (int64) that count from 0 at the start of every document of ``input_ids`` [B, C]:
    at column 0 and at every column after an ``eos_id`` (the EOS itself ends its document)."""
    b, c = input_ids.shape
    col = torch.arange(c, device=input_ids.device).expand(b, c)
    starts = torch.zeros((b, c), dtype=torch.bool, device=input_ids.device)
    starts[:, 1:] = input_ids[:, :-1] == eos_id
    first = torch.where(starts, col, torch.zeros_like(col)).cummax(dim=1).values
    return col - first


def document_kwargs(input_ids: torch.Tensor, eos_id: int | None) -> dict[str, Any]:
    """The extra keyword arguments of a transformers forward over ``input_ids``: ``position_ids`` restarting
    per document when ``eos_id`` is given (document masking on), none otherwise."""
    if eos_id is None:
        return {}
    return {"position_ids": document_position_ids(input_ids, eos_id)}
