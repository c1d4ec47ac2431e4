"""Token dispatch for expert parallelism: one interface, three dispatchers.

A :class:`TokenDispatcher` moves this rank's routed tokens to the experts that take them and their
outputs back. The block runs, per forward::

    offset = dispatcher.prepare(hidden_states, check_input, device=..., need_offset=...)  # checks
    ... route the local tokens (forced routing starts its pattern at ``offset``) ...
    x, weights, idx, state = dispatcher.dispatch(x_SH, weights_SK, idx_SK)
    partial = <stages 2-5 on this rank's experts>(x, weights, idx, ep_group=dispatcher.ep_group)
    out_SH = dispatcher.combine(partial, state)

:class:`LocalDispatcher` (no expert parallelism: every expert here, no communication),
:class:`AllGatherDispatcher` (the paper's) and :class:`AllToAllDispatcher`;
:func:`make_dispatcher` picks one from an expert-parallel group and a mode name.

Legend: W EP group size, S tokens on this rank, T = W*S gathered tokens, H hidden, K experts per
token, NR experts per rank, RO rows this rank sends (token, destination-rank pairs), RI rows it
receives, N rows the local experts see.
"""
from __future__ import annotations

import math
from typing import Any, Callable, NamedTuple

import torch
import torch.distributed as dist

from .collectives import (
    agree_on_inputs,
    all_to_all_autograd,
    all_to_all_dim0,
    assert_same_tokens_on_device,
    forward_allgather,
    forward_allgather_backward_reducescatter,
    forward_reducescatter_backward_allgather,
)
from ..kernels.timing import capturing  # under a graph capture the dispatch checks its inputs on the device
from .env import check_group_device
from .groups import group_rank, group_size, member_position, world_if_none

#: Token dispatch modes under expert parallelism.
DISPATCH_MODES = ("allgather", "alltoall")

#: ``hidden_states -> token count``; raises TypeError or ValueError when the input is unfit.
InputCheck = Callable[[torch.Tensor], int]

#: ``(x [N, H], weights [N, K], topk_idx [N, K]) -> [N, H]``: this rank's experts on N tokens.
LocalExperts = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]

#: Routing indices travel as int32 (E < 2**31): half the bytes of topk's int64.
INDEX_WIRE_DTYPE = torch.int32


class TokenDispatcher:
    """Moves routed tokens between this rank and the ranks holding their experts.

    ``prepare`` checks the input (agreeing across the group where the dispatcher communicates, so
    that a bad input on one rank raises on every rank instead of hanging) and returns the position
    of this rank's first token in the group's batch. ``dispatch`` returns the rows this rank's
    experts run on, with their weights and global expert indices, and a state that ``combine``
    takes with the experts' ``[N, H]`` partial output to give this rank's ``[S, H]`` output.
    """

    #: The group stages 2-5 agree their grouped-GEMM engine over (None: no group).
    ep_group: dist.ProcessGroup | None = None

    def prepare(self, hidden_states: torch.Tensor, check_input: InputCheck, *, device: torch.device,
                need_offset: bool) -> int:
        raise NotImplementedError

    def dispatch(
        self, x_SH: torch.Tensor, weights_SK: torch.Tensor, topk_idx_SK: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, Any]:
        raise NotImplementedError

    def combine(self, partial_NH: torch.Tensor, state: Any) -> torch.Tensor:
        raise NotImplementedError

    def local_rows(self, rows: int, top_k: int, state: Any) -> int:
        """The (token, expert) pairs this rank's experts take, on average under uniform routing, when
        :meth:`dispatch` gave them ``rows`` rows (for meta tensors, whose ids cannot be read)."""
        return rows * top_k

    def check_experts_implementation(self, name: str) -> None:
        """Raise ValueError when another experts implementation (transformers' ExpertsInterface,
        which runs every expert on the local tokens) cannot stand in for this dispatch."""

    def run(self, x_SH: torch.Tensor, weights_SK: torch.Tensor, topk_idx_SK: torch.Tensor,
            local_experts: LocalExperts) -> torch.Tensor:
        """``combine(local_experts(dispatch(...)))``: this rank's ``[S, H]`` output."""
        x, weights, idx, state = self.dispatch(x_SH, weights_SK, topk_idx_SK)
        return self.combine(local_experts(x, weights, idx), state)


class LocalDispatcher(TokenDispatcher):
    """No expert parallelism: every expert is here; tokens stay, nothing is communicated."""

    def prepare(self, hidden_states: torch.Tensor, check_input: InputCheck, *, device: torch.device,
                need_offset: bool) -> int:
        check_input(hidden_states)
        return 0

    def dispatch(self, x_SH, weights_SK, topk_idx_SK):
        return x_SH, weights_SK, topk_idx_SK, None

    def combine(self, partial_NH: torch.Tensor, state: Any) -> torch.Tensor:
        return partial_NH


class _ExpertParallelDispatcher(TokenDispatcher):
    """What both expert-parallel dispatchers share: the group, and the input agreement.

    ``check_inputs``: agree on every rank's token count and input validity with one all-gather of
    two integers per rank before communicating (read on the host). Traced by torch.compile, a host
    read is impossible: a dispatcher that can run traced (:meth:`_traceable`) checks on the device
    instead (:meth:`_check_counts_traced`).
    """

    #: Whether the dispatch itself needs every rank's token count (then it agrees even unchecked).
    needs_counts = False

    def __init__(self, group: dist.ProcessGroup | None, *, check_inputs: bool = True) -> None:
        # None: the default group, as in torch.distributed's own calls.
        group = world_if_none(group)
        self.group = group
        self.ep_group = group
        self.size = group_size(group)
        self.check_inputs = bool(check_inputs)

    def check_experts_implementation(self, name: str) -> None:
        raise ValueError(
            f"experts_implementation={name!r} cannot run on a FastSparseMoeBlock sharded over an "
            "expert-parallel group (its experts hold only this rank's slice); use 'fastmoe' or rebuild "
            "the model unsharded"
        )

    def _traceable(self, need_offset: bool) -> bool:
        """Whether :meth:`prepare` can run inside a graph (no host read of the others' counts)."""
        raise NotImplementedError

    def _check_counts_traced(self, num_tokens: int, device: torch.device) -> None:
        """The traced form of :meth:`_check_counts` (device-side, no host read)."""

    def _check_counts(self, sizes: list[int]) -> None:
        """Raise ValueError when every rank's token counts ``sizes`` do not suit this dispatch."""

    def prepare(self, hidden_states: torch.Tensor, check_input: InputCheck, *, device: torch.device,
                need_offset: bool) -> int:
        group = self.group
        # Checks that come out the same on every rank raise at once; a check that may fail on one
        # rank only is shared through agree_on_inputs, so no rank is left waiting in a collective.
        check_group_device(group, device)
        local_error: Exception | None = None
        num_tokens = -1
        try:
            num_tokens = check_input(hidden_states)
        except (TypeError, ValueError) as err:
            local_error = err
        # The agreement reads every rank's count on the host, which a graph (compiled or captured) cannot.
        traced = (torch.compiler.is_compiling() or capturing(device)) and self._traceable(need_offset)
        if traced:
            if local_error is not None:
                raise local_error
            self._check_counts_traced(num_tokens, device)
            sizes = [num_tokens] * self.size
        elif self.check_inputs or self.needs_counts:
            sizes = agree_on_inputs(group, num_tokens, local_error, device)
        elif local_error is not None:
            raise local_error
        else:
            sizes = [num_tokens] * self.size
        # (Traced, the sizes are all this rank's symbolic count: comparing them would only add a guard.)
        if not traced:
            self._check_counts(sizes)
        return token_offset(sizes, group)


class AllGatherDispatcher(_ExpertParallelDispatcher):
    """Every rank gathers all T tokens with their weights and indices, runs its experts on them,
    and the ``[T, H]`` partial outputs are reduce-scattered. Needs equal S on every rank.

    Forward: 3 all-gathers and 1 reduce-scatter, no host synchronisation besides the input check.
    Backward: 1 all-gather (output gradient) and 2 reduce-scatters (input and router-weight
    gradients). Traced, the equal-count check is a device-side assertion in the graph.
    """

    def _traceable(self, need_offset: bool) -> bool:
        return True  # equal counts: the offset is rank * S, known without the others' counts

    def _check_counts_traced(self, num_tokens: int, device: torch.device) -> None:
        if self.check_inputs:
            assert_same_tokens_on_device(self.group, num_tokens, device)

    def _check_counts(self, sizes: list[int]) -> None:
        if len(set(sizes)) > 1:
            raise ValueError(
                f"allgather dispatch needs the same number of tokens on every EP rank, got {sizes} "
                "(batch*sequence per rank); pad the batches to one length or use dispatch='alltoall'"
            )

    def dispatch(self, x_SH, weights_SK, topk_idx_SK):
        x_TH = forward_allgather_backward_reducescatter(x_SH, self.group)
        weights_TK = forward_allgather_backward_reducescatter(weights_SK, self.group)
        topk_idx_TK = forward_allgather(topk_idx_SK.to(INDEX_WIRE_DTYPE), self.group)
        return x_TH, weights_TK, topk_idx_TK, None

    def combine(self, partial_NH: torch.Tensor, state: Any) -> torch.Tensor:
        return forward_reducescatter_backward_allgather(partial_NH, self.group)  # N = T gathered rows

    def local_rows(self, rows: int, top_k: int, state: Any) -> int:
        return rows * top_k // self.size  # every gathered token's K choices, 1/W of them here


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


def uniform_rows_per_rank(tokens: int, top_k: int, num_experts: int, ep_size: int) -> int:
    """Rows an all-to-all dispatch sends each rank, on average, when each of ``tokens`` tokens picks
    ``top_k`` distinct experts uniformly (:func:`~fastmoe_xpu.dist.sharding.expected_remote_rows`
    per remote rank), rounded."""
    from .sharding import expected_remote_rows

    return round(expected_remote_rows(tokens, num_experts, top_k, ep_size) / (ep_size - 1))


class _AllToAllState(NamedTuple):
    token_of_row: torch.Tensor
    send_splits: list[int]
    recv_splits: list[int]
    x_SH: torch.Tensor


class AllToAllDispatcher(_ExpertParallelDispatcher):
    """Tokens go only to the ranks holding their experts and come back by a second all-to-all.

    Counts are exchanged first (one all-to-all of W integers, read on the host to size the
    buffers); then tokens with their weights (one buffer ``[RO, H+K]`` in the activation dtype) and
    indices; each rank runs its experts on what it received and sends the weighted partial sums
    back, where they are added per token. S may differ between ranks, so forced routing needs the
    others' counts (the agreement runs even unchecked, and cannot be traced).
    """

    needs_counts = True

    def __init__(self, group: dist.ProcessGroup | None, num_local: int, *, check_inputs: bool = True) -> None:
        super().__init__(group, check_inputs=check_inputs)
        self.num_local = num_local

    def _traceable(self, need_offset: bool) -> bool:
        return not need_offset

    def dispatch(self, x_SH, weights_SK, topk_idx_SK):
        group, world = self.group, self.size
        H = x_SH.shape[1]
        K = topk_idx_SK.shape[1]
        if topk_idx_SK.is_meta:  # shapes only: uniform routing's average rows per destination
            rows = uniform_rows_per_rank(x_SH.shape[0], K, self.num_local * world, world)
            token_of_row = torch.zeros(rows * world, dtype=torch.int64, device=x_SH.device)
            send_counts_W = torch.full((world,), rows, dtype=torch.int64, device=x_SH.device)
        else:
            token_of_row, send_counts_W = alltoall_plan(topk_idx_SK, self.num_local, world)
        recv_counts_W = all_to_all_dim0(send_counts_W, [1] * world, [1] * world, group)
        if send_counts_W.is_meta:
            send_splits = recv_splits = [rows] * world
        else:
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
        state = _AllToAllState(token_of_row, send_splits, recv_splits, x_SH)
        return x_RI.contiguous(), w_RI.to(weights_SK.dtype).contiguous(), idx_RI, state

    def local_rows(self, rows: int, top_k: int, state: Any) -> int:
        return state.x_SH.shape[0] * top_k  # W ranks' S*K choices, 1/W of them here (equal S)

    def combine(self, partial_NH: torch.Tensor, state: _AllToAllState) -> torch.Tensor:
        back_RO = all_to_all_autograd(partial_NH, state.send_splits, state.recv_splits, self.group)
        S, H = state.x_SH.shape
        return state.x_SH.new_zeros(S, H).index_add(0, state.token_of_row, back_RO)


def make_dispatcher(
    ep_group: dist.ProcessGroup | None, dispatch: str, num_experts: int, *, check_inputs: bool = True
) -> TokenDispatcher:
    """The dispatcher for a block with ``num_experts`` experts over ``ep_group`` (None or one rank:
    :class:`LocalDispatcher`) in mode ``dispatch`` (one of :data:`DISPATCH_MODES`)."""
    check_dispatch_mode(dispatch)
    _, size = member_position(ep_group)
    if size == 1:
        return LocalDispatcher()
    if dispatch == "allgather":
        return AllGatherDispatcher(ep_group, check_inputs=check_inputs)
    return AllToAllDispatcher(ep_group, num_experts // size, check_inputs=check_inputs)


def check_dispatch_mode(dispatch: str) -> None:
    if dispatch not in DISPATCH_MODES:
        raise ValueError(f"dispatch must be one of {DISPATCH_MODES}, got {dispatch!r}")


def allgather_dispatch(
    x_SH: torch.Tensor,
    weights_SK: torch.Tensor,
    topk_idx_SK: torch.Tensor,
    local_experts: LocalExperts,
    group: dist.ProcessGroup | None,
) -> torch.Tensor:
    """:class:`AllGatherDispatcher` around ``local_experts``: this rank's ``[S, H]`` output."""
    return AllGatherDispatcher(group).run(x_SH, weights_SK, topk_idx_SK, local_experts)


def alltoall_dispatch(
    x_SH: torch.Tensor,
    weights_SK: torch.Tensor,
    topk_idx_SK: torch.Tensor,
    local_experts: LocalExperts,
    group: dist.ProcessGroup | None,
    num_local: int,
) -> torch.Tensor:
    """:class:`AllToAllDispatcher` around ``local_experts``: this rank's ``[S, H]`` output."""
    return AllToAllDispatcher(group, num_local).run(x_SH, weights_SK, topk_idx_SK, local_experts)


def token_offset(sizes: list[int], group: dist.ProcessGroup | None) -> int:
    """Position of this rank's first token in the EP group's concatenated batch."""
    return sum(sizes[: group_rank(group)])
