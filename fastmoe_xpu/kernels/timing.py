"""Timing for the measured choices: the synchronised best-of timer, the power-of-two shape buckets,
the device names choices are keyed by, the checked interleaved timing of the stage-4 engines, and
the disk cache of timed engine choices.

Both measured choices use it: the stage-4 implementation (:func:`.registry.choose_engine`, remembered
on disk) and the Triton config of each grouped GEMM (``triton/autotune.py``, remembered in-process;
the package's kept table for the device, :mod:`.kept_configs`, spares the timing).

**Checked timing** (:func:`time_interleaved`). The engines are timed in rounds, one sample of each
candidate per round in a rotating order, so that a busy second on the machine falls on every
candidate alike; each candidate's time is the minimum of its samples. The timing is *trusted* only
when, for every candidate, at least two samples ran unstarved and its two fastest unstarved samples
agree within :data:`AGREE`. A sample is starved when the process's threads waited for a CPU (the
run-queue wait Linux keeps per thread in ``/proc/self/task/*/schedstat``) longer than
:data:`STARVED_WAIT` of its wall time; where that is not available, when the calling thread ran for
less than :data:`STARVED_CPU` of it. On a GPU nothing tells starvation: the repeats must agree. The
rounds stop once the timing is trusted (at least :data:`MIN_ROUNDS`), else after
:data:`MAX_ROUNDS`. Only a trusted timing is written to disk.

The disk cache is one small JSON file.

Location: ``FASTMOE_GEMM_CACHE`` if set, else ``$XDG_CACHE_HOME/fastmoe_xpu/gemm_engines.json``
(``~/.cache/fastmoe_xpu/gemm_engines.json`` without XDG_CACHE_HOME). Layout::

    {"format": 2,
     "entries": {"<device>|torch=<v>|triton=<v>|<backend>|<dtype>|H=..|I=..|NR=..|rows<=..":
                 {"engine": "grouped_mm", "seconds": {"loop": 0.012, "grouped_mm": 0.009},
                  "forward": {"loop": 0.004, "grouped_mm": 0.003}, "rows": 1000,
                  "timed": {"how": "interleaved rounds, min of unstarved samples", "rounds": 3,
                            "check": "run-queue wait", "threads": 2, "reason": "first use",
                            "samples": {"loop": [0.012, 0.0125, 0.013], ...}, "starved": {"loop": 0, ...}},
                  "saved": "<UTC>"}}}

``seconds`` is one forward+backward of the layer's stages 4-5 per engine, ``forward`` its forward,
``rows`` the routed rows it was timed at (what a layer in use is compared with, :mod:`.registry`),
``timed`` how the choice was timed. The key names the device, torch and triton versions, so an
upgrade or another GPU misses and times again instead of trusting old numbers. Several ranks may
start at once: each writes a whole new file next to the old one and renames it over (atomic on
POSIX), so a reader sees the old file or a new one, never half of one; a lost update only means one
more timing run later. A file that is not valid JSON, has another format, or names an unknown engine
is ignored with a warning and replaced on the next write: the cache can cost a timing run, never a
crash. A file of format 1 (written before timings were checked) is ignored without a warning.
"""
from __future__ import annotations

import contextlib
import json
import os
import tempfile
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping, NamedTuple, Sequence

import torch

from .. import settings
from ..device import cpu_model


#: Device types whose autocast state a probe or a timing leaves behind (see :func:`apart_from_caller`).
AUTOCAST_DEVICE_TYPES = ("cpu", "cuda", "xpu")


@contextlib.contextmanager
def apart_from_caller():
    """Run the package's own probes and timings as they would run alone: outside any autocast region
    of the caller (autocast would change the dtypes they compare and time: a probe's fp32 check met
    a bf16 product and raised) and without autograd (they call launchers, not differentiable ops)."""
    with contextlib.ExitStack() as stack:
        for device_type in AUTOCAST_DEVICE_TYPES:
            try:
                on = torch.is_autocast_enabled(device_type)
            except (RuntimeError, TypeError):  # a device type this torch build does not know
                continue
            if on:
                stack.enter_context(torch.autocast(device_type, enabled=False))
        stack.enter_context(torch.no_grad())
        yield

FORMAT = 2
#: Formats of earlier versions, ignored quietly (their choices were timed without checks).
OLD_FORMATS = (1,)
FILE_NAME = "gemm_engines.json"


def capturing(device: torch.device | str) -> bool:
    """Whether the current stream of ``device`` is being captured into a graph (CUDA graphs; XPU
    where its torch has them): nothing may be timed or synchronised then, and a call's host time says
    nothing about its replays."""
    dev = torch.device(device)
    if dev.type not in ("cuda", "xpu"):
        return False
    check = getattr(getattr(torch, dev.type, None), "is_current_stream_capturing", None)
    return bool(check is not None and check())


def sync(device: torch.device) -> None:
    """Wait for ``device``'s queued work (nothing to wait for on the CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "xpu":
        torch.xpu.synchronize(device)


def clock(device: torch.device) -> Callable[[], float]:
    """The timer for runs on ``device``: this thread's CPU time on a CPU running one thread (what the
    work costs, whatever else runs on a shared machine: a choice timed on a loaded machine would
    otherwise follow the load, and the disk cache keeps it), else synchronised wall-clock time."""
    if device.type == "cpu" and torch.get_num_threads() == 1:
        return time.thread_time
    return time.perf_counter


def best_seconds(run: Callable[[], Any], device: torch.device, repeats: int) -> float:
    """Best of ``repeats`` synchronised runs of ``run`` (timed by :func:`clock`) after one warm-up
    run (which compiles, autotunes or fills buffers: first-use costs are not the speed being measured)."""
    now = clock(device)
    run()
    best = float("inf")
    for _ in range(max(1, repeats)):
        sync(device)
        t0 = now()
        run()
        sync(device)
        best = min(best, now() - t0)
    return best


# ---------------------------------------------------------------- checked timing of the engines
#: The two fastest unstarved samples of every candidate must agree within this fraction.
AGREE = 0.10
#: A sample is starved when the process's threads waited for a CPU longer than this fraction of it.
STARVED_WAIT = 0.10
#: Where the run-queue wait is not known: when the calling thread ran less than this fraction of it.
STARVED_CPU = 0.5
#: Rounds of a timing: at least MIN_ROUNDS, then until trusted, at most MAX_ROUNDS.
MIN_ROUNDS, MAX_ROUNDS = 3, 6
#: Calls shorter than this are timed several to a sample (their mean is the sample).
MIN_SAMPLE_S = 2e-3
#: At most this many calls to a sample.
MAX_CALLS_PER_SAMPLE = 32


class Sample(NamedTuple):
    """One timed sample of a candidate."""

    seconds: float
    """Wall time of one forward+backward (the mean over the sample's calls)."""
    forward: float | None = None
    """Wall time of its forward (None: not timed apart)."""
    starved: bool | None = None
    """Whether the process waited for a CPU during it (None: not known, as on a GPU)."""


def run_queue_wait_ns() -> int | None:
    """Nanoseconds this process's threads have spent runnable but waiting for a CPU, summed over its
    threads (Linux ``/proc/self/task/*/schedstat``, second field); None where not available."""
    total = 0
    try:
        for tid in os.listdir("/proc/self/task"):
            try:
                with open(f"/proc/self/task/{tid}/schedstat", "rb") as f:
                    total += int(f.read().split()[1])
            except FileNotFoundError:  # a thread that ended meanwhile
                continue
    except (OSError, ValueError, IndexError):
        return None
    return total


def starvation_check(device: torch.device) -> str:
    """How :class:`Probe` tells a starved sample on ``device``: ``"run-queue wait"``, ``"thread CPU
    time"`` or ``"none"`` (a GPU: the repeats must agree)."""
    if device.type != "cpu":
        return "none"
    return "run-queue wait" if run_queue_wait_ns() is not None else "thread CPU time"


class Probe:
    """Wall time of a stretch of work and whether the process was starved of CPU during it."""

    __slots__ = ("check", "_wall", "_cpu", "_wait")

    def __init__(self, check: str) -> None:
        self.check = check

    def start(self) -> None:
        self._wait = run_queue_wait_ns() if self.check == "run-queue wait" else None
        self._cpu = time.thread_time()
        self._wall = time.perf_counter()

    def stop(self) -> tuple[float, bool | None]:
        """``(wall seconds, starved)`` since :meth:`start` (starved None when not known)."""
        wall = time.perf_counter() - self._wall
        if self.check == "run-queue wait":
            now = run_queue_wait_ns()
            if now is not None and self._wait is not None:
                return wall, (now - self._wait) * 1e-9 > STARVED_WAIT * wall
        if self.check == "none":
            return wall, None
        return wall, (time.thread_time() - self._cpu) < STARVED_CPU * wall


def sampler(forward: Callable[[], Any], backward: Callable[[Any], Any], device: torch.device) -> Callable[[], Sample]:
    """A function that takes one :class:`Sample` of ``backward(forward())`` per call on ``device``.
    Its first call is the warm-up (compiles, autotunes, fills buffers) and sets how many calls make a
    sample (enough for :data:`MIN_SAMPLE_S`); time it like any other, it is discarded by
    :func:`time_interleaved`."""
    probe = Probe(starvation_check(device))
    calls = 0

    def take() -> Sample:
        nonlocal calls
        n = calls or 1
        fwd = 0.0
        sync(device)
        probe.start()
        for _ in range(n):
            t0 = time.perf_counter()
            out = forward()
            sync(device)
            fwd += time.perf_counter() - t0
            backward(out)
            sync(device)
        wall, starved = probe.stop()
        if not calls:
            calls = max(1, min(MAX_CALLS_PER_SAMPLE, int(MIN_SAMPLE_S / max(wall, 1e-9)) + 1))
        return Sample(wall / n, fwd / n, starved)

    return take


@dataclass
class Timing:
    """The outcome of :func:`time_interleaved`."""

    samples: dict[str, list[Sample]]
    seconds: dict[str, float]
    """Each candidate's minimum over its unstarved samples (over all of them where none was)."""
    forward: dict[str, float | None]
    """The forward time of the sample that gave :attr:`seconds`."""
    best: str
    trusted: bool
    why: str
    """Why the timing is not trusted ("" when it is)."""
    check: str
    """How starvation was told (:func:`starvation_check`)."""

    def record(self, reason: str) -> dict[str, Any]:
        """How the choice was timed, as the cache keeps it (``timed``)."""
        return {"how": "interleaved rounds, min of unstarved samples", "rounds": min(map(len, self.samples.values())),
                "check": self.check, "threads": torch.get_num_threads(), "reason": reason,
                "samples": {e: [round(s.seconds, 9) for s in v] for e, v in self.samples.items()},
                "starved": {e: sum(bool(s.starved) for s in v) for e, v in self.samples.items()}}


def _as_sample(value: Sample | float) -> Sample:
    return value if isinstance(value, Sample) else Sample(float(value))


def judge(samples: Mapping[str, Sequence[Sample]]) -> tuple[dict[str, float], dict[str, float | None], str]:
    """``(seconds, forward, why)`` of interleaved samples: each candidate's fastest unstarved sample
    (the fastest of all where none was unstarved), and why the timing is not to be trusted ("": it
    is; see the module docstring)."""
    seconds: dict[str, float] = {}
    forward: dict[str, float | None] = {}
    why = []
    for engine, taken in samples.items():
        clean = sorted((s for s in taken if not s.starved), key=lambda s: s.seconds)
        pick = clean[0] if clean else min(taken, key=lambda s: s.seconds)
        seconds[engine], forward[engine] = pick.seconds, pick.forward
        if len(clean) < 2:
            why.append(f"{engine}: {len(taken) - len(clean)} of {len(taken)} samples starved of CPU")
        elif clean[1].seconds > (1 + AGREE) * clean[0].seconds:
            why.append(f"{engine}: its fastest samples differ by {clean[1].seconds / clean[0].seconds - 1:.0%}")
    return seconds, forward, "; ".join(why)


def time_interleaved(options: Sequence[str], measure: Callable[[str], Sample | float],
                     min_rounds: int = MIN_ROUNDS, max_rounds: int = MAX_ROUNDS,
                     check: str = "none") -> Timing:
    """Time every engine of ``options`` (in tie-breaking order) with ``measure(engine)`` (one sample:
    a :class:`Sample`, or seconds): one warm-up call each, then rounds of one sample each in a
    rotating order until the samples are trusted (:func:`judge`; at least ``min_rounds``), at most
    ``max_rounds``. ``check`` names how ``measure`` tells starvation (for the record)."""
    options = list(options)
    for engine in options:
        measure(engine)  # warm-up: compiles, autotunes, sets the calls per sample
    samples: dict[str, list[Sample]] = {e: [] for e in options}
    why = "no rounds"
    for r in range(max(1, max_rounds)):
        shift = r % len(options)
        for engine in options[shift:] + options[:shift]:
            samples[engine].append(_as_sample(measure(engine)))
        seconds, forward, why = judge(samples)
        if r + 1 >= min_rounds and not why:
            break
    best = min(options, key=lambda e: (seconds[e], options.index(e)))
    return Timing(samples, seconds, forward, best, not why, why, check)


def pow2_bucket(n: int) -> int:
    """``n`` rounded up to a power of two (at least 1): sizes within a factor of two share a choice."""
    return 1 << max(0, int(n) - 1).bit_length()


def device_name(device: torch.device | str) -> str:
    """A name for the hardware behind ``device``: choices made on one GPU model or CPU (and thread
    count) do not carry over to another."""
    dev = torch.device(device)
    if dev.type == "cuda":
        return f"cuda:{torch.cuda.get_device_name(dev)}"
    if dev.type == "xpu":
        return f"xpu:{torch.xpu.get_device_name(dev)}"
    return f"{dev.type}:{cpu_model()}x{torch.get_num_threads()}"


def cache_path() -> Path:
    """Where the choices are kept (see the module docstring)."""
    explicit = settings.get().gemm_cache
    if explicit:
        return Path(explicit).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "fastmoe_xpu" / FILE_NAME


def _triton_version() -> str:
    try:
        import triton

        return str(triton.__version__)
    except Exception:  # not installed (or broken): part of the key all the same
        return "none"


def entry_key(device_name: str, key: Any) -> str:
    """The JSON key of one choice: device, versions, then the shape key's fields."""
    rows = f"rows<={key.rows_bucket}" if key.rows_bucket else "rows<=any"
    return (f"{device_name}|torch={torch.__version__}|triton={_triton_version()}|{key.backend}|{key.dtype}|"
            f"H={key.hidden}|I={key.intermediate}|NR={key.local_experts}|{rows}")


def _load(path: Path) -> dict[str, Any]:
    """The file's entries; {} (with a warning) when it is unreadable, corrupt or of another format."""
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return {}
    except OSError as exc:
        warnings.warn(f"gemm engine cache {path} unreadable ({exc}); timing again", RuntimeWarning, stacklevel=3)
        return {}
    try:
        data = json.loads(text)
    except ValueError as exc:
        warnings.warn(f"gemm engine cache {path} is corrupt ({exc}); ignoring it and timing again",
                      RuntimeWarning, stacklevel=3)
        return {}
    if isinstance(data, dict) and data.get("format") in OLD_FORMATS:
        return {}  # timed without checks by an earlier version: timed again, the file rewritten
    if not isinstance(data, dict) or data.get("format") != FORMAT or not isinstance(data.get("entries"), dict):
        found = data.get("format") if isinstance(data, dict) else type(data).__name__
        warnings.warn(f"gemm engine cache {path} has format {found!r}, expected {FORMAT}; ignoring it and timing again",
                      RuntimeWarning, stacklevel=3)
        return {}
    entries = {}
    for k, v in data["entries"].items():
        if isinstance(v, dict) and v.get("engine") in settings.gemm_engines():
            entries[k] = v
        else:
            warnings.warn(f"gemm engine cache {path}: stale entry {k!r} ({v!r}) ignored", RuntimeWarning, stacklevel=3)
    return entries


def lookup_entry(device_name: str, key: Any, candidates: Sequence[str] | None = None) -> dict[str, Any] | None:
    """The cached entry for ``key`` on ``device_name`` with these versions (``engine``, ``seconds``,
    ``forward``, ``rows``, ``timed``, ``saved``), or None. With ``candidates``: None unless that
    choice was timed against every one of them (an engine added since, or newly available here, is
    timed rather than never tried)."""
    entry = _load(cache_path()).get(entry_key(device_name, key))
    if not entry:
        return None
    timed = entry.get("seconds")
    if candidates is not None and not (isinstance(timed, dict) and set(candidates) <= set(timed)):
        return None
    return entry


def lookup(device_name: str, key: Any, candidates: Sequence[str] | None = None) -> str | None:
    """The cached engine for ``key`` (see :func:`lookup_entry`), or None."""
    entry = lookup_entry(device_name, key, candidates)
    return None if entry is None else entry["engine"]


def store(device_name: str, key: Any, engine: str, seconds: Mapping[str, float], *,
          forward: Mapping[str, float | None] | None = None, rows: int | None = None,
          timed: Mapping[str, Any] | None = None) -> Path | None:
    """Add one choice (read, update, write a temporary file, rename it over): the engine, every
    candidate's forward+backward ``seconds`` and ``forward`` seconds at ``rows`` routed rows, and
    ``timed``, how they were timed (:meth:`Timing.record`). Returns the path, or None with a warning
    when the location cannot be written (the choice still holds in-process)."""
    entry: dict[str, Any] = {"engine": engine, "seconds": {k: float(v) for k, v in seconds.items()},
                             "saved": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    if forward is not None:
        entry["forward"] = {k: None if v is None else float(v) for k, v in forward.items()}
    if rows is not None:
        entry["rows"] = int(rows)
    if timed is not None:
        entry["timed"] = dict(timed)
    return _write(lambda entries: entries.__setitem__(entry_key(device_name, key), entry))


def entries() -> dict[str, dict[str, Any]]:
    """Every entry of the cache file (all devices and versions), by key."""
    return _load(cache_path())


def clear() -> int:
    """Delete the cache file; returns how many entries it held."""
    path = cache_path()
    held = len(_load(path)) if path.exists() else 0
    with contextlib.suppress(FileNotFoundError):
        path.unlink()
    return held


def _write(update: Callable[[dict[str, Any]], None]) -> Path | None:
    path = cache_path()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        entries = _load(path)
        update(entries)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                json.dump({"format": FORMAT, "entries": entries}, f, indent=1, sort_keys=True)
                f.write("\n")
            os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
    except OSError as exc:
        warnings.warn(f"gemm engine cache {path} not written ({exc}); the choice holds for this process only",
                      RuntimeWarning, stacklevel=3)
        return None
    return path
