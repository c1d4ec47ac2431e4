"""Memory traffic and launches of the fused expert layer's passes at a real shape, without a GPU.

``python -m bench traffic [--shape qwen3-30b-a3b] [--sets triton triton+fp8] [--table cuda]
[--detail]``

Runs stages 4 and 5 of one layer's forward and backward (:func:`..autograd.ops.mlp_combine_forward`
and :func:`..autograd.ops.mlp_combine_backward_math`, what the experts op runs) on the ``meta``
device: every tensor has its real shape and dtype and no storage, so a 30B-class layer costs nothing.
Each PyTorch operator is counted by a :class:`torch.utils._python_dispatch.TorchDispatchMode` with
the bytes of its tensor inputs (read) and outputs (written): the unique elements of each operand
(an expanded dimension counted once), gathers (``index_select``) reading only the rows they take.
Each Triton kernel is counted where the launchers start it (:mod:`..kernels.triton.launch`, replaced
by a recorder, so nothing runs) with the bytes of its tensor arguments, each once: for a GEMM that is
its operands and output read or written once, the ideal (its operand re-reads across output tiles
hit L2 or not, which this does not model). A host read of device data (``.item()``,
``.tolist()``) cannot run on ``meta`` and fails loudly: a pass that synchronises is found, not
guessed. The Triton tiles, hence grids, come from config table ``--table`` (the default first
config of each list: what a GPU uses before autotuning).

It prints one table per kernel set and pass (launcher): operator and kernel launches, the bytes the
PyTorch operators read and write, the bytes of the kernels' tensor arguments (each once: a GEMM's
operands and output, a quantization kernel's input, codes and scales; a kernel that sweeps its input
twice, as the fp8 quantization kernels do, reads it again, from L2 where it still fits), and the
time all those bytes take at ``--bandwidth`` (HBM, GB/s; 4800 for an H200): a floor for the
memory-bound passes, not a prediction of the GEMMs. ``--detail`` lists every operator and kernel.
"""
from __future__ import annotations

import argparse
import contextlib
import functools
import sys
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Iterator

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

#: Operators that move no data (views, metadata, allocation without a fill).
_FREE = {
    "view", "_unsafe_view", "t", "transpose", "permute", "expand", "slice", "select", "as_strided", "alias",
    "squeeze", "unsqueeze", "detach", "empty", "empty_like", "new_empty", "empty_strided", "new_empty_strided",
    "split", "split_with_sizes", "unbind", "reshape", "lift_fresh", "_reshape_alias", "unflatten", "narrow",
    "chunk", "view_as", "sym_size", "sym_stride", "sym_numel", "sym_storage_offset", "is_same_size",
}
#: Gathers: they read the rows they take (their output's size) and the index, not the whole source.
_GATHERS = {"index_select", "gather", "embedding", "index"}


def unique_bytes(t: torch.Tensor) -> int:
    """Bytes of the distinct elements ``t`` addresses (an expanded, stride-0 dimension counted once)."""
    n = 1
    for size, stride in zip(t.shape, t.stride()):
        if stride != 0:
            n *= size
    return n * t.element_size() if t.numel() else 0


@dataclass
class Op:
    name: str
    kind: str  # "op" (a PyTorch operator) or "kernel" (a Triton launch)
    read: int
    written: int
    shapes: str = ""


@dataclass
class Pass:
    name: str
    ops: list[Op] = field(default_factory=list)

    def totals(self) -> tuple[int, int, int, int]:
        n_op = sum(o.kind == "op" for o in self.ops)
        n_k = sum(o.kind == "kernel" for o in self.ops)
        return n_op, n_k, sum(o.read for o in self.ops), sum(o.written for o in self.ops)


def _desc(t: Any) -> str:
    if isinstance(t, torch.Tensor):
        return f"{str(t.dtype).replace('torch.', '')}{list(t.shape)}"
    return ""


class _Recorder(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.passes: list[Pass] = []
        self.current: Pass | None = None

    def add(self, op: Op) -> None:
        if self.current is None:
            self.current = Pass("(outside a launcher)")
            self.passes.append(self.current)
        self.current.ops.append(op)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        kwargs = kwargs or {}
        name = func.overloadpacket.__name__
        if name == "_local_scalar_dense":
            raise RuntimeError("a host read of device data (.item() / .tolist()) in pass "
                               f"{self.current.name if self.current else '?'}")
        out = func(*args, **kwargs)
        if name in _FREE:
            return out
        ins = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        outs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
        written = sum(unique_bytes(t) for t in outs)
        if name in _GATHERS:
            read = written + sum(unique_bytes(t) for t in ins if not t.is_floating_point())
        elif name in ("zeros", "zero_", "fill_", "full", "new_zeros", "new_full", "ones", "new_ones", "arange"):
            read = 0
        else:
            read = sum(unique_bytes(t) for t in ins if t.dim() > 0)
        self.add(Op(name, "op", read, written, " ".join(_desc(t) for t in ins[:3]) + " -> " +
                    " ".join(_desc(t) for t in outs[:2])))
        return out


@contextlib.contextmanager
def recording() -> Iterator[_Recorder]:
    """A recorder of every PyTorch operator and Triton launch in the block."""
    from fastmoe_xpu.kernels.triton import launch as launch_mod

    rec = _Recorder()
    real = launch_mod.launch

    def record(kernel, grid, args, config, device, **constexprs):  # noqa: ANN001, ANN202
        tensors = [a for a in args if isinstance(a, torch.Tensor)]
        seen, total = set(), 0
        for t in tensors:  # an argument passed twice (a stand-in pointer) counted once
            key = (t.untyped_storage().data_ptr() if t.device.type != "meta" else id(t), t.data_ptr() if
                   t.device.type != "meta" else 0)
            if key in seen:
                continue
            seen.add(key)
            total += unique_bytes(t)
        progs = 1
        for g in grid:
            progs *= int(g)
        name = getattr(kernel, "fn", kernel).__name__
        rec.add(Op(name, "kernel", total, 0, f"{config.name} grid={tuple(int(g) for g in grid)} ({progs} programs)"))

    launch_mod.launch = record
    try:
        with rec:
            yield rec
    finally:
        launch_mod.launch = real


class _Labelled:
    """The launchers of a kernel set, each call opening a new pass named after it."""

    def __init__(self, launchers: Any, rec: _Recorder) -> None:
        self._l, self._rec = launchers, rec

    def __getattr__(self, name: str) -> Any:
        fn = getattr(self._l, name)
        if not callable(fn):
            return fn

        @functools.wraps(fn)
        def call(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
            outer = self._rec.current
            self._rec.current = Pass(name)
            self._rec.passes.append(self._rec.current)
            try:
                return fn(*args, **kwargs)
            finally:
                self._rec.current = outer

        return call


def layer_traffic(kernel_set: str, T: int, H: int, I: int, E: int, K: int, dtype: torch.dtype,
                  table: str = "cuda") -> list[Pass]:
    """The passes of one layer's forward and backward (stages 4-5) on kernel set ``kernel_set``."""
    from fastmoe_xpu.autograd.ops import mlp_combine_backward_math, mlp_combine_forward
    from fastmoe_xpu.kernels import kernels
    from fastmoe_xpu.kernels.configs import use
    from fastmoe_xpu.kernels.quantized import core as qcore

    meta = torch.device("meta")
    R = T * K
    i32 = dict(dtype=torch.int32, device=meta)
    x = torch.empty(T, H, dtype=dtype, device=meta)
    w_gu = torch.empty(E, 2 * I, H, dtype=dtype, device=meta)
    w_d = torch.empty(E, H, I, dtype=dtype, device=meta)
    weights = torch.empty(T, K, dtype=dtype, device=meta)
    rows = (torch.empty(R, **i32), torch.empty(R, **i32), torch.empty(R, **i32), torch.empty(E + 1, **i32),
            torch.empty(T + 1, **i32))
    dout = torch.empty(T, H, dtype=dtype, device=meta)
    qcore.forget_weights()
    with use(table), recording() as rec:
        launchers = _Labelled(kernels(kernel_set), rec)
        out, gate_up = mlp_combine_forward(launchers, x, w_gu, w_d, weights, *rows)
        rec.current = Pass("(between)")
        mlp_combine_backward_math(launchers, dout, x, w_gu, w_d, weights, gate_up, *rows)
    qcore.forget_weights()
    return [p for p in rec.passes if p.ops]


def _gb(n: int) -> str:
    return f"{n / 1e9:.3f}"


def report(kernel_set: str, passes: list[Pass], bandwidth_gbs: float, detail: bool) -> str:
    lines = [f"### {kernel_set}", "",
             "| pass | torch ops | Triton launches | GB torch ops (read + written) | GB Triton kernels (arguments "
             "once) | ms at bandwidth |", "|---|---|---|---|---|---|"]
    tot = [0, 0, 0, 0]
    for p in passes:
        n_op = sum(o.kind == "op" for o in p.ops)
        n_k = sum(o.kind == "kernel" for o in p.ops)
        by_ops = sum(o.read + o.written for o in p.ops if o.kind == "op")
        by_k = sum(o.read + o.written for o in p.ops if o.kind == "kernel")
        tot = [a + b for a, b in zip(tot, (n_op, n_k, by_ops, by_k))]
        lines.append(f"| {p.name} | {n_op} | {n_k} | {_gb(by_ops)} | {_gb(by_k)} | "
                     f"{(by_ops + by_k) / bandwidth_gbs / 1e6:.2f} |")
    lines.append(f"| **total** | {tot[0]} | {tot[1]} | {_gb(tot[2])} | {_gb(tot[3])} | "
                 f"{(tot[2] + tot[3]) / bandwidth_gbs / 1e6:.2f} |")
    if detail:
        lines += ["", "| pass | op / kernel | GB read | GB written | operands |", "|---|---|---|---|---|"]
        for p in passes:
            for o in p.ops:
                lines.append(f"| {p.name} | {o.kind}: {o.name} | {_gb(o.read)} | {_gb(o.written)} | {o.shapes} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    from ..harness.presets import SHAPE_SETS  # the shapes the kit times

    shapes = {p.name: p for p in SHAPE_SETS["practitioners"]}
    parser = argparse.ArgumentParser(prog="fastmoe-bench traffic", description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="qwen3-30b-a3b", choices=sorted(shapes))
    parser.add_argument("--sets", nargs="+", default=["triton", "triton+fp8"], help="kernel sets to count")
    parser.add_argument("--dtype", default="bf16", choices=("bf16", "fp32"))
    parser.add_argument("--table", default="cuda", help="Triton config table for tiles and grids")
    parser.add_argument("--bandwidth", type=float, default=4800.0, help="HBM GB/s for the time column")
    parser.add_argument("--detail", action="store_true", help="every operator and kernel")
    args = parser.parse_args(argv)
    p = shapes[args.shape]
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    T = p.tokens_per_rank * p.ep
    print(f"{p.name}: T={T} H={p.hidden} I={p.intermediate} E={p.local_experts} K={p.top_k} {args.dtype}, "
          f"config table {args.table}, times at {args.bandwidth:.0f} GB/s\n")
    for ks in args.sets:
        print(report(ks, layer_traffic(ks, T, p.hidden, p.intermediate, p.local_experts, p.top_k, dtype, args.table),
                     args.bandwidth, args.detail))
        print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
