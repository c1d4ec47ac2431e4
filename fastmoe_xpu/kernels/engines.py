"""Grouped-GEMM engines: who runs the GEMMs of stage 4, and the measured choice between them.

Stage 4 of the launcher contract (:data:`.contract.STAGE4_LAUNCHERS`: ``gate_up_fwd``, ``down_fwd``,
``down_bwd``, ``silu_mul_bwd``, ``gate_up_bwd``) can run on any of three engines, combined with a
kernel backend that keeps stages 2, 3 and 5 (:func:`with_engine`):

``triton``      the Triton kernels of ``kernels/triton/grouped_gemm.py`` (xpu, cuda; the CPU only
                under the interpreter);
``grouped_mm``  PyTorch's grouped GEMM (``kernels/grouped_mm.py``: CUTLASS on sm_90+, the CPU,
                xpu where torch has it), the gather and SiLU*up in plain torch around it;
``loop``        one ``torch.mm`` per expert (``kernels/torch/grouped_gemm.py``, the CPU path).

``gemm_engine`` (a block argument, the trainer's ``model.gemm_engine``, bench's ``--gemm-engine``,
``FASTMOE_GEMM_ENGINE``) is one of those names, ``"native"`` (the backend's own stage 4: ``triton``
for the Triton backend, ``loop`` for the torch backend) or ``"auto"`` (the default): the fastest
available engine, timed once on the real shapes at first use, forward and backward, per device,
dtype and shape bucket (:func:`choose_engine`). Choices are remembered in-process and on disk
(:mod:`.engine_cache`). Under expert parallelism group rank 0 decides and broadcasts its choice, so
every rank runs the same code path (different engines round differently).

Where timing means nothing, ``auto`` is ``native`` without timing: Triton kernels on CPU tensors
run in the interpreter, a correctness tool. A block argument other than ``"auto"`` wins over
``FASTMOE_GEMM_ENGINE``, as ``backend`` does over ``FASTMOE_BACKEND``.
"""
from __future__ import annotations

import functools
import time
from types import ModuleType
from typing import Any, Callable, Mapping, NamedTuple

import torch

from .. import settings
from ..device import cpu_model
from .contract import LAUNCHERS, STAGE4_LAUNCHERS, KernelBackend

#: The engines, in the order ties are broken.
ENGINES = ("loop", "grouped_mm", "triton")
#: Every value ``gemm_engine`` accepts.
CHOICES = settings.GEMM_ENGINES
#: The stage-4 engine each kernel backend had before engines existed.
NATIVE = {"torch": "loop", "triton": "triton"}


def check_choice(gemm_engine: str) -> str:
    """``gemm_engine`` itself, or a ValueError naming the accepted values."""
    if gemm_engine not in CHOICES:
        raise ValueError(f"gemm_engine must be one of {CHOICES}, got {gemm_engine!r}")
    return gemm_engine


def engine_module(engine: str) -> ModuleType:
    """The module holding ``engine``'s stage-4 launchers (imported on first use: triton stays optional)."""
    if engine == "loop":
        from .torch import grouped_gemm as module
    elif engine == "grouped_mm":
        from . import grouped_mm as module
    elif engine == "triton":
        from .triton import grouped_gemm as module
    else:
        raise ValueError(f"unknown gemm engine {engine!r} (expected one of {ENGINES})")
    return module


def unavailable_reason(engine: str, backend: str, device: torch.device | str, dtype: torch.dtype) -> str | None:
    """None when ``engine`` can run stage 4 for ``backend``'s row buffers on ``device`` in ``dtype``; else why not."""
    from ..device import triton_available, triton_interpreting

    dev = torch.device(device)
    if engine == "loop":
        return None
    if engine == "grouped_mm":
        from .grouped_mm import unsupported_reason

        return unsupported_reason(dev, dtype)
    if engine == "triton":
        if not triton_available():
            return "the triton package is not installed"
        if dev.type == "cpu" and not triton_interpreting():
            return "Triton kernels on CPU tensors need TRITON_INTERPRET=1"
        if dev.type not in ("cpu", "cuda", "xpu"):
            return f"no Triton backend for {dev.type} tensors"
        if dtype not in (torch.float32, torch.bfloat16, torch.float16):
            return f"the Triton kernels take float32, bfloat16 or float16, not {dtype}"
        return None
    raise ValueError(f"unknown gemm engine {engine!r} (expected one of {ENGINES})")


class _Composed:
    """A :class:`.contract.KernelBackend`: stages 2, 3 and 5 from a backend, stage 4 from an engine
    (launchers the engine lacks, such as grouped_mm's ``silu_mul_bwd``, from the backend)."""

    def __init__(self, ops: KernelBackend, engine: str) -> None:
        module = engine_module(engine)
        provided = getattr(module, "LAUNCHERS", STAGE4_LAUNCHERS)
        self.NAME = f"{ops.NAME}+{engine}"
        self.backend = ops
        self.engine = engine
        for name in LAUNCHERS:
            source = module if name in STAGE4_LAUNCHERS and name in provided else ops
            setattr(self, name, getattr(source, name))

    def __repr__(self) -> str:
        return f"<kernels {self.NAME}>"


@functools.lru_cache(maxsize=None)
def _composed(ops: Any, engine: str) -> KernelBackend:
    return _Composed(ops, engine)  # type: ignore[return-value]


def with_engine(ops: KernelBackend, engine: str) -> KernelBackend:
    """``ops`` with stage 4 run by ``engine`` (``ops`` itself when that is its native engine). The
    result is cached, so the same pair gives the same object every call."""
    if engine not in ENGINES:
        raise ValueError(f"unknown gemm engine {engine!r} (expected one of {ENGINES})")
    if NATIVE.get(ops.NAME) == engine:
        return ops
    return _composed(ops, engine)


# ---------------------------------------------------------------- the measured choice
class ShapeKey(NamedTuple):
    """What a timed choice is valid for."""

    backend: str
    dtype: str
    hidden: int
    intermediate: int
    local_experts: int
    rows_bucket: int
    """Routed rows T*K rounded up to a power of two (0 under expert parallelism, where ranks see
    different row counts but must take one decision together)."""


def rows_bucket(rows: int) -> int:
    """``rows`` rounded up to a power of two (at least 1): shapes within a factor of two share a choice."""
    return 1 << max(0, int(rows) - 1).bit_length()


def device_name(device: torch.device | str) -> str:
    """A name for the hardware behind ``device``: choices made on one GPU model or CPU (and thread
    count) do not carry over to another."""
    dev = torch.device(device)
    if dev.type == "cuda":
        return f"cuda:{torch.cuda.get_device_name(dev)}"
    if dev.type == "xpu":
        return f"xpu:{torch.xpu.get_device_name(dev)}"
    return f"{dev.type}:{cpu_model()}x{torch.get_num_threads()}"



#: In-process choices: (device name, ShapeKey) -> engine.
_CHOSEN: dict[tuple[str, ShapeKey], str] = {}


def forget_choices() -> None:
    """Drop the in-process choices (the disk cache stays); tests and benchmarks start afresh with it."""
    _CHOSEN.clear()


def candidates(backend: str, device: torch.device | str, dtype: torch.dtype) -> list[str]:
    """The engines ``auto`` may time for ``backend`` on ``device``: the available ones, or only the
    native one where its kernels run in the Triton interpreter."""
    dev = torch.device(device)
    native = NATIVE[backend]
    if backend == "triton" and dev.type == "cpu":
        return [native]
    # Triton kernels on CPU tensors exist only in the interpreter: never a candidate for speed.
    out = [e for e in ENGINES if not (e == "triton" and dev.type == "cpu")
           and unavailable_reason(e, backend, dev, dtype) is None]
    return out or [native]


def resolve_request(gemm_engine: str, backend: str) -> str:
    """A block's ``gemm_engine`` after ``FASTMOE_GEMM_ENGINE``: an engine name, or ``"auto"``."""
    check_choice(gemm_engine)
    if gemm_engine == "auto":
        gemm_engine = settings.get().gemm_engine or "auto"
    if gemm_engine == "native":
        return NATIVE[backend]
    return gemm_engine


def choose_engine(
    gemm_engine: str,
    *,
    backend: str,
    device: torch.device | str,
    dtype: torch.dtype,
    shape: tuple[int, int, int, int],
    measure: Callable[[str], float] | None = None,
    group: Any = None,
    use_disk: bool = True,
) -> str:
    """The engine that runs stage 4.

    ``shape``: ``(H, I, NR, routed rows T*K)``. ``gemm_engine`` other than ``auto`` is checked and
    returned (ValueError when it cannot run here). ``auto``: the in-process choice for this device
    and shape bucket, else the disk cache's, else the fastest candidate by ``measure(engine)`` (the
    seconds of one forward+backward of stage 4 on the real shapes; injectable for tests). ``group``:
    the expert-parallel process group; its rank 0 decides and every rank adopts that choice.
    """
    dev = torch.device(device)
    wanted = resolve_request(gemm_engine, backend)
    if wanted != "auto":
        reason = unavailable_reason(wanted, backend, dev, dtype)
        if reason is not None:
            raise ValueError(f"gemm_engine={wanted!r} cannot run here: {reason}")
        return wanted
    options = candidates(backend, dev, dtype)
    if len(options) == 1:
        return options[0]  # availability is the same on every rank of a group: nothing to agree on
    from ..dist.agree import group_size

    ep = group_size(group) > 1
    H, I, NR, rows = shape
    key = ShapeKey(backend, str(dtype).removeprefix("torch."), int(H), int(I), int(NR), 0 if ep else rows_bucket(rows))
    name = device_name(dev)
    memo = _CHOSEN.get((name, key))
    if memo is not None:
        return memo
    if ep:
        from ..dist.agree import broadcast_from_rank0

        choice = _decide(name, key, options, measure, use_disk) if _group_rank(group) == 0 else None
        choice = broadcast_from_rank0(choice, group)
        if choice not in ENGINES:
            raise RuntimeError(f"expert-parallel rank 0 chose gemm engine {choice!r}, not one of {ENGINES}")
    else:
        choice = _decide(name, key, options, measure, use_disk)
    _CHOSEN[(name, key)] = choice
    return choice


def _group_rank(group: Any) -> int:
    import torch.distributed as dist

    return dist.get_rank(group)


def _decide(name: str, key: ShapeKey, options: list[str], measure: Callable[[str], float] | None,
            use_disk: bool) -> str:
    from . import engine_cache

    if use_disk:
        cached = engine_cache.lookup(name, key)
        if cached in options:
            return cached
    if measure is None:
        raise RuntimeError("choose_engine: gemm_engine='auto' needs a measure to time the candidates")
    seconds = {e: float(measure(e)) for e in options}
    best = min(options, key=lambda e: (seconds[e], ENGINES.index(e)))
    if use_disk:
        engine_cache.store(name, key, best, seconds)
    return best


# ---------------------------------------------------------------- timing on the real shapes
def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "xpu":
        torch.xpu.synchronize(device)


def stage4_timer(
    ops: KernelBackend,
    x_TH: torch.Tensor,
    input_indices: torch.Tensor,
    cum_token_counts: torch.Tensor,
    w_gate_up_N2IH: torch.Tensor,
    w_down_NHI: torch.Tensor,
    *,
    repeats: int = 2,
) -> Callable[[str], float]:
    """``measure(engine)``: seconds of stage 4's forward and backward launchers on these tensors
    with ``engine`` (best of ``repeats`` after one warm-up run, which also compiles or autotunes)."""

    def run(kernels: KernelBackend, dy_RH: torch.Tensor | None) -> torch.Tensor:
        gate_up, h = kernels.gate_up_fwd(x_TH, input_indices, cum_token_counts, w_gate_up_N2IH)
        y = kernels.down_fwd(h, cum_token_counts, w_down_NHI)
        dy = torch.ones_like(y) if dy_RH is None else dy_RH[: y.shape[0]]
        dh, _ = kernels.down_bwd(dy, h, cum_token_counts, w_down_NHI)
        dgu = kernels.silu_mul_bwd(gate_up, dh, cum_token_counts)
        kernels.gate_up_bwd(dgu, x_TH, input_indices, cum_token_counts, w_gate_up_N2IH)
        return y

    dev = x_TH.device

    def measure(engine: str) -> float:
        kernels = with_engine(ops, engine)
        with torch.no_grad():
            run(kernels, None)  # warm-up: first-use costs (compilation, buffers) are not the engine's speed
            best = float("inf")
            for _ in range(max(1, repeats)):
                _sync(dev)
                t0 = time.perf_counter()
                run(kernels, None)
                _sync(dev)
                best = min(best, time.perf_counter() - t0)
        return best

    return measure


def lazy_timer(
    ops: KernelBackend,
    x_TH: torch.Tensor,
    input_indices: torch.Tensor,
    cum_token_counts: torch.Tensor,
    w_gate_up_N2IH: torch.Tensor,
    w_down_NHI: torch.Tensor,
) -> Callable[[str], float]:
    """:func:`stage4_timer` on these tensors, built only if called (a remembered choice never is)."""

    def measure(engine: str) -> float:
        return stage4_timer(ops, x_TH.detach(), input_indices, cum_token_counts, w_gate_up_N2IH.detach(),
                            w_down_NHI.detach())(engine)

    return measure


def describe(choices: Mapping[tuple[str, ShapeKey], str] | None = None) -> list[str]:
    """One line per in-process choice (for logs and the benchmark's notes)."""
    items = (choices if choices is not None else _CHOSEN).items()
    return [f"{name} {key.backend} {key.dtype} H={key.hidden} I={key.intermediate} NR={key.local_experts} "
            f"rows<={key.rows_bucket or 'any'}: {engine}" for (name, key), engine in items]


def chosen_for(backend: str, device: torch.device | str, dtype: torch.dtype,
               shape: tuple[int, int, int, int]) -> str | None:
    """The in-process auto choice for these shapes without expert parallelism (None if none yet)."""
    options = candidates(backend, device, dtype)
    if len(options) == 1:
        return options[0]
    H, I, NR, rows = shape
    key = ShapeKey(backend, str(dtype).removeprefix("torch."), int(H), int(I), int(NR), rows_bucket(rows))
    return _CHOSEN.get((device_name(device), key))
