"""The implementation registry: which kernels run stages 2-5, chosen in one place.

The table of implementations (:class:`Implementation`, :data:`IMPLEMENTATIONS`) and the kernel sets
built from it (:func:`kernels`) are declared in :mod:`.implementations` and re-exported here.

:func:`select` is the one choice: the base from the block's ``backend`` (``FASTMOE_BACKEND``), the
stage-4 implementation from ``gemm_engine`` (``FASTMOE_GEMM_ENGINE``): a name, ``"native"`` or
``"auto"`` (the default: the fastest available one, timed in interleaved rounds per device, dtype and
shape bucket on the real shapes, remembered in-process, and on disk only when the timing was
trusted, :mod:`.timing`; a forward call without a backward of a shape not chosen yet runs
:data:`SMALL_LAYER_ENGINE` untimed until the shape recurs, :data:`INFERENCE_TIME_AFTER`; a choice in
use is watched and timed again when it came from an untrusted timing or runs far slower than timed,
:class:`Watch`; under expert parallelism group rank 0 decides and every rank adopts its choice,
since different engines round differently). Where
timing means nothing (Triton kernels on CPU tensors run in the interpreter) ``auto`` is ``native``.
"""
from __future__ import annotations

import time
from typing import Any, Callable, Hashable, Mapping, NamedTuple

import torch

from .. import settings
from .implementations import (  # noqa: F401  (re-exported: the registry's one import path)
    BASES, CHOICES, ENGINES, GEMMS, IMPLEMENTATIONS, LAYERS, NATIVE, PRECISIONS, STAGES, Implementation, KernelSet,
    _low_rank_set, _triton_available, check_choice, kernel_set_name, kernels, low_rank_kernels, module_of,
    triton_interpreting, unavailable_reason,
)
from .timing import apart_from_caller, capturing


# ---------------------------------------------------------------- the base: stages 2, 3 and 5
def resolve_backend(backend: str, device: torch.device | str) -> str:
    """A block's ``backend`` (``"auto"``, ``"torch"`` or ``"triton"``) as the base that runs on
    ``device``: ``auto`` is ``FASTMOE_BACKEND`` if set, else Triton on xpu/cuda (when installed),
    else torch. Raises when the choice cannot run there."""
    if backend not in ("auto", *BASES):
        raise ValueError(f"backend must be one of {('auto', *BASES)}, got {backend!r}")
    dev = torch.device(device)
    if backend == "auto":
        backend = settings.get().backend or (
            "triton" if dev.type in ("xpu", "cuda") and _triton_available() else "torch")
    if backend == "triton":
        if not _triton_available():
            raise RuntimeError("backend='triton' needs the 'triton' package (pip install triton)")
        if dev.type == "cpu" and not triton_interpreting():
            raise RuntimeError(
                "backend='triton' on CPU tensors runs only under the Triton interpreter: "
                "set TRITON_INTERPRET=1 before importing triton, or use backend='torch'"
            )
    return backend


# ---------------------------------------------------------------- the measured choice of stage 4
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
    from .timing import pow2_bucket

    return pow2_bucket(rows)


#: In-process choices: (device name, ShapeKey) -> engine.
_CHOSEN: dict[tuple[str, ShapeKey], str] = {}


#: Answers of :func:`choose_engine` by its arguments and the settings in force, so that a layer's
#: every call after the first costs one dict lookup.
_ANSWERS: dict[tuple, str] = {}


#: Answers of :func:`whole_layer` by its arguments and the settings in force.
_LAYER_ANSWERS: dict[tuple, str | None] = {}


def forget_choices() -> None:
    """Drop the in-process choices (the disk cache stays); tests and benchmarks start afresh with it."""
    _CHOSEN.clear()
    _WATCHES.clear()
    _ANSWERS.clear()
    _LAYER_ANSWERS.clear()
    _UNTIMED_ANSWERS.clear()
    _INFERENCE_SEEN.clear()
    _PRECISION_ANSWERS.clear()


def candidates(backend: str, device: torch.device | str, dtype: torch.dtype) -> list[str]:
    """The engines ``auto`` may time for ``backend`` on ``device``: the available, timeable ones
    (only the native one where the base itself may not be timed, as in the Triton interpreter)."""
    dev = torch.device(device)
    native = NATIVE[backend]
    if not IMPLEMENTATIONS[backend].timed(dev):
        return [native]
    out = [e for e in ENGINES if IMPLEMENTATIONS[e].timed(dev) and unavailable_reason(e, backend, dev, dtype) is None]
    return out or [native]


def check_precision(expert_precision: str | None) -> str | None:
    """``expert_precision`` itself (None: full precision), or a ValueError naming the accepted values."""
    if expert_precision is not None and expert_precision not in PRECISIONS:
        raise ValueError(f"expert_precision must be one of {(None, *PRECISIONS)}, got {expert_precision!r}")
    return expert_precision


#: Answers of :func:`precision_engine` by its arguments and the settings in force.
_PRECISION_ANSWERS: dict[tuple, str] = {}


def precision_engine(expert_precision: str, backend: str, device: torch.device | str, dtype: torch.dtype) -> str:
    """The stage-4 implementation that runs ``expert_precision`` next to ``backend`` on ``device`` for
    ``dtype`` activations; a RuntimeError saying why where none can. Asked on every quantized layer
    call: an answer is kept (the checks behind it cost a decode step's layer about a tenth of its time)."""
    key = (expert_precision, backend, str(device), dtype, settings.get())
    answer = _PRECISION_ANSWERS.get(key)
    if answer is not None:
        return answer
    check_precision(expert_precision)
    reasons = []
    for name in PRECISIONS[expert_precision]:
        reason = unavailable_reason(name, backend, device, dtype)
        if reason is None:
            _PRECISION_ANSWERS[key] = name
            return name
        reasons.append(reason)
    raise RuntimeError(f"expert_precision={expert_precision!r} cannot run here: {'; '.join(reasons)}")


def resolve_request(gemm_engine: str, backend: str) -> str:
    """A block's ``gemm_engine`` after ``FASTMOE_GEMM_ENGINE``: an engine name, or ``"auto"``. A
    kernel set naming a precision implementation (``"torch+int8"``) passes its name through."""
    if gemm_engine in GEMMS and gemm_engine not in ENGINES:
        return gemm_engine
    check_choice(gemm_engine)
    if gemm_engine == "auto":
        gemm_engine = settings.get().gemm_engine or "auto"
        if gemm_engine not in CHOICES:
            raise ValueError(f"FASTMOE_GEMM_ENGINE must be one of {CHOICES}, got {gemm_engine!r}")
    if gemm_engine == "native":
        return NATIVE[backend]
    return gemm_engine


def layer_macs(tokens: int, top_k: int, hidden: int, intermediate: int, local_experts: int) -> int:
    """The forward work of a layer in multiply-accumulates, ``max(T * K, NR) * 3 * H * I``: the routed
    rows' GEMMs, or one row per local expert where there are fewer rows than experts (a path that
    runs every expert's block reads every expert's weights)."""
    return max(tokens * top_k, local_experts) * 3 * hidden * intermediate


def whole_layer(backend: str, gemm_engine: str, device: torch.device | str, dtype: torch.dtype,
                shape: tuple[int, int, int, int, int], lora: bool = False) -> str | None:
    """The ``experts`` implementation that runs stages 2-5 of a fused layer in one piece, or None for
    the staged chain: the first one for ``backend`` (resolved: ``"torch"`` or ``"triton"``) available
    on ``device`` for ``dtype`` whose ``max_layer_macs`` holds the layer (or whose ``max_tokens``
    does, with at most one routed row per local expert), and only while
    ``gemm_engine`` (after ``FASTMOE_GEMM_ENGINE``) is ``auto``. ``shape``: ``(T, K, H, I, NR)``;
    ``lora``: the layer has adapters (only an implementation that runs them qualifies).
    Asked on every layer call: answered from :data:`_LAYER_ANSWERS` after the first."""
    key = (backend, gemm_engine, device, dtype, shape, lora, settings.get())
    try:
        return _LAYER_ANSWERS[key]
    except KeyError:
        pass
    answer = None
    if resolve_request(gemm_engine, backend) == "auto":
        macs = layer_macs(*shape)
        for name in LAYERS:
            impl = IMPLEMENTATIONS[name]
            fits = macs <= impl.max_layer_macs or (shape[0] <= impl.max_tokens and shape[0] * shape[1] <= shape[4])
            if (backend in impl.bases and fits and (impl.adapters or not lora)
                    and impl.reason_unavailable(device, dtype) is None):
                answer = name
                break
    if len(_LAYER_ANSWERS) >= 4096:  # one entry per token count seen: bounded for long generations
        _LAYER_ANSWERS.clear()
    _LAYER_ANSWERS[key] = answer
    return answer


#: ``auto``'s engine, untimed, for a small layer on the CPU (:func:`untimed_engine`): where timing
#: could only save a fraction of a millisecond per call and cost a tiny model's first call 60-210 ms.
#: ``grouped_mm`` was the fastest full-precision engine at every layer of at most 24 Mi
#: multiply-accumulates measured (docs/small_shapes.md, "Whole tiny models of each family").
SMALL_LAYER_ENGINE = "grouped_mm"
#: The largest layer (:func:`layer_macs`) that takes :data:`SMALL_LAYER_ENGINE` untimed.
SMALL_LAYER_MACS = 24 * 2**20

#: The largest layer a call without a backward (generation, evaluation) takes
#: :data:`SMALL_LAYER_ENGINE` for untimed: its forward tied ``loop``'s (0.97-1.01x) and ran 1.15-1.5x
#: ``onednn``'s at 48-384 Mi (docs/small_shapes.md, "Generation"), while timing a model's prefill on
#: its first ``generate`` cost up to 6x transformers' first.
SMALL_INFERENCE_MACS = 384 * 2**20

#: A call without a backward of at most this many routed rows per local expert (on average: a
#: decode step, a short prompt's prefill) takes :data:`SMALL_LAYER_ENGINE` untimed at any layer size:
#: at OLMoE-1B-7B's layer (H=2048 I=1024 E=64 K=8, one thread, Xeon with AMX, 2026-11-29) its forward
#: at 16 tokens (two rows per expert) was 115 ms against ``loop``'s 114 and ``onednn``'s 133, while
#: timing the candidates cost the first call 8.4 s; from three rows per expert ``onednn`` led (1.08x
#: at 24 tokens, 1.42x at 48), which the timed choice finds.
INFERENCE_ROWS_PER_EXPERT = 2

#: Answers of :func:`untimed_engine` by its arguments and the settings in force.
_UNTIMED_ANSWERS: dict[tuple, str | None] = {}


def untimed_engine(backend: str, gemm_engine: str, device: torch.device | str, dtype: torch.dtype,
                   shape: tuple[int, int, int, int, int], inference: bool = False) -> str | None:
    """The engine a layer's ``auto`` takes without timing, or None where it times its candidates:
    :data:`SMALL_LAYER_ENGINE` for the torch base on the CPU, a layer of at most
    :data:`SMALL_LAYER_MACS` (``shape``: ``(T, K, H, I, NR)``, as for :func:`whole_layer`), when
    ``gemm_engine`` (after ``FASTMOE_GEMM_ENGINE``) is ``auto`` and that engine is one of the
    candidates here; ``inference`` (no backward follows the call): a layer of at most
    :data:`SMALL_INFERENCE_MACS`, or of any size with at most :data:`INFERENCE_ROWS_PER_EXPERT`
    routed rows per local expert. The same answer for the same shape on every machine and under any
    load (nothing is timed, stored or watched). Asked on every layer call: answered from a dict after
    the first."""
    key = (backend, gemm_engine, device, dtype, shape, inference, settings.get())
    try:
        return _UNTIMED_ANSWERS[key]
    except KeyError:
        pass
    answer = None
    dev = torch.device(device)
    # Whether the engine is one of ``candidates`` here, asked of it alone: the others' availability
    # checks run probe GEMMs, a few milliseconds of a first call that times nothing.
    if (backend == "torch" and dev.type == "cpu"
            and (layer_macs(*shape) <= (SMALL_INFERENCE_MACS if inference else SMALL_LAYER_MACS)
                 or (inference and shape[0] * shape[1] <= INFERENCE_ROWS_PER_EXPERT * shape[4]))
            and resolve_request(gemm_engine, backend) == "auto"
            and IMPLEMENTATIONS[backend].timed(dev) and IMPLEMENTATIONS[SMALL_LAYER_ENGINE].timed(dev)
            and unavailable_reason(SMALL_LAYER_ENGINE, backend, dev, dtype) is None):
        answer = SMALL_LAYER_ENGINE
    if len(_UNTIMED_ANSWERS) >= 4096:  # one entry per token count seen: bounded for long generations
        _UNTIMED_ANSWERS.clear()
    _UNTIMED_ANSWERS[key] = answer
    return answer


def choose_engine(gemm_engine: str, *, backend: str, device: torch.device | str, dtype: torch.dtype,
                  shape: tuple[int, int, int, int], measure: Callable[[str], Any] | None = None, group: Any = None,
                  use_disk: bool = True) -> str:
    """The engine that runs stage 4.

    ``shape``: ``(H, I, NR, routed rows T*K)``. ``gemm_engine`` other than ``auto`` is checked and
    returned (ValueError when it cannot run here). ``auto``: the in-process choice for this device
    and shape bucket, else the disk cache's, else the fastest candidate by interleaved samples of
    ``measure(engine)`` (one sample of a forward+backward on the real shapes: a
    :class:`.timing.Sample` or seconds; injectable for tests), written to disk only when the timing
    is trusted (:func:`.timing.time_interleaved`). ``group``: the expert-parallel process group; its
    rank 0 decides and every rank adopts that choice.
    """
    return engine_choice(gemm_engine, backend=backend, device=device, dtype=dtype, shape=shape, measure=measure,
                         group=group, use_disk=use_disk)[0]


def engine_choice(gemm_engine: str, *, backend: str, device: torch.device | str, dtype: torch.dtype,
                  shape: tuple[int, int, int, int], measure: Callable[[str], Any] | None = None, group: Any = None,
                  use_disk: bool = True, check: bool = False, inference: bool = False,
                  layer: Hashable = None) -> tuple[str, "Watch | None"]:
    """:func:`choose_engine`, and the :class:`Watch` of an ``auto`` choice that is checked in use (None
    for a fixed one). ``check``: this is a forward call, where a due check of the choice may re-time
    the candidates (with ``measure``) and change it. ``inference``: a forward call no backward will
    follow (autograd off or nothing requires a gradient): an ``auto`` choice answers with its
    fastest engine by forward time (:attr:`Watch.inference_engine`), which may differ from the one
    chosen for forward+backward; under expert parallelism the group's one choice holds. Where the
    shape key has no choice yet (none in-process, none on disk) and no expert-parallel group spans
    ranks, such a call times nothing until one ``layer`` (what tells the layers of a model apart: the
    op passes its gate/up weight's address; None: every call counts as one layer's) has made
    :data:`INFERENCE_TIME_AFTER` of them: before, it runs :data:`SMALL_LAYER_ENGINE` unwatched (see
    there); then it times the candidates' forwards alone where ``measure`` offers that
    (``measure.forward``), a choice that is not stored and that the first call with a backward to
    come times again in full. A call with a backward to come times the candidates at once."""
    answer_key = (gemm_engine, backend, device, dtype, shape[:3], rows_bucket(shape[3]), id(group), settings.get())
    answer = _ANSWERS.get(answer_key)
    if answer is None:
        if capturing(device) and resolve_request(gemm_engine, backend) == "auto":
            raise RuntimeError("gemm_engine='auto' times its candidates at the first call of a shape, which cannot run "
                               "inside a CUDA graph capture: call the layer once at this shape before capturing "
                               "(a capture needs warm-up calls anyway), or name an engine")
        with apart_from_caller():
            answer = _answer(gemm_engine, backend, torch.device(device), dtype, shape, measure, group, use_disk,
                             (layer,) if inference else None)
        if answer.__class__ is Deferred:
            return answer.engine, None  # not remembered: the next call of the key counts again
        _ANSWERS[answer_key] = answer
    if answer.__class__ is str:
        return answer, None
    if answer.forward_only and not inference and measure is not None and not capturing(device):
        # Timed on forwards alone (by a call without a backward): a backward is to come, time it all.
        with apart_from_caller():
            answer.time_first(measure, shape[3], "a call with a backward (timed on forwards only before)")
    elif check and answer.calls >= answer.next_check and not capturing(device):  # no timing inside a graph capture
        with apart_from_caller():
            answer.check(measure, shape[3])
    return (answer.inference_engine if inference else answer.engine), answer


#: In-use checks of an ``auto`` choice (:class:`Watch`): every CHECK_EVERY forward calls of a shape
#: key, the fastest of its last WINDOW calls (scaled to the rows it was timed at) is compared with
#: the timed forward (+backward) time; SLOW times that or more re-times the candidates. A choice
#: from an untrusted timing is re-timed after RETIME_FIRST calls. After every re-timing the next
#: waits twice as long, at most RETIME_MAX calls.
CHECK_EVERY, WINDOW, SLOW, RETIME_FIRST, RETIME_MAX = 4, 6, 1.25, 16, 4096
#: A forward call without a backward takes another engine than the forward+backward choice only when
#: that engine's timed forward is at least this much faster (a difference within the timing's noise
#: is not worth a second engine's buffers).
INFERENCE_GAIN = 0.05


def _rows_scale(rows: int, timed_rows: int | None) -> float:
    """How much longer a call of ``rows`` routed rows may take than one of ``timed_rows``: in
    proportion above them; below them at least half the timed call (a layer's time is not
    proportional to its rows: its launches and weight reads are fixed)."""
    if not timed_rows or rows <= 0:
        return 1.0
    r = rows / timed_rows
    return r if r >= 1 else 0.5 + 0.5 * r


def inference_engine(engine: str, forwards: Mapping[str, float | None], options: list[str] | None = None) -> str:
    """The engine that runs forward calls without a backward when ``engine`` was chosen for
    forward+backward and ``forwards`` are the candidates' timed forwards (of the same timing): the
    fastest of ``options`` (default: all of them) by forward time, where it beats ``engine``'s by
    :data:`INFERENCE_GAIN` at least; else ``engine``."""
    own = forwards.get(engine)
    timed = [(t, i, e) for i, (e, t) in enumerate(forwards.items())
             if (options is None or e in options) and t and t > 0]
    if not own or own <= 0 or not timed:
        return engine
    fastest, _, other = min(timed)
    return other if fastest < (1 - INFERENCE_GAIN) * own else engine


class Watch:
    """An ``auto`` choice in use (one per shape key and process, without expert parallelism): the
    engine, whether its timing was trusted, the times it was timed at, and the layer's recent times.

    The fused op's forward and backward report their wall time (:meth:`saw`); on a forward call
    that is due, :meth:`check` re-times the candidates when the choice came from an untrusted timing
    (once the process has gone a stretch without waiting for a CPU) or when the layer runs
    :data:`SLOW` times slower than its timed speed, so that a wrong choice (a cache written from a
    bad timing) is found out in use. A trusted re-timing replaces the choice and is stored; an
    untrusted one replaces an untrusted choice, and a trusted one only where its winner beat the
    chosen engine in every round (interleaved: under the same load), and is not stored. Each
    re-timing doubles the calls before the next may run. On a GPU the times are not watched (a call
    returns before the device has run it); untrusted choices are re-timed all the same. A choice
    timed on forwards alone (:attr:`forward_only`: a call without a backward timed the key) is
    re-timed the same way, never stored, and timed in full by the first call with a backward to
    come."""

    __slots__ = ("device", "name", "key", "options", "engine", "trusted", "use_disk", "watch_speed", "expected",
                 "expected_forward", "timed_rows", "calls", "next_check", "retime_at", "gap", "fwd", "bwd",
                 "retimes", "history", "last_probe", "inference_engine", "expected_inference", "inf", "forward_only")

    def __init__(self, device: torch.device, name: str, key: ShapeKey, options: list[str], use_disk: bool) -> None:
        self.device, self.name, self.key, self.options, self.use_disk = device, name, key, options, use_disk
        self.watch_speed = device.type == "cpu"
        self.calls, self.gap, self.retimes = 0, RETIME_FIRST, 0
        self.next_check = CHECK_EVERY
        #: The choice was timed on forwards alone (:meth:`time_first`): it holds for calls without a
        #: backward only, is never stored, and the first call with a backward to come times again.
        self.forward_only = False
        #: No re-timing before this many forward calls: a slow trusted choice is timed again at once,
        #: an untrusted one after RETIME_FIRST calls (set where it is made).
        self.retime_at = 0
        self.fwd: list[float] = []
        self.bwd: list[float] = []
        self.inf: list[float] = []  # forward calls without a backward, on inference_engine
        self.last_probe: tuple[float, int | None] | None = None
        self._quiet_since_last_check()  # the first check looks back to here
        #: (forward calls so far, what happened) for each re-timing: logs, the benchmark, tests.
        self.history: list[tuple[int, str]] = []

    def adopt(self, engine: str, trusted: bool, seconds: float | None, forward: float | None,
              rows: int | None, forwards: Mapping[str, float | None] | None = None, forward_only: bool = False) -> None:
        """Take ``engine`` (timed at ``seconds`` forward+backward, ``forward`` of it the forward, on
        ``rows`` routed rows). ``forwards``: every candidate's timed forward, from the same timing;
        the fastest (by :data:`INFERENCE_GAIN` at least) runs forward calls without a backward.
        ``forward_only``: the timing ran forwards alone (``seconds`` is a forward): ``engine`` is
        the fastest forward and runs every call until a call with a backward times again."""
        self.engine, self.trusted, self.forward_only = engine, trusted, forward_only
        self.expected = seconds if seconds and seconds > 0 else None
        self.expected_forward = (forward if forward and self.expected and 0 < forward < self.expected
                                 and not forward_only else None)
        self.inference_engine = engine
        self.expected_inference = self.expected if forward_only else self.expected_forward
        if self.expected_forward is not None and forwards:
            self.inference_engine = inference_engine(engine, forwards, self.options)
            self.expected_inference = forwards[self.inference_engine]
        self.timed_rows = rows
        self.fwd.clear()
        self.bwd.clear()
        self.inf.clear()
        _CHOSEN[(self.name, self.key)] = engine

    def saw(self, forward: bool, seconds: float, rows: int, inference: bool = False) -> None:
        """One call of the fused op's forward (``forward``) or backward body took ``seconds`` wall time
        on ``rows`` routed rows; ``inference``: a forward call without a backward, which ran
        :attr:`inference_engine`."""
        if forward:
            self.calls += 1
        if not self.watch_speed or self.expected is None:
            return
        times = self.inf if inference else self.fwd if forward else self.bwd
        times.append(seconds / _rows_scale(rows, self.timed_rows))
        if len(times) > WINDOW:
            del times[0]

    def slowdown(self) -> float | None:
        """The layer's recent time over its timed time (None: not enough calls seen to tell): the
        forward+backward calls', else the forward calls', else the inference calls' (the forward
        time of the engine they ran, :meth:`slow_engine`)."""
        if self.expected is None:
            return None
        if len(self.fwd) >= 3:
            if len(self.bwd) >= 3:
                return (min(self.fwd) + min(self.bwd)) / self.expected
            if self.expected_forward is not None:
                return min(self.fwd) / self.expected_forward
        if len(self.inf) >= 3 and self.expected_inference is not None:
            return min(self.inf) / self.expected_inference
        return None

    def slow_engine(self) -> str:
        """The engine whose calls :meth:`slowdown` judged."""
        return self.engine if len(self.fwd) >= 3 else self.inference_engine

    def check(self, measure: Callable[[str], Any] | None, rows: int) -> None:
        """The due check of a forward call (see the class docstring)."""
        self.next_check = self.calls + CHECK_EVERY
        quiet = self._quiet_since_last_check()
        if measure is None or self.calls < self.retime_at:
            return
        if not self.trusted:
            # Nothing says this choice is wrong, only that its timing was not to be trusted: wait for
            # a quiet stretch, where a timing can be (a timing now would be starved, for nothing).
            if quiet:
                self.retime(measure, rows, "re-timed: the last timing was not trusted")
            return
        # A layer far slower than its timed speed: the choice may be wrong, or the machine busy. A
        # timing tells (interleaved samples under the same load), busy or not; the next waits longer.
        slow = self.slowdown() if self.watch_speed else None
        if slow is not None and slow >= SLOW:
            self.retime(measure, rows, f"re-timed in use: {self.slow_engine()} ran {slow:.2f}x its timed speed")

    def _quiet_since_last_check(self) -> bool:
        """Whether this process went without waiting for a CPU since the last check (beyond the share a
        trusted sample may wait, :data:`.timing.STARVED_WAIT`); True where that is not known."""
        from . import timing

        if self.device.type != "cpu":
            return True
        now, wait = time.perf_counter(), timing.run_queue_wait_ns()
        last, self.last_probe = self.last_probe, (now, wait)
        if wait is None or last is None or last[1] is None:
            return True
        return (wait - last[1]) * 1e-9 <= timing.STARVED_WAIT * (now - last[0])

    def time_first(self, measure: Callable[[str], Any], rows: int, reason: str = "first use",
                   forward_only: bool = False) -> None:
        """Time the candidates and take the fastest, stored when the timing is trusted (a first use,
        or a call with a backward after a choice timed on forwards only). ``forward_only``:
        ``measure`` times forwards alone; the choice holds for calls without a backward, unstored."""
        from . import timing

        t = timing.time_interleaved(self.options, measure, check=timing.starvation_check(self.device))
        self.adopt(t.best, t.trusted, t.seconds[t.best], t.forward[t.best], rows, t.forward, forward_only)
        if not t.trusted:
            self.retime_at = self.calls + RETIME_FIRST
        stored = self.use_disk and t.trusted and not forward_only
        if stored:
            timing.store(self.name, self.key, t.best, t.seconds, forward=t.forward, rows=rows, timed=t.record(reason))
        verdict = ("trusted" if not forward_only else "trusted, not stored") if t.trusted else f"not trusted ({t.why})"
        self.history.append((self.calls, f"timed at {reason}: {t.best}, {verdict}"))

    def retime(self, measure: Callable[[str], Any], rows: int, reason: str) -> None:
        from . import timing

        was, before = self.engine, self.trusted
        # A choice timed on forwards only is timed again the same way (a call without a backward asks).
        forward_only = self.forward_only and getattr(measure, "forward", None) is not None
        t = timing.time_interleaved(self.options, measure.forward if forward_only else measure,
                                    check=timing.starvation_check(self.device))
        if t.trusted:
            self.adopt(t.best, True, t.seconds[t.best], t.forward[t.best], rows, t.forward, forward_only)
            if self.use_disk and not forward_only:
                timing.store(self.name, self.key, t.best, t.seconds, forward=t.forward, rows=rows,
                             timed=t.record(reason))
        elif not before or _dominates(t.samples[t.best], t.samples[was]):
            self.adopt(t.best, False, t.seconds[t.best], t.forward[t.best], rows, t.forward, forward_only)
        else:
            self.fwd.clear()
            self.bwd.clear()
            self.inf.clear()
        self._quiet_since_last_check()  # the next check looks back to the end of this timing
        self.retimes += 1
        self.gap = min(2 * self.gap, RETIME_MAX)
        self.retime_at = self.calls + self.gap
        outcome = (("trusted, stored" if self.use_disk and not forward_only else "trusted") if t.trusted
                   else f"not trusted ({t.why})")
        self.history.append((self.calls, f"{reason}; {was} -> {self.engine}, {outcome}"))


def _dominates(fast: list[Any], slow: list[Any]) -> bool:
    """Whether ``fast`` took less time than ``slow`` in every round of an interleaved timing (the two
    samples of a round are taken next to each other, so under about the same load, whatever the load
    did between rounds)."""
    return bool(fast) and len(fast) == len(slow) and all(a.seconds < b.seconds for a, b in zip(fast, slow))


def _answer(gemm_engine, backend, dev, dtype, shape, measure, group, use_disk,  # noqa: ANN001
            inference: tuple[Hashable] | None = None) -> "str | Watch | Deferred":
    """The answer of :func:`engine_choice` for a key it has none for. ``inference``: ``(layer,)`` of a
    forward call without a backward (None: a backward follows), which may be deferred."""
    from ..dist.agree import broadcast_from_rank0
    from ..dist.groups import group_rank, group_size
    from .timing import device_name

    wanted = resolve_request(gemm_engine, backend)
    if wanted != "auto":
        reason = unavailable_reason(wanted, backend, dev, dtype)
        if reason is not None:
            raise ValueError(f"gemm_engine={wanted!r} cannot run here: {reason}")
        return wanted
    options = candidates(backend, dev, dtype)
    if len(options) == 1:
        return options[0]  # availability is the same on every rank of a group: nothing to agree on
    ep = group_size(group) > 1
    H, I, NR, rows = shape
    key = ShapeKey(backend, str(dtype).removeprefix("torch."), int(H), int(I), int(NR), 0 if ep else rows_bucket(rows))
    name = device_name(dev)
    if ep:
        memo = _CHOSEN.get((name, key))
        if memo is not None:
            return memo
        # Ranks must change engines together: under expert parallelism rank 0's choice holds for the
        # process (stored only when its timing was trusted), and is not re-timed in use.
        choice = _decide(dev, name, key, options, measure, use_disk, rows).engine if group_rank(group) == 0 else None
        choice = broadcast_from_rank0(choice, group)
        if choice not in ENGINES:
            raise RuntimeError(f"expert-parallel rank 0 chose gemm engine {choice!r}, not one of {ENGINES}")
        _CHOSEN[(name, key)] = choice
        return choice
    watch = _WATCHES.get((name, key))
    if watch is None:
        watch = _cached(dev, name, key, options, use_disk)
        if watch is None and inference is not None and _defer(name, key, options, inference[0]):
            return Deferred(SMALL_LAYER_ENGINE)
        watch = _WATCHES[(name, key)] = watch or _time_first(dev, name, key, options, measure, use_disk, rows,
                                                             inference is not None)
    return watch


#: The watched choices without expert parallelism: (device name, ShapeKey) -> Watch.
_WATCHES: dict[tuple[str, ShapeKey], Watch] = {}


#: A forward call without a backward (generation, evaluation) of a shape key that has no choice yet,
#: in-process or on disk, times nothing until one layer has made this many such calls of it; before,
#: it runs :data:`SMALL_LAYER_ENGINE` untimed. Timing the candidates, forward and backward, cost an
#: OLMoE-1B-7B-sized model's first ``generate`` (a 64-token prefill at eight rows per expert) 4.05x
#: transformers' first (docs/performance.md), while a deferred call costs a fraction of a call more
#: (there ``onednn``, the fastest engine, ran 1.57x ``grouped_mm``'s speed): a shape seen once (a
#: one-off prompt's prefill) or twice (a warm-up, then the call that counts) never pays for a timing;
#: one that recurs a third time (a server's, an evaluation loop's) is likely to recur many more, and
#: is timed then, on forwards alone where the measure offers that (:meth:`Watch.time_first`).
#: Counted per layer (:func:`engine_choice`'s ``layer``), since a model's layers share a key: one
#: prefill calls it once per layer.
INFERENCE_TIME_AFTER = 3

#: Inference calls seen of keys not timed yet: (device name, ShapeKey) -> {layer: calls}.
_INFERENCE_SEEN: dict[tuple[str, ShapeKey], dict[Hashable, int]] = {}


class Deferred(NamedTuple):
    """:func:`_answer`'s answer to an inference call whose timing is deferred: the untimed engine."""

    engine: str


def _defer(name: str, key: ShapeKey, options: list[str], layer: Hashable) -> bool:
    """Whether an inference call of ``layer`` at ``key`` (no choice yet) runs :data:`SMALL_LAYER_ENGINE`
    untimed rather than timing the candidates: while that engine is one of ``options`` and the
    layer's calls of the key, this one included, are fewer than :data:`INFERENCE_TIME_AFTER`."""
    if SMALL_LAYER_ENGINE not in options:
        return False
    seen = _INFERENCE_SEEN.setdefault((name, key), {})
    if len(_INFERENCE_SEEN) > 4096 or len(seen) > 4096:  # bounded: a counter lost only means a later timing
        _INFERENCE_SEEN.clear()
        seen = _INFERENCE_SEEN[(name, key)] = {}
    calls = seen[layer] = seen.get(layer, 0) + 1
    if calls < INFERENCE_TIME_AFTER:
        return True
    del _INFERENCE_SEEN[(name, key)]
    return False


def _cached(dev: torch.device, name: str, key: ShapeKey, options: list[str], use_disk: bool) -> Watch | None:
    """A :class:`Watch` of the disk cache's choice for ``key`` (None: none usable, or ``use_disk`` off)."""
    from . import timing

    if not use_disk:
        return None
    entry = timing.lookup_entry(name, key, options)
    if entry is None or entry["engine"] not in options:
        return None
    watch = Watch(dev, name, key, options, use_disk)
    engine = entry["engine"]
    seconds, forward = entry.get("seconds") or {}, entry.get("forward") or {}
    watch.adopt(engine, True, seconds.get(engine), forward.get(engine), entry.get("rows"), forward)
    return watch


def _decide(dev: torch.device, name: str, key: ShapeKey, options: list[str], measure: Callable[[str], Any] | None,
            use_disk: bool, rows: int) -> Watch:
    """The disk cache's choice for ``key`` (:func:`_cached`), else the candidates timed now."""
    return _cached(dev, name, key, options, use_disk) or _time_first(dev, name, key, options, measure, use_disk, rows)


def _time_first(dev: torch.device, name: str, key: ShapeKey, options: list[str], measure: Callable[[str], Any] | None,
                use_disk: bool, rows: int, inference: bool = False) -> Watch:
    """The candidates timed at the first use of ``key``: the fastest, stored when the timing is trusted
    (:meth:`Watch.time_first`). ``inference``: a call without a backward asks, which times forwards
    alone where ``measure`` offers that (``measure.forward``, as the fused op's does)."""
    if measure is None:
        raise RuntimeError("choose_engine: gemm_engine='auto' needs a measure to time the candidates")
    forward = getattr(measure, "forward", None) if inference else None
    watch = Watch(dev, name, key, options, use_disk)
    if forward is not None:
        watch.time_first(forward, rows, "first use, forwards only (a call without a backward)", forward_only=True)
    else:
        watch.time_first(measure, rows)
    return watch


def select(backend: str, gemm_engine: str, *, device: torch.device | str, dtype: torch.dtype,
           shape: tuple[int, int, int, int], measure: Callable[[str], float] | None = None, group: Any = None) -> str:
    """The kernel set that runs stages 2-5: the name of :func:`kernels`. ``backend``: ``"auto"``,
    ``"torch"`` or ``"triton"``; ``gemm_engine``: see :func:`choose_engine`, whose arguments the
    rest are."""
    base = resolve_backend(backend, device)
    engine = choose_engine(gemm_engine, backend=base, device=device, dtype=dtype, shape=shape, measure=measure,
                           group=group)
    return kernel_set_name(base, engine)


def describe(choices: Mapping[tuple[str, ShapeKey], str] | None = None) -> list[str]:
    """One line per in-process choice (for logs and the benchmark's notes)."""
    items = (choices if choices is not None else _CHOSEN).items()
    return [f"{name} {key.backend} {key.dtype} H={key.hidden} I={key.intermediate} NR={key.local_experts} "
            f"rows<={key.rows_bucket or 'any'}: {engine}" for (name, key), engine in items]


def chosen_for(backend: str, device: torch.device | str, dtype: torch.dtype,
               shape: tuple[int, int, int, int], inference: bool = False) -> str | None:
    """The in-process auto choice for these shapes without expert parallelism (None if none yet);
    ``inference``: the engine of forward calls without a backward (:attr:`Watch.inference_engine`)."""
    options = candidates(backend, device, dtype)
    if len(options) == 1:
        return options[0]
    if inference:
        watch = watch_for(backend, device, dtype, shape)
        return watch.inference_engine if watch is not None else None
    return _CHOSEN.get(_choice_key(backend, device, dtype, shape))


def watch_for(backend: str, device: torch.device | str, dtype: torch.dtype,
              shape: tuple[int, int, int, int]) -> "Watch | None":
    """The in-process :class:`Watch` of the ``auto`` choice for these shapes without expert parallelism
    (None: no timed choice yet, or only one candidate): its engine, trust, calls and re-timings."""
    return _WATCHES.get(_choice_key(backend, device, dtype, shape))


def _choice_key(backend: str, device: torch.device | str, dtype: torch.dtype,
                shape: tuple[int, int, int, int]) -> tuple[str, ShapeKey]:
    from .timing import device_name

    H, I, NR, rows = shape
    return device_name(device), ShapeKey(backend, str(dtype).removeprefix("torch."), int(H), int(I), int(NR),
                                         rows_bucket(rows))
