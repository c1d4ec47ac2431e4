"""Token dispatch for expert parallelism: allgather (the paper's) and all-to-all.

Both take this rank's routed tokens and a ``local_experts`` callable that runs stages 2-5 for
this rank's experts on any batch of tokens (non-local choices are skipped by the counting stage),
and return this rank's ``[S, H]`` output summed over every rank's experts.

Legend: W EP group size, S tokens on this rank, T = W*S gathered tokens, H hidden, K experts per
token, NR experts per rank, RO rows this rank sends (token, destination-rank pairs), RI rows it
receives.
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist

from .collectives import (
    all_to_all_autograd,
    all_to_all_dim0,
    forward_allgather,
    forward_allgather_backward_reducescatter,
    forward_reducescatter_backward_allgather,
    group_rank,
    group_size,
)

#: ``(x [N, H], weights [N, K], topk_idx [N, K]) -> [N, H]``: this rank's experts on N tokens.
LocalExperts = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]

#: Routing indices travel as int32 (E < 2**31): half the bytes of topk's int64.
INDEX_WIRE_DTYPE = torch.int32


def allgather_dispatch(
    x_SH: torch.Tensor,
    weights_SK: torch.Tensor,
    topk_idx_SK: torch.Tensor,
    local_experts: LocalExperts,
    group: dist.ProcessGroup | None,
) -> torch.Tensor:
    """Every rank gathers all T tokens with their weights and indices, runs its experts on them,
    and the ``[T, H]`` partial outputs are reduce-scattered. Needs equal S on every rank.

    Forward: 3 all-gathers and 1 reduce-scatter, no host synchronisation. Backward: 1 all-gather
    (output gradient) and 2 reduce-scatters (input and router-weight gradients).
    """
    x_TH = forward_allgather_backward_reducescatter(x_SH, group)
    weights_TK = forward_allgather_backward_reducescatter(weights_SK, group)
    topk_idx_TK = forward_allgather(topk_idx_SK.to(INDEX_WIRE_DTYPE), group)
    partial_TH = local_experts(x_TH, weights_TK, topk_idx_TK)
    return forward_reducescatter_backward_allgather(partial_TH, group)


def alltoall_plan(topk_idx_SK: torch.Tensor, num_local: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Which rows go where: ``(token_of_row [RO], rows_per_rank [W])``.

    A token goes once to every rank holding at least one of its K experts (not once per expert),
    rows ordered by destination rank, then token.
    """
    S = topk_idx_SK.shape[0]
    dest_SK = torch.div(topk_idx_SK.to(torch.int64), num_local, rounding_mode="floor")
    wanted_SW = torch.zeros(S, world, dtype=torch.bool, device=topk_idx_SK.device)
    wanted_SW.scatter_(1, dest_SK, True)
    _, token_of_row = wanted_SW.t().nonzero(as_tuple=True)
    return token_of_row, wanted_SW.sum(0)


def alltoall_dispatch(
    x_SH: torch.Tensor,
    weights_SK: torch.Tensor,
    topk_idx_SK: torch.Tensor,
    local_experts: LocalExperts,
    group: dist.ProcessGroup | None,
    num_local: int,
) -> torch.Tensor:
    """Tokens go only to the ranks holding their experts and come back by a second all-to-all.

    Counts are exchanged first (one all-to-all of W integers, read on the host to size the
    buffers); then tokens with their weights (one buffer ``[RO, H+K]`` in the activation dtype) and
    indices; each rank runs its experts on what it received and sends the weighted partial sums
    back, where they are added per token. S may differ between ranks.
    """
    world = group_size(group)
    S, H = x_SH.shape
    K = topk_idx_SK.shape[1]
    token_of_row, send_counts_W = alltoall_plan(topk_idx_SK, num_local, world)
    recv_counts_W = all_to_all_dim0(send_counts_W, [1] * world, [1] * world, group)
    send_splits = send_counts_W.tolist()
    recv_splits = recv_counts_W.tolist()
    # Weights ride with the tokens (one collective, not two); the router produced them in the
    # activation dtype already.
    payload_RO = torch.cat(
        [x_SH.index_select(0, token_of_row), weights_SK.index_select(0, token_of_row).to(x_SH.dtype)], dim=1
    )
    payload_RI = all_to_all_autograd(payload_RO, recv_splits, send_splits, group)
    idx_RI = all_to_all_dim0(
        topk_idx_SK.index_select(0, token_of_row).to(INDEX_WIRE_DTYPE), recv_splits, send_splits, group
    )
    x_RI, w_RI = payload_RI.split([H, K], dim=1)
    partial_RI = local_experts(x_RI.contiguous(), w_RI.to(weights_SK.dtype).contiguous(), idx_RI)
    back_RO = all_to_all_autograd(partial_RI, send_splits, recv_splits, group)
    return x_SH.new_zeros(S, H).index_add(0, token_of_row, back_RO)


def token_offset(sizes: list[int], group: dist.ProcessGroup | None) -> int:
    """Position of this rank's first token in the EP group's concatenated batch."""
    return sum(sizes[: group_rank(group)])
