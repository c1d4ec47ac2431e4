"""Bytes each rank sends and receives per MoE layer under expert parallelism: formula and counter.

"Sent" by a rank is every byte of its collective inputs that must reach another rank, "received"
every byte of its outputs that came from another rank (its own block never crosses the wire).
This is what a direct algorithm moves, and exactly what ring all-gather and ring reduce-scatter
move too. :func:`count_collective_bytes` measures the same quantity by wrapping the
``torch.distributed`` collectives; the tests check the formula against it.

Run ``python -m fastmoe_xpu.dist.comm_bytes`` for the table at the Mula model shapes.

Legend: W EP size, S tokens per rank, H hidden, E experts, K experts per token, NR = E/W,
a activation bytes, RO rows a rank sends in all-to-all dispatch (token, remote-rank pairs), RI rows
it receives.
"""
from __future__ import annotations

import argparse
import contextlib
import inspect
from dataclasses import dataclass, field
from typing import Iterator, Sequence

import torch
import torch.distributed as dist

from .dispatch import INDEX_WIRE_DTYPE
from .sharding import expected_remote_rows, expert_range  # expected_remote_rows: re-exported

INDEX_BYTES = torch.empty((), dtype=INDEX_WIRE_DTYPE).element_size()
#: agree_on_inputs: one int64 pair per rank.
PREFLIGHT_BYTES = 16
#: all-to-all count exchange: one int64 per destination.
COUNT_BYTES = 8


@dataclass(frozen=True)
class CommBytes:
    forward_sent: int
    forward_recv: int
    backward_sent: int
    backward_recv: int

    @property
    def total_sent(self) -> int:
        return self.forward_sent + self.backward_sent

    @property
    def total_recv(self) -> int:
        return self.forward_recv + self.backward_recv


def ep_layer_comm_bytes(
    dispatch: str,
    *,
    hidden: int,
    num_experts: int,
    top_k: int,
    tokens_per_rank: int,
    ep_size: int,
    act_bytes: int = 2,
    rows_sent: float | None = None,
    rows_recv: float | None = None,
    check_inputs: bool = True,
) -> CommBytes:
    """Bytes one rank sends/receives in one MoE layer's forward and backward.

    ``allgather``: depends on shapes only. ``alltoall``: depends on routing through ``rows_sent``
    (RO) and ``rows_recv`` (RI), which count (token, remote rank) pairs; take them from
    :func:`alltoall_remote_rows` for a given routing, or :func:`expected_remote_rows` for uniform
    random routing. ``check_inputs`` is the block's per-forward agreement on input sizes.
    """
    expert_range(num_experts, ep_size, 0)  # validates E % W
    W, S, H, K, a = ep_size, tokens_per_rank, hidden, top_k, act_bytes
    peers = W - 1
    if dispatch == "allgather":
        pre = PREFLIGHT_BYTES * peers if check_inputs else 0
        # all-gathers of x, weights, indices; reduce-scatter of the [W*S, H] partial output.
        fwd = pre + peers * S * (H * a + K * a + K * INDEX_BYTES) + peers * S * H * a
        # all-gather of the output gradient; reduce-scatters of the input and weight gradients.
        bwd = peers * S * H * a + peers * S * H * a + peers * S * K * a
        return CommBytes(fwd, fwd, bwd, bwd)
    if dispatch == "alltoall":
        if rows_sent is None or rows_recv is None:
            raise ValueError("alltoall bytes depend on routing: pass rows_sent and rows_recv")
        RO, RI = rows_sent, rows_recv
        pre = PREFLIGHT_BYTES * peers + COUNT_BYTES * peers
        out_row = (H + K) * a + K * INDEX_BYTES  # token and weights in one buffer, then indices
        fwd_sent = pre + RO * out_row + RI * H * a  # dispatch, then partial sums going home
        fwd_recv = pre + RI * out_row + RO * H * a
        bwd_sent = RO * H * a + RI * (H + K) * a  # output-gradient rows out, token/weight gradients home
        bwd_recv = RI * H * a + RO * (H + K) * a
        return CommBytes(fwd_sent, fwd_recv, bwd_sent, bwd_recv)
    raise ValueError(f"dispatch must be 'allgather' or 'alltoall', got {dispatch!r}")


def alltoall_remote_rows(topk_idx_per_rank: Sequence[torch.Tensor], num_experts: int) -> list[tuple[int, int]]:
    """``(RO, RI)`` for every rank, from each rank's ``[S_r, K]`` routing: how many (token, remote
    rank) pairs it sends and receives in all-to-all dispatch."""
    W = len(topk_idx_per_rank)
    NR = len(expert_range(num_experts, W, 0))
    # wanted[r][d]: tokens of rank r with at least one expert on rank d.
    wanted = []
    for idx_SK in topk_idx_per_rank:
        dest_SK = idx_SK.to(torch.int64) // NR
        hit_SW = torch.zeros(idx_SK.shape[0], W, dtype=torch.bool).scatter_(1, dest_SK.cpu(), True)
        wanted.append(hit_SW.sum(0).tolist())
    sent = [sum(wanted[r][d] for d in range(W) if d != r) for r in range(W)]
    recv = [sum(wanted[s][r] for s in range(W) if s != r) for r in range(W)]
    return list(zip(sent, recv))


def worst_case_remote_rows(tokens_per_rank: int, top_k: int, ep_size: int) -> int:
    """Most RO can be: every token's K experts spread over min(K, W-1) remote ranks."""
    return tokens_per_rank * min(top_k, ep_size - 1)


# ---------------------------------------------------------------- counting real collectives
@dataclass
class ByteCounter:
    """What :func:`count_collective_bytes` saw on this rank: ``(op, sent, received)`` per call."""

    calls: list[tuple[str, int, int]] = field(default_factory=list)

    @property
    def sent(self) -> int:
        return sum(s for _, s, _ in self.calls)

    @property
    def recv(self) -> int:
        return sum(r for _, _, r in self.calls)

    def snapshot(self) -> tuple[int, int]:
        return self.sent, self.recv


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _count_all_gather(b: inspect.BoundArguments) -> tuple[int, int]:
    out, inp = b.arguments["output_tensor"], b.arguments["input_tensor"]
    W = dist.get_world_size(b.arguments.get("group"))
    return _nbytes(inp) * (W - 1), _nbytes(out) - _nbytes(inp)


def _count_reduce_scatter(b: inspect.BoundArguments) -> tuple[int, int]:
    out, inp = b.arguments["output"], b.arguments["input"]
    W = dist.get_world_size(b.arguments.get("group"))
    return _nbytes(inp) - _nbytes(out), _nbytes(out) * (W - 1)


def _count_all_to_all(b: inspect.BoundArguments) -> tuple[int, int]:
    out, inp = b.arguments["output"], b.arguments["input"]
    group = b.arguments.get("group")
    W, me = dist.get_world_size(group), dist.get_rank(group)
    out_splits = b.arguments.get("output_split_sizes") or [out.shape[0] // W] * W
    in_splits = b.arguments.get("input_split_sizes") or [inp.shape[0] // W] * W
    out_row = _nbytes(out) // max(out.shape[0], 1) if out.dim() else out.element_size()
    in_row = _nbytes(inp) // max(inp.shape[0], 1) if inp.dim() else inp.element_size()
    return (sum(in_splits) - in_splits[me]) * in_row, (sum(out_splits) - out_splits[me]) * out_row


def _count_all_reduce(b: inspect.BoundArguments) -> tuple[int, int]:
    W = dist.get_world_size(b.arguments.get("group"))
    n = _nbytes(b.arguments["tensor"]) * 2 * (W - 1) // W  # ring all-reduce
    return n, n


_COUNTERS = {
    "all_gather_single": _count_all_gather,
    "all_gather_into_tensor": _count_all_gather,
    "reduce_scatter_single": _count_reduce_scatter,
    "reduce_scatter_tensor": _count_reduce_scatter,
    "all_to_all_single": _count_all_to_all,
    "all_reduce": _count_all_reduce,
}


@contextlib.contextmanager
def count_collective_bytes() -> Iterator[ByteCounter]:
    """Count this rank's bytes in every ``torch.distributed`` collective called inside the block
    (by replacing the module's functions with counting wrappers for its duration)."""
    counter = ByteCounter()
    originals = {}

    def wrap(name, fn, count):
        sig = inspect.signature(fn)

        def counted(*args, **kwargs):
            b = sig.bind(*args, **kwargs)
            b.apply_defaults()
            sent, recv = count(b)
            counter.calls.append((name, sent, recv))
            return fn(*args, **kwargs)

        return counted

    for name, count in _COUNTERS.items():
        fn = getattr(dist, name, None)
        if fn is not None:
            originals[name] = fn
            setattr(dist, name, wrap(name, fn, count))
    try:
        yield counter
    finally:
        for name, fn in originals.items():
            setattr(dist, name, fn)


# ---------------------------------------------------------------- the table
#: (name, hidden, intermediate, experts, top-k) of the published MoE models.
MULA_SHAPES = {
    "Mula-7B-A1B": (2048, 1024, 64, 8),
    "Mula-20B-A2B": (2048, 1024, 96, 8),
}


def _fur_rows(tokens_per_rank: int, num_experts: int, top_k: int, ep_size: int) -> tuple[float, float]:
    from ..routing import uniform_routing_indices

    idx_all = uniform_routing_indices(tokens_per_rank * ep_size, num_experts, top_k, "cpu")
    rows = alltoall_remote_rows(list(idx_all.split(tokens_per_rank)), num_experts)
    return max(r for r, _ in rows), max(r for _, r in rows)


def table(model: str = "Mula-7B-A1B", seq: int = 2048, ep_sizes: Sequence[int] = (2, 4, 12), act_bytes: int = 2) -> str:
    """Markdown table of MiB sent/received per rank per layer (bf16 activations by default)."""
    H, _, E, K = MULA_SHAPES[model]
    mib = 1 << 20
    lines = [
        f"{model}: H={H}, E={E}, K={K}, S={seq} tokens per rank, {act_bytes}-byte activations; MiB per rank per layer",
        "",
        "| EP | dispatch | routing | fwd sent | fwd recv | bwd sent | bwd recv | total sent |",
        "|---:|---|---|---:|---:|---:|---:|---:|",
    ]
    for W in ep_sizes:
        if E % W:
            lines.append(f"| {W} | - | - | {E} experts do not split over {W} ranks | | | | |")
            continue
        cases = [("allgather", "any", None, None)]
        ro_exp = expected_remote_rows(seq, E, K, W)
        cases.append(("alltoall", "uniform random (expected)", ro_exp, ro_exp))
        cases.append(("alltoall", "forced uniform (busiest rank)", *_fur_rows(seq, E, K, W)))
        wc = worst_case_remote_rows(seq, K, W)
        cases.append(("alltoall", f"each token on min(K, EP-1) = {min(K, W - 1)} remote ranks", wc, wc))
        for dispatch, routing, ro, ri in cases:
            c = ep_layer_comm_bytes(
                dispatch, hidden=H, num_experts=E, top_k=K, tokens_per_rank=seq, ep_size=W, act_bytes=act_bytes,
                rows_sent=ro, rows_recv=ri,
            )
            lines.append(
                f"| {W} | {dispatch} | {routing} | {c.forward_sent / mib:.2f} | {c.forward_recv / mib:.2f} | "
                f"{c.backward_sent / mib:.2f} | {c.backward_recv / mib:.2f} | {c.total_sent / mib:.2f} |"
            )
    return "\n".join(lines)


def counted_layer(dispatch: str, forced_uniform: bool, tokens_per_rank: int, hidden: int, intermediate: int,
                  num_experts: int, top_k: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """On every rank of an initialised group: one EP layer's forward and backward with counted
    collectives. Returns ``(counted, formula)``, each ``(fwd sent, fwd recv, bwd sent, bwd recv)``."""
    from types import SimpleNamespace

    from ..block import FastSparseMoeBlock

    W, r = dist.get_world_size(), dist.get_rank()
    cfg = SimpleNamespace(hidden_size=hidden, intermediate_size=intermediate, num_experts=num_experts,
                          num_experts_per_tok=top_k, norm_topk_prob=True, hidden_act="silu")
    torch.manual_seed(0)  # same router on every rank
    block = FastSparseMoeBlock(cfg, forced_uniform_routing=forced_uniform, ep_group=dist.group.WORLD, dispatch=dispatch)
    gen = torch.Generator().manual_seed(1)
    x_all = torch.randn(W * tokens_per_rank, hidden, generator=gen)
    with torch.no_grad():
        _, _, idx_all = block.route(x_all)
    x = x_all[r * tokens_per_rank:(r + 1) * tokens_per_rank].clone().requires_grad_(True)
    with count_collective_bytes() as counter:
        out = block(x)
        fwd = counter.snapshot()
        out.backward(torch.ones_like(out))
        total = counter.snapshot()
    ro, ri = alltoall_remote_rows(list(idx_all.split(tokens_per_rank)), num_experts)[r]
    f = ep_layer_comm_bytes(dispatch, hidden=hidden, num_experts=num_experts, top_k=top_k,
                            tokens_per_rank=tokens_per_rank, ep_size=W, act_bytes=x.element_size(),
                            rows_sent=ro, rows_recv=ri)
    counted = (fwd[0], fwd[1], total[0] - fwd[0], total[1] - fwd[1])
    return counted, (f.forward_sent, f.forward_recv, f.backward_sent, f.backward_recv)


def check_table(worlds: Sequence[int] = (2, 4), tokens_per_rank: int = 16, hidden: int = 24, intermediate: int = 16,
                num_experts: int = 8, top_k: int = 2) -> str:
    """Counted vs formula bytes on real gloo processes at a small shape, every rank listed."""
    from .testing import run_distributed

    lines = [
        f"counted on gloo vs formula: S={tokens_per_rank}, H={hidden}, E={num_experts}, K={top_k}, fp32; bytes",
        "",
        "| W | dispatch | routing | rank | fwd sent | fwd recv | bwd sent | bwd recv | formula equal |",
        "|---:|---|---|---:|---:|---:|---:|---:|---|",
    ]
    for W in worlds:
        per_rank = run_distributed(_counted_modes, W, tokens_per_rank, hidden, intermediate, num_experts, top_k)
        for i, (dispatch, fur) in enumerate(_CHECK_MODES):
            for r, results in enumerate(per_rank):
                counted, formula = results[i]
                lines.append(
                    f"| {W} | {dispatch} | {'forced uniform' if fur else 'router'} | {r} | "
                    + " | ".join(str(v) for v in counted) + f" | {'yes' if counted == formula else f'NO: {formula}'} |"
                )
    return "\n".join(lines)


_CHECK_MODES = (("allgather", False), ("alltoall", False), ("alltoall", True))


def _counted_modes(*shape: int) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    return [counted_layer(dispatch, fur, *shape) for dispatch, fur in _CHECK_MODES]


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", choices=sorted(MULA_SHAPES), action="append")
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--ep", type=int, nargs="+", default=[2, 4, 12])
    p.add_argument("--check", action="store_true", help="also count bytes on real gloo processes at a small shape")
    args = p.parse_args(argv)
    for model in args.model or ["Mula-7B-A1B", "Mula-20B-A2B"]:
        print(table(model, args.seq, args.ep))
        print()
    if args.check:
        print(check_table())


if __name__ == "__main__":
    main()
