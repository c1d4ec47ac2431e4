"""Collectives along dim 0, and the autograd Functions the expert-parallel block is built from.

Every tensor is split or concatenated along its first dimension, in group-rank order. A ``group``
of None is torch.distributed's default (world) group, as in torch.distributed's own calls.
``reduce_scatter`` uses the backend's own collective; a backend that reports it unsupported (gloo
in some PyTorch versions) falls back to ``all_reduce`` and a slice, which moves twice the bytes.

Legend: W group size, S rows on this rank, T = W*S rows in all.
"""
from __future__ import annotations

from typing import Sequence

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

from .groups import group_rank, group_size, world_if_none

#: Backends whose ``reduce_scatter`` raised "not supported"; they use all_reduce + slice from then on.
_REDUCE_SCATTER_FALLBACK: set[str] = set()



def _all_gather_fn():
    # all_gather_single is the name from PyTorch 2.11 on; all_gather_into_tensor before.
    return getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def _reduce_scatter_fn():
    return getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def _backend_name(group: dist.ProcessGroup | None) -> str:
    return str(dist.get_backend(group))


# ---------------------------------------------------------------- plain collectives
def all_gather_dim0(x_SX: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """``[S, ...]`` on every rank -> ``[W*S, ...]``, rank blocks in group-rank order (equal S needed)."""
    x_SX = x_SX.contiguous()
    out_TX = x_SX.new_empty((group_size(world_if_none(group)) * x_SX.shape[0], *x_SX.shape[1:]))
    _all_gather_fn()(out_TX, x_SX, group=group)
    return out_TX


def reduce_scatter_dim0(x_TX: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """``[W*S, ...]`` on every rank -> this rank's ``[S, ...]`` block of the sum over ranks."""
    world = group_size(world_if_none(group))
    if x_TX.shape[0] % world:
        raise ValueError(f"reduce_scatter_dim0: {x_TX.shape[0]} rows do not split over {world} ranks")
    x_TX = x_TX.contiguous()
    rows = x_TX.shape[0] // world
    backend = _backend_name(group)
    if backend not in _REDUCE_SCATTER_FALLBACK:
        out_SX = x_TX.new_empty((rows, *x_TX.shape[1:]))
        try:
            _reduce_scatter_fn()(out_SX, x_TX, group=group)
            return out_SX
        except (RuntimeError, NotImplementedError) as err:
            # Raised by the backend before any communication, identically on every rank.
            if "support" not in str(err).lower():
                raise
            _REDUCE_SCATTER_FALLBACK.add(backend)
    return _reduce_scatter_by_all_reduce(x_TX, group)


def _reduce_scatter_by_all_reduce(x_TX: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    world = group_size(world_if_none(group))
    rows = x_TX.shape[0] // world
    summed = x_TX.clone()
    dist.all_reduce(summed, group=group)
    r = group_rank(world_if_none(group))
    return summed[r * rows:(r + 1) * rows].clone()


def all_to_all_dim0(
    x_RX: torch.Tensor,
    out_splits: Sequence[int],
    in_splits: Sequence[int],
    group: dist.ProcessGroup | None,
) -> torch.Tensor:
    """Rows ``[in_splits[0] | in_splits[1] | ...]`` go to ranks 0, 1, ...; ``out_splits[j]`` rows
    arrive from rank j, in rank order."""
    x_RX = x_RX.contiguous()
    if torch.compiler.is_compiling():
        # Splits read from a tensor are unbacked symbols in a trace: state the relation, do not branch on it.
        torch._check(x_RX.shape[0] == sum(in_splits))
        return funcol.all_to_all_single(x_RX, list(out_splits), list(in_splits), world_if_none(group))
    if x_RX.shape[0] != sum(in_splits):
        raise ValueError(f"all_to_all_dim0: {x_RX.shape[0]} rows but in_splits {list(in_splits)} sum to {sum(in_splits)}")
    out_RX = x_RX.new_empty((sum(out_splits), *x_RX.shape[1:]))
    dist.all_to_all_single(out_RX, x_RX, list(out_splits), list(in_splits), group=group)
    return out_RX


# ---------------------------------------------------------------- autograd Functions
class _GatherScatter(torch.autograd.Function):
    """All-gather forward and reduce-scatter backward (``gather=True``), or the reverse: each
    collective's gradient is the other (its adjoint along dim 0)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup | None, gather: bool) -> torch.Tensor:
        ctx.group, ctx.gather = group, gather
        return (all_gather_dim0 if gather else reduce_scatter_dim0)(x, group)

    @staticmethod
    def backward(ctx, dout: torch.Tensor):
        return (
            (reduce_scatter_dim0 if ctx.gather else all_gather_dim0)(dout, ctx.group),  # x
            None,  # group
            None,  # gather
        )


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx,
        x_RX: torch.Tensor,
        out_splits: Sequence[int],
        in_splits: Sequence[int],
        group: dist.ProcessGroup | None,
    ) -> torch.Tensor:
        ctx.group = group
        ctx.out_splits, ctx.in_splits = list(out_splits), list(in_splits)
        return all_to_all_dim0(x_RX, out_splits, in_splits, group)

    @staticmethod
    def backward(ctx, dout_RX: torch.Tensor):
        # The gradient travels the same routes backwards: what arrived from rank j goes back to j.
        return (
            all_to_all_dim0(dout_RX, ctx.in_splits, ctx.out_splits, ctx.group),  # x_RX
            None,  # out_splits
            None,  # in_splits
            None,  # group
        )


# Under torch.compile / torch.export the collectives below take torch's functional collectives
# (``torch.distributed._functional_collectives``), which dynamo traces into the graph and whose
# ``*_autograd`` forms carry the reverse collective as their backward; the in-place c10d calls
# inside the autograd Functions would break the graph. Eager keeps the Functions (their
# reduce-scatter falls back to all_reduce + slice on backends without it, a host-side decision a
# graph cannot take; gloo has the functional reduce-scatter in the PyTorch versions we support).
def forward_allgather_backward_reducescatter(x_SX: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """All-gather ``[S, ...] -> [W*S, ...]``; the gradient is reduce-scattered back to ``[S, ...]``."""
    if torch.compiler.is_compiling():
        return funcol.all_gather_tensor_autograd(x_SX.contiguous(), 0, world_if_none(group))
    return _GatherScatter.apply(x_SX, group, True)


def forward_allgather(x_SX: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """All-gather without a gradient (routing indices)."""
    if torch.compiler.is_compiling():
        return funcol.all_gather_tensor(x_SX.detach().contiguous(), 0, world_if_none(group))
    with torch.no_grad():
        return all_gather_dim0(x_SX.detach(), group)


def forward_reducescatter_backward_allgather(x_TX: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """Reduce-scatter ``[W*S, ...] -> [S, ...]`` (sum over ranks); the gradient is all-gathered."""
    if torch.compiler.is_compiling():
        return funcol.reduce_scatter_tensor_autograd(x_TX.contiguous(), "sum", 0, world_if_none(group))
    return _GatherScatter.apply(x_TX, group, False)


def all_to_all_autograd(
    x_RX: torch.Tensor, out_splits: Sequence[int], in_splits: Sequence[int], group: dist.ProcessGroup | None
) -> torch.Tensor:
    """:func:`all_to_all_dim0` whose gradient takes the reverse all-to-all."""
    if torch.compiler.is_compiling():
        torch._check(x_RX.shape[0] == sum(in_splits))
        return funcol.all_to_all_single_autograd(x_RX.contiguous(), list(out_splits), list(in_splits), world_if_none(group))
    return _AllToAll.apply(x_RX, list(out_splits), list(in_splits), group)


# ---------------------------------------------------------------- agreement before communicating
#: Codes a rank sends in :func:`agree_on_inputs` (0: its input is fine).
_ERROR_CODES = {0: None, 1: "TypeError", 2: "ValueError", 3: "other error"}


def agree_on_inputs(
    group: dist.ProcessGroup | None,
    num_tokens: int,
    local_error: BaseException | None,
    device: torch.device,
) -> list[int]:
    """One small all-gather of ``(token count, error code)`` per rank; returns every rank's token count.

    A rank whose own input was rejected re-raises its error; every other rank raises ValueError
    naming the rejecting ranks. So a bad input on one rank stops all ranks with a clear message
    instead of leaving the others blocked in the next collective.
    """
    if local_error is None:
        code = 0
    elif isinstance(local_error, TypeError):
        code = 1
    elif isinstance(local_error, ValueError):
        code = 2
    else:
        code = 3
    mine = torch.tensor([num_tokens if local_error is None else -1, code], dtype=torch.int64, device=device)
    table = all_gather_dim0(mine.view(1, 2), group).tolist()
    if local_error is not None:
        raise local_error
    bad = [(r, _ERROR_CODES.get(c, "error")) for r, (_, c) in enumerate(table) if c != 0]
    if bad:
        who = ", ".join(f"rank {r} ({kind})" for r, kind in bad)
        raise ValueError(
            f"expert-parallel group rank(s) rejected their input: {who}; see the error raised on those ranks"
        )
    return [n for n, _ in table]


def assert_same_tokens_on_device(group: dist.ProcessGroup | None, num_tokens: int, device: torch.device) -> None:
    """The traced form of the allgather dispatch's size check: every rank's token count gathered
    by a functional all-gather and compared on the device (``torch._assert_async``), so the graph
    holds no host read. A mismatch fails the step on every rank, since all ranks gather the same
    table; it cannot say which input was wrong, as :func:`agree_on_inputs` does eagerly."""
    mine = torch.full((1,), num_tokens, dtype=torch.int64, device=device)
    table = funcol.all_gather_tensor(mine, 0, world_if_none(group))
    torch._assert_async(
        (table == table[0]).all(),
        "allgather dispatch needs the same number of tokens on every EP rank; pad the batches to one "
        "length or use dispatch='alltoall'",
    )
