"""Timing statistics, saved-for-backward bytes and correctness, the per-provider measurements.

Legend: T tokens, H hidden, K experts per token.
"""
from __future__ import annotations

import contextlib
import statistics
import time
from typing import Callable

import torch

from fastmoe_xpu import frozen_expert_weights

from .cases import Case
from .providers import Provider

#: Largest accepted error of a provider against hf_v4, relative to the reference's largest
#: magnitude (different GEMM blockings and summation orders, same math).
TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 3e-2}
#: Relative error allowed to a provider whose expert GEMMs are quantized (8-bit codes: about 1/127 of
#: each operand's range per element, e5m2 gradients 1/8), whatever the activation dtype.
PRECISION_TOLERANCE = {"int8": 5e-2, "fp8": 2.5e-1, "fp8-block": 2.5e-1}


#: The clock of every timing: wall time (the default), or the process's CPU time, which on a
#: shared machine leaves out the time other jobs hold the cores (only meaningful with one thread:
#: with more, threads spinning at a barrier count as busy).
CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}
_clock = CLOCKS["wall"]


def set_clock(name: str) -> None:
    global _clock
    if name not in CLOCKS:
        raise ValueError(f"clock must be one of {sorted(CLOCKS)}, got {name!r}")
    _clock = CLOCKS[name]


def run_options(args, default_rounds: int = 5) -> int:  # noqa: ANN001
    """Apply ``--threads`` and ``--clock`` of a parsed ``fastmoe-bench`` command line; returns
    ``--rounds`` (``default_rounds`` when not given), ValueError below 1."""
    if args.threads:
        torch.set_num_threads(args.threads)
    set_clock(args.clock)
    return check_rounds(args.rounds, default_rounds)


def check_rounds(rounds: int | None, default: int = 5) -> int:
    """``--rounds``, ``default`` when not given; ValueError below 1."""
    rounds = default if rounds is None else rounds
    if rounds < 1:
        raise ValueError(f"--rounds must be >= 1, got {rounds}")
    return rounds


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "xpu":
        torch.xpu.synchronize(device)


def stats(samples: list[float]) -> dict:
    """Median, spread and extremes of timings in seconds; spread = (max - min) / median."""
    if not samples:
        return {"n": 0}
    med = statistics.median(samples)
    lo, hi = min(samples), max(samples)
    return {
        "n": len(samples),
        "median_s": med,
        "min_s": lo,
        "max_s": hi,
        "spread": (hi - lo) / med if med > 0 else 0.0,
        "samples_s": list(samples),
    }


#: Eager calls before a CUDA graph capture (kernels compiled, engines and configs chosen, the
#: allocator's pools warm), on a side stream as torch's capture recipe asks.
GRAPH_WARMUP = 3


def capture_forward(prov: Provider, case: Case, api=None) -> Callable[[], torch.Tensor]:  # noqa: ANN001
    """The provider's inference forward on the case's fixed inputs, captured once in a CUDA graph
    (``api``: ``torch.cuda`` unless a stand-in is given): after :data:`GRAPH_WARMUP` eager calls on a
    side stream, one call is captured; the returned function replays it and returns the graph's
    output tensor (overwritten by each replay). Raises what the capture raises (a host
    synchronisation inside the forward, say): the caller reports it."""
    api = api or torch.cuda
    dev = case.device
    x, w, idx = case.x_TH.detach(), case.weights_TK.detach(), case.topk_idx_TK
    with torch.no_grad(), frozen_expert_weights():
        side = api.Stream(dev)
        side.wait_stream(api.current_stream(dev))
        with api.stream(side):
            for _ in range(GRAPH_WARMUP):
                prov.forward(x, w, idx)
        api.current_stream(dev).wait_stream(side)
        graph = api.CUDAGraph()
        with api.graph(graph):
            out = prov.forward(x, w, idx)

    def replay() -> torch.Tensor:
        graph.replay()
        return out

    return replay


def timed_call(
    prov: Provider, case: Case, *, backward: bool, capture: bool = False, grad: bool = True,
    graphed: Callable[[], torch.Tensor] | None = None,
) -> tuple[float, float, dict | None]:
    """One training step of the layer: fresh leaves, no gradients held, forward (autograd on) and,
    with ``backward``, backward of ``dout``. ``grad=False``: one inference call instead, the forward
    under ``torch.no_grad`` (no backward). ``graphed`` (inference only): the call is a replay of
    the provider's captured forward (:func:`capture_forward`). An inference call runs inside
    :func:`fastmoe_xpu.frozen_expert_weights`: quantized expert weights are quantized once, not on
    every call. Returns ``(forward_s, backward_s, captured)``."""
    if graphed is not None:
        if grad or backward:
            raise ValueError("a captured forward is timed only as an inference call (grad=False, no backward)")
        dev = case.device
        synchronize(dev)
        t0 = _clock()
        out = graphed()
        synchronize(dev)
        t1 = _clock()
        return t1 - t0, 0.0, ({"out": out.detach().clone()} if capture else None)
    prov.zero_grads()
    x = case.x_TH.detach().requires_grad_(grad)
    w = case.weights_TK.detach().requires_grad_(grad)
    backward = backward and grad
    dev = case.device
    synchronize(dev)
    t0 = _clock()
    # An inference call keeps quantized expert weights across calls, as generation and evaluation
    # should (fastmoe_xpu.frozen_expert_weights); a training step quantizes them anew, as after an update.
    with torch.set_grad_enabled(grad), (frozen_expert_weights() if not grad else contextlib.nullcontext()):
        out = prov.forward(x, w, case.topk_idx_TK)
    synchronize(dev)
    t1 = _clock()
    if backward:
        out.backward(case.dout_TH)
        synchronize(dev)
    t2 = _clock()
    got = None
    if capture:
        got = {"out": out.detach()}
        if backward:
            d_gu, d_d = prov.merged_grads()
            got.update(dx=x.grad, dweights=w.grad, dw_gate_up=d_gu, dw_down=d_d)
    del out
    prov.zero_grads()
    return t1 - t0, (t2 - t1) if backward else 0.0, got


def compare(got: dict, ref: dict, dtype: torch.dtype, precision: str | None = None) -> dict:
    """Per-tensor relative error ``max|got - ref| / max|ref|`` and whether all are within tolerance
    (``precision``: a quantized provider's, :data:`PRECISION_TOLERANCE`)."""
    tol = max(TOLERANCE[dtype], PRECISION_TOLERANCE[precision]) if precision else TOLERANCE[dtype]
    errors: dict[str, float] = {}
    for k, r in ref.items():
        g = got.get(k, "absent")
        if isinstance(g, str):  # this provider did not compute it (e.g. forward-only mode)
            continue
        if r is None or g is None:  # no gradient reached an input: both must agree on that
            errors[k] = 0.0 if r is None and g is None else float("inf")
            continue
        r32, g32 = r.float(), g.float()
        scale = r32.abs().max().item() if r32.numel() else 0.0
        diff = (g32 - r32).abs().max().item() if r32.numel() else 0.0
        errors[k] = diff / scale if scale > 0 else diff
    ok = bool(errors) and all(e <= tol for e in errors.values())
    return {"ok": ok, "tolerance": tol, "max_rel_error": errors}


def saved_bytes(prov: Provider, case: Case) -> int:
    """Bytes autograd keeps for backward after one forward, counted with ``saved_tensors_hooks``:
    distinct storages of saved tensors, leaving out the inputs and the parameters (which exist
    whether or not anything is saved)."""
    prov.zero_grads()
    x = case.x_TH.detach().requires_grad_()
    w = case.weights_TK.detach().requires_grad_()
    exclude = {t.untyped_storage().data_ptr() for t in (x, w, case.topk_idx_TK, *prov.params)}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        st = t.untyped_storage()
        if st.data_ptr() not in exclude:
            seen[st.data_ptr()] = st.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = prov.forward(x, w, case.topk_idx_TK)
    del out
    return sum(seen.values())


def peak_bytes(prov: Provider, case: Case, *, backward: bool, grad: bool = True) -> int | None:
    """Device memory one training step of the layer adds at its peak over what was allocated before it
    (activations, workspaces, gradients; not the inputs or weights): from the allocator's peak counter on
    CUDA and XPU, None on the CPU (no such counter)."""
    dev = case.device
    mod = getattr(torch, dev.type, None) if dev.type in ("cuda", "xpu") else None
    if mod is None or not hasattr(mod, "reset_peak_memory_stats"):
        return None
    synchronize(dev)
    mod.reset_peak_memory_stats(dev)
    before = mod.memory_allocated(dev)
    timed_call(prov, case, backward=backward, grad=grad)
    synchronize(dev)
    return int(mod.max_memory_allocated(dev) - before)


def page_faults() -> int | None:
    """Minor page faults of this process so far (``getrusage``); None where it is not available.

    A fresh page the kernel maps and zeroes on first touch is a minor fault: what an implementation
    that allocates big buffers every step pays on the CPU beyond its arithmetic."""
    try:
        import resource
    except ImportError:  # not on Windows
        return None
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def time_fn(fn: Callable[[], None], device: torch.device) -> float:
    synchronize(device)
    t0 = _clock()
    fn()
    synchronize(device)
    return _clock() - t0
