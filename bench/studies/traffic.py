"""Memory traffic and launches of the fused expert layer's passes at a real shape, without a GPU.

``python -m bench traffic [--shape qwen3-30b-a3b ...|all] [--sets triton triton+fp8] [--table cuda]
[--device-model h200|h100] [--detail] [--time cuda]``

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
time all those bytes take at ``--bandwidth`` (HBM, GB/s), each pass's GEMM FLOPs and their time at
``--peak-tflops`` (dense, the set's operand type), and the pass's roofline floor: the longer of the
two (both from ``--device-model``, h200 or h100; the floor is what no kernel beats, not a
prediction). ``--detail`` lists every operator and kernel.

``--time DEVICE`` runs the same passes on real tensors on DEVICE and times each pass and each Triton
launch in it (CUDA / XPU events; the host clock on the CPU, where only the torch set runs), the
minimum of ``--rounds`` calls after a warm-up one, beside the pass's counted bytes and FLOPs: GB/s and
TFLOP/s achieved. ``--scale`` and ``--tokens`` shrink the shape (a CPU-sized layer).
"""
from __future__ import annotations

import contextlib
import functools
import sys
import time
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from ..harness.usage import Parser, count, fail, seconds

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
    regathered: int = 0  #: bytes more if every gathered row were read from HBM (:data:`GATHERED_OPERANDS`)


@dataclass
class Pass:
    name: str
    ops: list[Op] = field(default_factory=list)
    flops: int = 0  #: the pass's GEMM FLOPs (:func:`gemm_flops`)

    def totals(self) -> tuple[int, int, int, int]:
        n_op = sum(o.kind == "op" for o in self.ops)
        n_k = sum(o.kind == "kernel" for o in self.ops)
        return n_op, n_k, sum(o.read for o in self.ops), sum(o.written for o in self.ops)


#: Kernels that read an operand's rows through an index: ``name -> [(operand arg, index arg, constexpr
#: that turns the gather on (``"NAME=value"``: when it has that value), or None: always)]``. Counted once (its distinct rows) in the table; a row
#: taken by K routed rows is read K times, from L2 when it is still there, from HBM when not.
GATHERED_OPERANDS = {
    "_gate_up_fwd_kernel": [(0, 1, None)],
    "_grouped_mm_fwd_kernel": [(0, 1, "GATHER_A")],
    "_grouped_mm_bwd_kernel": [(1, 2, "GATHER"), (0, 2, "GATHER_A")],
    "_int8_grouped_mm_kernel": [(0, 2, "GATHER")],
    "_fp8_grouped_mm_kernel": [(0, 2, "GATHER")],
    "_fp8q_rows_kernel": [(0, 1, "GATHER")],
    "_fp8q_cols_kernel": [(0, 1, "GATHER")],
    "_fp8b_grouped_mm_kernel": [(0, 1, "A_MODE=gather")],
    "_fp8b_grouped_wgrad_kernel": [(0, 1, "L_GATHER"), (2, 3, "R_GATHER")],
}


def regathered_bytes(name: str, args: Any, constexprs: dict) -> int:
    """The bytes a launch of kernel ``name`` reads beyond its gathered operands' distinct rows when
    every gathered row comes from HBM: ``len(index) * row bytes - the operand's bytes``."""
    extra = 0
    for src, idx, flag in GATHERED_OPERANDS.get(name, ()):
        if flag is not None:
            name, is_value, value = flag.partition("=")  # "NAME": a true constexpr; "NAME=v": that value
            if (str(constexprs.get(name)) != value) if is_value else not constexprs.get(name):
                continue
        a, rows = args[src], args[idx]
        extra += max(0, rows.numel() * a.stride(0) * a.element_size() - unique_bytes(a))
    return extra


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
        if name == "_local_scalar_dense" and args[0].device.type != "cpu":  # a sync on a device (on the CPU: a read)
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
        rec.add(Op(name, "kernel", total, 0, f"{config.name} grid={tuple(int(g) for g in grid)} ({progs} programs)",
                   regathered_bytes(name, args, constexprs)))

    launch_mod.launch = record
    try:
        with rec:
            yield rec
    finally:
        launch_mod.launch = real


#: A kernel set named ``<set>:composed``: the set without its fused launchers (``contract.FUSED_LAUNCHERS``),
#: so the op composes their work from the required ones, as before the fusion; to compare the two.
COMPOSED = ":composed"


def _launchers(kernel_set: str) -> tuple[Any, frozenset]:
    """The launchers of ``kernel_set`` and the names hidden from the op (``:composed``: the fused ones)."""
    from fastmoe_xpu.kernels import kernels
    from fastmoe_xpu.kernels.contract import FUSED_LAUNCHERS

    if kernel_set.endswith(COMPOSED):
        return kernels(kernel_set[:-len(COMPOSED)]), frozenset(FUSED_LAUNCHERS)
    return kernels(kernel_set), frozenset()


class _Labelled:
    """The launchers of a kernel set, each call run inside ``around(name)`` (a context manager: a new
    pass named after the launcher, or a timed span); the names in ``hidden`` are absent."""

    def __init__(self, launchers: Any, hidden: frozenset, around: Callable[[str], Any]) -> None:
        self._l, self._around, self._hidden = launchers, around, hidden

    def __getattr__(self, name: str) -> Any:
        if name in self._hidden:
            raise AttributeError(name)
        fn = getattr(self._l, name)
        if not callable(fn):
            return fn

        @functools.wraps(fn)
        def call(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
            with self._around(name):
                return fn(*args, **kwargs)

        return call


@contextlib.contextmanager
def _new_pass(rec: _Recorder, name: str) -> Iterator[None]:
    outer = rec.current
    rec.current = Pass(name)
    rec.passes.append(rec.current)
    try:
        yield
    finally:
        rec.current = outer


#: Multiply-accumulates of each GEMM pass per routed row, over H * I: gate/up forward [R, H] x [H, 2I];
#: down forward [R, I] x [I, H]; the down backward's input gradient and weight gradient (one down GEMM
#: each); the gate/up backward's input gradient and weight gradient (one gate/up GEMM each). The other
#: passes (combine, SiLU*up backward, router weights) do no GEMM.
GEMM_MACS_PER_ROW_HI = {"gate_up_fwd": 2, "down_fwd": 1, "gate_up_down_fwd": 3, "down_weighted_bwd": 2, "down_silu_bwd": 2,
                        "gate_up_bwd": 4}


def gemm_flops(pass_name: str, T: int, H: int, I: int, K: int) -> int:
    """The GEMM FLOPs (2 per multiply-accumulate) of pass ``pass_name`` over the R = T * K routed rows."""
    return 2 * GEMM_MACS_PER_ROW_HI.get(pass_name, 0) * T * K * H * I


@dataclass(frozen=True)
class DeviceModel:
    """The roofline of a device: HBM bandwidth and dense tensor-core peaks (the vendor's figures)."""
    bandwidth_gbs: float
    peak_tflops: dict  #: by operand type: bf16 (fp16), fp8, fp32 (TF32)


#: H200 and H100 SXM: 4.8 and 3.35 TB/s; dense (no sparsity) 989 TFLOP/s bf16, 1979 fp8, 495 TF32.
DEVICE_MODELS = {"h200": DeviceModel(4800.0, {"bf16": 989.0, "fp8": 1979.0, "fp32": 495.0}),
                 "h100": DeviceModel(3350.0, {"bf16": 989.0, "fp8": 1979.0, "fp32": 495.0})}


def floor_ms(nbytes: int, flops: int, bandwidth_gbs: float, peak_tflops: float) -> float:
    """The roofline floor of a pass: the longer of its bytes at the bandwidth and its FLOPs at the peak."""
    return max(nbytes / bandwidth_gbs / 1e6, flops / peak_tflops / 1e9)


def layer_inputs(T: int, H: int, I: int, E: int, K: int, dtype: torch.dtype, device: str | torch.device = "meta",
                 kernel_set: str = "triton", seed: int = 0) -> tuple[torch.Tensor, ...]:
    """``(x, w_gate_up, w_down, weights, *rows, dout)`` of one layer: on ``meta`` shapes only; on a real
    device random values, each token routed to K distinct experts by ``kernel_set``'s routing."""
    device = torch.device(device)
    if device.type == "meta":
        i32 = dict(dtype=torch.int32, device=device)
        R = T * K
        rows = (torch.empty(R, **i32), torch.empty(R, **i32), torch.empty(R, **i32), torch.empty(E + 1, **i32),
                torch.empty(T + 1, **i32))
        new = functools.partial(torch.empty, dtype=dtype, device=device)
    else:
        from fastmoe_xpu.autograd.ops import route

        from ..harness.cases import generator

        g = generator(device, seed)  # on a GPU drawn there: billions of elements at T=32k (cases.draw_device)
        topk = torch.rand(T, E, generator=g, device=g.device).topk(K, dim=1).indices.to(device)
        rows = route(topk, 0, E, kernel_set.removesuffix(COMPOSED), False)

        def new(*shape: int) -> torch.Tensor:
            return (torch.randn(*shape, generator=g, device=g.device) / H ** 0.5).to(device=device, dtype=dtype)
    return (new(T, H), new(E, 2 * I, H), new(E, H, I), new(T, K), *rows, new(T, H))


def _layer_passes(launchers: Any, inputs: tuple[torch.Tensor, ...], between=lambda: None) -> None:  # noqa: ANN001
    """One layer's forward and backward (stages 4-5) on ``launchers``; ``between()`` after the forward."""
    from fastmoe_xpu.autograd.ops import mlp_combine_backward_math, mlp_combine_forward

    x, w_gu, w_d, weights, *rows, dout = inputs
    out, gate_up = mlp_combine_forward(launchers, x, w_gu, w_d, weights, *rows)
    between()
    mlp_combine_backward_math(launchers, dout, x, w_gu, w_d, weights, gate_up, *rows)


def layer_traffic(kernel_set: str, T: int, H: int, I: int, E: int, K: int, dtype: torch.dtype,
                  table: str = "cuda") -> list[Pass]:
    """The passes of one layer's forward and backward (stages 4-5) on kernel set ``kernel_set``, each
    with its GEMM FLOPs (``<set>:composed``: without its fused launchers)."""
    return count_passes(kernel_set, layer_inputs(T, H, I, E, K, dtype), table)


def count_passes(kernel_set: str, inputs: tuple[torch.Tensor, ...], table: str = "cuda") -> list[Pass]:
    """The passes of one forward and backward on ``inputs`` (:func:`layer_inputs`), counted; the Triton
    kernels do not run (on a real device their outputs are left unwritten)."""
    from fastmoe_xpu.kernels.configs import use
    from fastmoe_xpu.kernels.quantized import core as qcore

    (T, H), (_, I2, _), K = inputs[0].shape, inputs[1].shape, inputs[3].shape[1]
    qcore.forget_weights()
    launchers, hidden = _launchers(kernel_set)
    with use(table), recording() as rec:
        _layer_passes(_Labelled(launchers, hidden, functools.partial(_new_pass, rec)), inputs,
                      between=lambda: setattr(rec, "current", Pass("(between)")))
    qcore.forget_weights()
    passes = [p for p in rec.passes if p.ops]
    for p in passes:
        p.flops = gemm_flops(p.name, T, H, I2 // 2, K)
    return passes


def _gb(n: int) -> str:
    return f"{n / 1e9:.3f}"


def report(kernel_set: str, passes: list[Pass], bandwidth_gbs: float, detail: bool,
           peak_tflops: float | None = None) -> str:
    """The table of one kernel set: per pass its launches, bytes, GEMM FLOPs and roofline floor (the
    longer of its bytes at ``bandwidth_gbs`` and its FLOPs at ``peak_tflops``), and a total line."""
    lines = [f"### {kernel_set}", "",
             "| pass | torch ops | Triton launches | GB torch ops (read + written) | GB Triton kernels (arguments "
             "once) | GB if gathered rows miss L2 | ms at bandwidth | GEMM GFLOP | ms at peak | floor ms |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    tot = [0, 0, 0, 0, 0, 0]
    floor_total = 0.0
    for p in passes:
        n_op = sum(o.kind == "op" for o in p.ops)
        n_k = sum(o.kind == "kernel" for o in p.ops)
        by_ops = sum(o.read + o.written for o in p.ops if o.kind == "op")
        by_k = sum(o.read + o.written for o in p.ops if o.kind == "kernel")
        regather = sum(o.regathered for o in p.ops)
        tot = [a + b for a, b in zip(tot, (n_op, n_k, by_ops, by_k, p.flops, regather))]
        floor = floor_ms(by_ops + by_k, p.flops, bandwidth_gbs, peak_tflops or float("inf"))
        floor_total += floor
        lines.append(f"| {p.name} | {n_op} | {n_k} | {_gb(by_ops)} | {_gb(by_k)} | {_gb(by_k + regather)} | "
                     f"{(by_ops + by_k) / bandwidth_gbs / 1e6:.2f} | {p.flops / 1e9:.1f} | "
                     f"{_at_peak(p.flops, peak_tflops)} | "
                     f"{floor:.2f} |")
    lines.append(f"| **total** | {tot[0]} | {tot[1]} | {_gb(tot[2])} | {_gb(tot[3])} | {_gb(tot[3] + tot[5])} | "
                 f"{(tot[2] + tot[3]) / bandwidth_gbs / 1e6:.2f} | {tot[4] / 1e9:.1f} | "
                 f"{_at_peak(tot[4], peak_tflops)} | "
                 f"{floor_total:.2f} |")
    if detail:
        lines += ["", "| pass | op / kernel | GB read | GB written | operands |", "|---|---|---|---|---|"]
        for p in passes:
            for o in p.ops:
                lines.append(f"| {p.name} | {o.kind}: {o.name} | {_gb(o.read)} | {_gb(o.written)} | {o.shapes} |")
    return "\n".join(lines)


def _at_peak(flops: int, peak_tflops: float | None) -> str:
    return "-" if not peak_tflops else f"{flops / peak_tflops / 1e9:.2f}"


def peak_for(model: DeviceModel, kernel_set: str, dtype: str) -> float:
    """The dense peak a set's GEMMs run against: fp8 for an fp8 set, else the operands' type."""
    return model.peak_tflops["fp8" if "fp8" in kernel_set else dtype]


# ---------------------------------------------------------------- each launch timed on a device
@dataclass
class Span:
    pass_name: str
    launch: str | None  #: a Triton kernel, or None for the whole pass (launcher call)
    ms: float


class _Clock:
    """Marks on the device's stream (CUDA or XPU events), or the host clock on the CPU; read after a sync."""

    def __init__(self, device: torch.device) -> None:
        self.event = {"cuda": getattr(torch.cuda, "Event", None),
                      "xpu": getattr(getattr(torch, "xpu", None), "Event", None)}.get(device.type)

    def mark(self) -> Any:
        if self.event is None:
            return time.perf_counter()
        e = self.event(enable_timing=True)
        e.record()
        return e

    def ms(self, a: Any, b: Any) -> float:
        return 1e3 * (b - a) if self.event is None else a.elapsed_time(b)


def time_launches(kernel_set: str, inputs: tuple[torch.Tensor, ...], table: str = "cuda",
                  rounds: int = 3) -> list[Span]:
    """Each pass of one forward and backward on ``inputs`` timed, and each Triton launch in it: the
    minimum over ``rounds`` calls after a warm-up one (CUDA / XPU events on a device, the host clock on
    the CPU, where the torch set's passes are its launches)."""
    from fastmoe_xpu.kernels.configs import use
    from fastmoe_xpu.kernels.quantized import core as qcore
    from fastmoe_xpu.kernels.triton import launch as launch_mod

    from ..harness.measure import synchronize

    device = inputs[0].device
    clock = _Clock(device)
    marks: list[tuple[str, str | None, Any, Any]] = []
    current = ["(outside a launcher)"]
    real = launch_mod.launch

    def timed_launch(kernel, grid, args, config, device, **constexprs):  # noqa: ANN001, ANN202
        a = clock.mark()
        real(kernel, grid, args, config, device, **constexprs)
        marks.append((current[0], getattr(kernel, "fn", kernel).__name__, a, clock.mark()))

    @contextlib.contextmanager
    def span(name: str) -> Iterator[None]:
        outer, current[0] = current[0], name
        a = clock.mark()
        try:
            yield
        finally:
            marks.append((name, None, a, clock.mark()))
            current[0] = outer

    best: list[Span] = []
    launch_mod.launch = timed_launch
    try:
        with use(table), torch.no_grad():
            launchers = _Labelled(*_launchers(kernel_set), span)
            for r in range(rounds + 1):
                marks.clear()
                _layer_passes(launchers, inputs)
                synchronize(device)
                got = [Span(p, k, clock.ms(a, b)) for p, k, a, b in marks]
                if r == 1:
                    best = got
                elif r > 1:
                    best = [Span(b.pass_name, b.launch, min(b.ms, g.ms)) for b, g in zip(best, got)]
    finally:
        launch_mod.launch = real
        qcore.forget_weights()
    return best


def timed_report(kernel_set: str, spans: list[Span], passes: list[Pass]) -> str:
    """Each pass's measured time beside its counted bytes and FLOPs (GB/s, TFLOP/s), its Triton
    launches under it; ``passes``: :func:`count_passes` of the same inputs (the same order)."""
    lines = [f"### {kernel_set}, each launch timed", "", "| pass | launch | ms | GB | GB/s | GEMM GFLOP | TFLOP/s |",
             "|---|---|---|---|---|---|---|"]
    whole = [s for s in spans if s.launch is None]
    if [s.pass_name for s in whole] != [p.name for p in passes]:
        raise RuntimeError(f"timed passes {[s.pass_name for s in whole]} differ from the counted "
                           f"{[p.name for p in passes]}")

    def row(name: str, launch: str, ms: float, nbytes: int | None, flops: int | None) -> str:
        gbs = "-" if nbytes is None or ms <= 0 else f"{nbytes / ms / 1e6:.0f}"
        gb = "-" if nbytes is None else _gb(nbytes)
        tf = "-" if not flops or ms <= 0 else f"{flops / ms / 1e9:.1f}"
        gflop = "-" if flops is None else f"{flops / 1e9:.1f}"
        return f"| {name} | {launch} | {ms:.3f} | {gb} | {gbs} | {gflop} | {tf} |"

    tot_ms = 0.0
    launches = iter(s for s in spans if s.launch is not None)
    for s, p in zip(whole, passes):
        kernels_ = [o for o in p.ops if o.kind == "kernel"]
        nbytes = sum(o.read + o.written for o in p.ops)
        lines.append(row(p.name, "(pass)", s.ms, nbytes, p.flops))
        tot_ms += s.ms
        for o in kernels_:
            k = next(launches)
            if k.launch != o.name:
                raise RuntimeError(f"pass {p.name}: timed launch {k.launch} where {o.name} was counted")
            lines.append(row("", k.launch, k.ms, o.read + o.written, p.flops if len(kernels_) == 1 else None))
    nbytes = sum(o.read + o.written for p in passes for o in p.ops)
    lines.append(row("**total**", f"{sum(len([o for o in p.ops if o.kind == 'kernel']) for p in passes)} launches",
                     tot_ms, nbytes, sum(p.flops for p in passes)))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    from ..harness.presets import SHAPE_SETS, shape_set  # the shapes the kit times

    names = [p.name for p in SHAPE_SETS["practitioners"]]
    parser = Parser(prog="fastmoe-bench traffic", description=__doc__.splitlines()[0])
    parser.add_argument("--shape", nargs="+", default=["qwen3-30b-a3b"], choices=[*sorted(names), "all"],
                        help="shapes of the practitioners' set, or all (default qwen3-30b-a3b)")
    parser.add_argument("--sets", nargs="+", default=["triton", "triton+fp8"], help="kernel sets to count")
    parser.add_argument("--dtype", default="bf16", choices=("bf16", "fp32"))
    parser.add_argument("--table", default="cuda", help="Triton config table for tiles and grids")
    parser.add_argument("--device-model", default="h200", choices=sorted(DEVICE_MODELS),
                        help="the roofline's bandwidth and dense peaks: h200 (4.8 TB/s) or h100 (SXM, 3.35 TB/s); "
                             "989 TFLOP/s bf16, 1979 fp8, 495 TF32 (default h200)")
    parser.add_argument("--bandwidth", type=seconds, default=None, help="HBM GB/s (default: the device model's)")
    parser.add_argument("--peak-tflops", type=seconds, default=None,
                        help="dense TFLOP/s of the GEMMs (default: the device model's for the set's operands)")
    parser.add_argument("--detail", action="store_true", help="every operator and kernel")
    parser.add_argument("--time", default=None, choices=("cpu", "cuda", "xpu"), metavar="DEVICE",
                        help="also run the passes on DEVICE and time each launch (ms, GB/s, TFLOP/s)")
    parser.add_argument("--rounds", type=count, default=3, help="with --time: timed calls after a warm-up one")
    parser.add_argument("--scale", type=count, default=1, help="divide H and I by this (a smaller layer)")
    parser.add_argument("--tokens", type=count, default=None, help="T (default: the shape's, 32768)")
    args = parser.parse_args(argv)
    if args.time == "cpu" and set(args.sets) != {"torch"}:
        fail("error: --time cpu times the torch set only (Triton on the CPU is its interpreter): add --sets torch "
             "(see fastmoe-bench traffic --help)")
    if args.time is not None:
        from ..cli import _check_device

        try:
            _check_device(args.time)
        except ValueError as exc:
            fail(f"error: {exc} (--time {args.time})")
    model = DEVICE_MODELS[args.device_model]
    bandwidth = args.bandwidth or model.bandwidth_gbs
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    for p in shape_set("practitioners", scale=args.scale, tokens=args.tokens):
        if "all" not in args.shape and p.name.split("/")[0] not in args.shape:
            continue
        T = p.tokens_per_rank * p.ep
        shape = (T, p.hidden, p.intermediate, p.local_experts, p.top_k)
        print(f"{p.name}: T={T} H={p.hidden} I={p.intermediate} E={p.local_experts} K={p.top_k} {args.dtype}, "
              f"config table {args.table}, roofline of {args.device_model}: {bandwidth:.0f} GB/s\n")
        for ks in args.sets:
            peak = args.peak_tflops or peak_for(model, ks, args.dtype)
            if args.time is None or ks != "torch":  # the torch set reads its bounds on the host: not on meta
                passes = layer_traffic(ks, *shape, dtype, args.table)
                print(report(ks, passes, bandwidth, args.detail, peak))
                print(f"(GEMM FLOPs at {peak:.0f} TFLOP/s; floor: the longer of bytes at the bandwidth and FLOPs "
                      "at the peak, per pass)")
                print(fused_vs_composed(ks, passes, shape, dtype, args.table) + "\n")
            if args.time is not None:
                print(time_report(ks, shape, dtype, args.time, args.table, args.rounds), flush=True)
                print()
    return 0


def fused_vs_composed(kernel_set: str, passes: list[Pass], shape: tuple[int, int, int, int, int],
                      dtype: torch.dtype, table: str) -> str:
    """One line: the set's bytes against the same set without its fused launchers (``<set>:composed``),
    both ways of counting; empty when the set has no fused launcher the layer uses."""
    if kernel_set.endswith(COMPOSED):
        return ""
    composed = layer_traffic(kernel_set + COMPOSED, *shape, dtype, table)
    if [p.name for p in composed] == [p.name for p in passes]:
        return ""

    def gb(ps: list[Pass]) -> tuple[int, int]:
        once = sum(o.read + o.written for p in ps for o in p.ops)
        return once, once + sum(o.regathered for p in ps for o in p.ops)

    (f1, f2), (c1, c2) = gb(passes), gb(composed)
    return (f"F+B bytes with the fused launchers: {_gb(f1)} GB (arguments once), {_gb(f2)} GB (gathered rows "
            f"from HBM); composed ({kernel_set}{COMPOSED}): {_gb(c1)} / {_gb(c2)} GB: {100 * (1 - f1 / c1):.1f}% / "
            f"{100 * (1 - f2 / c2):.1f}% fewer")


def time_report(kernel_set: str, shape: tuple[int, int, int, int, int], dtype: torch.dtype, device: str,
                table: str, rounds: int) -> str:
    """:func:`timed_report` of one kernel set at ``shape`` (T, H, I, E, K) on ``device``, or why it did not run."""
    try:
        inputs = layer_inputs(*shape, dtype, device, kernel_set)
        return timed_report(kernel_set, time_launches(kernel_set, inputs, table, rounds),
                            count_passes(kernel_set, inputs, table))
    except torch.OutOfMemoryError as exc:
        return f"### {kernel_set}, each launch timed: not run, out of memory ({str(exc).splitlines()[0]})"
    finally:
        inputs = None
        if device == "cuda":
            torch.cuda.empty_cache()


if __name__ == "__main__":
    sys.exit(main())
