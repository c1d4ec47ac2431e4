"""Intra-op threads for the processes of one machine: never more, together, than it has cores.

Every entry point (``fastmoe-train`` and its ranks, ``fastmoe-bench``, the node launcher's ranks)
calls :func:`configure` once at start-up and prints :attr:`ThreadChoice.summary`. The figure is

- ``--threads N`` where given (exactly N: a run that must be bitwise repeatable names it);
- else the process's share of the cores, ``cores // local processes`` (cores: those this process
  may run on, ``os.sched_getaffinity``; local processes: ``FASTMOE_LOCAL_PROCESSES``, which the node
  launcher sets to every rank it starts on the machine, else torchrun's ``LOCAL_WORLD_SIZE``, else
  1), at most ``OMP_NUM_THREADS`` where that is set, and less where other work already holds cores:
  the cores the rest of the machine kept busy over a short look at start-up (``/proc/stat``, less
  this process's own CPU time) are taken out before sharing. Two threads on two cores that two other
  processes keep busy spend their time at the barriers between threads, waiting for each other
  (docs/bench.md, "Threads on a loaded machine").

Other work can start or stop during a run. :class:`Adapter` (the trainer calls it after every step)
looks again every few seconds and moves a default figure to the new share when two looks in a row
agree, within ``[1, cores // local processes]``; a ``--threads`` figure never moves.
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass, field

import torch

#: Environment variable the launchers set to the number of training processes they start on this machine.
LOCAL_PROCESSES_ENV = "FASTMOE_LOCAL_PROCESSES"
#: Seconds of the look at the machine's load at start-up.
LOOK_S = 0.25
#: Seconds between two looks during a run (:class:`Adapter`).
ADAPT_EVERY_S = 5.0


def usable_cores() -> int:
    """The cores this process may run on."""
    if hasattr(os, "sched_getaffinity"):
        return max(1, len(os.sched_getaffinity(0)))
    return max(1, os.cpu_count() or 1)


def local_processes() -> int:
    """How many training processes share this machine (``FASTMOE_LOCAL_PROCESSES``, else torchrun's
    ``LOCAL_WORLD_SIZE``, else 1)."""
    for name in (LOCAL_PROCESSES_ENV, "LOCAL_WORLD_SIZE"):
        value = os.environ.get(name, "")
        if value.isdigit() and int(value) >= 1:
            return int(value)
    return 1


def share(cores: int | None = None, local: int | None = None) -> int:
    """``cores // local processes``, at least 1."""
    cores = usable_cores() if cores is None else cores
    local = local_processes() if local is None else local
    return max(1, cores // max(1, local))


def _cpu_busy_ticks() -> int | None:
    """Clock ticks the cores this process may use have spent busy (``/proc/stat``; None elsewhere)."""
    cpus = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else None
    try:
        with open("/proc/stat", encoding="ascii") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    busy = 0
    seen = False
    for line in lines:
        name, _, rest = line.partition(" ")
        if not name.startswith("cpu") or name == "cpu":
            continue
        if cpus is not None and int(name[3:]) not in cpus:
            continue
        v = [int(x) for x in rest.split()]
        # user nice system idle iowait irq softirq steal ...: busy is all but idle and iowait
        busy += sum(v) - v[3] - (v[4] if len(v) > 4 else 0)
        seen = True
    return busy if seen else None


class LoadMeter:
    """The cores other processes kept busy between two readings (the machine's busy time on this
    process's cores, less this process's own CPU time)."""

    def __init__(self) -> None:
        self._tick = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
        self._last = self._read()

    def _read(self) -> tuple[float, int | None, float]:
        return time.perf_counter(), _cpu_busy_ticks(), time.process_time()

    def others(self) -> float | None:
        """Cores kept busy by other processes since the last call (None: not known here)."""
        now = self._read()
        (w0, b0, c0), self._last = self._last, now
        wall = now[0] - w0
        if b0 is None or now[1] is None or wall <= 0:
            return None
        return max(0.0, ((now[1] - b0) / self._tick - (now[2] - c0)) / wall)


def default_threads(cores: int, local: int, others: float | None, cap: int | None) -> int:
    """The default figure: this process's share of the cores other work leaves free, within
    ``[1, cores // local]`` and at most ``cap`` (``OMP_NUM_THREADS``)."""
    most = share(cores, local)
    if cap is not None:
        most = max(1, min(most, cap))
    if others is None:
        return most
    free = max(0, round(cores - others))
    return max(1, min(most, free // max(1, local)))


@dataclass
class ThreadChoice:
    """What :func:`configure` set."""

    threads: int
    explicit: bool
    cores: int
    local: int
    others: float | None
    cap: int | None
    notes: list[str] = field(default_factory=list)

    @property
    def summary(self) -> str:
        """The start-up summary's line."""
        if self.explicit:
            return f"threads: {self.threads} (--threads; {self.cores} cores, {self.local} local process" \
                   f"{'es' if self.local != 1 else ''})"
        parts = [f"{self.cores} cores // {self.local} local process{'es' if self.local != 1 else ''}"]
        if self.cap is not None:
            parts.append(f"OMP_NUM_THREADS={self.cap}")
        if self.others is not None:
            parts.append(f"{self.others:.1f} cores busy with other work")
        return f"threads: {self.threads} per process ({', '.join(parts)}; --threads N to fix it)"


_CURRENT: ThreadChoice | None = None


def _omp_cap() -> int | None:
    value = os.environ.get("OMP_NUM_THREADS", "").strip()
    return int(value) if value.isdigit() and int(value) >= 1 else None


def check_threads(threads: int | None) -> int | None:
    """``threads`` itself, or a ValueError saying what is accepted."""
    if threads is not None and threads < 1:
        raise ValueError(f"--threads must be >= 1, got {threads}")
    return threads


def configure(threads: int | None = None, *, look_s: float = LOOK_S) -> ThreadChoice:
    """Set torch's intra-op threads for this process (see the module docstring) and return the choice."""
    global _CURRENT
    check_threads(threads)
    cores, local, cap = usable_cores(), local_processes(), _omp_cap()
    if threads is not None:
        choice = ThreadChoice(threads, True, cores, local, None, cap)
    else:
        meter = LoadMeter()
        time.sleep(look_s)
        others = meter.others()
        choice = ThreadChoice(default_threads(cores, local, others, cap), False, cores, local, others, cap)
    torch.set_num_threads(choice.threads)
    _CURRENT = choice
    return choice


def current() -> ThreadChoice | None:
    """The choice :func:`configure` made in this process (None: it was not called)."""
    return _CURRENT


class Adapter:
    """Moves a default thread figure with the load during a run (see the module docstring); call
    :meth:`step` after every step. Returns a line to print when it moved the figure."""

    def __init__(self, choice: ThreadChoice | None = None, every_s: float = ADAPT_EVERY_S) -> None:
        self.choice = choice if choice is not None else _CURRENT
        self.every_s = every_s
        self.active = self.choice is not None and not self.choice.explicit
        self._meter = LoadMeter() if self.active else None
        self._next = time.perf_counter() + every_s
        self._pending: int | None = None

    def step(self) -> str | None:
        if not self.active or time.perf_counter() < self._next:
            return None
        self._next = time.perf_counter() + self.every_s
        c = self.choice
        others = self._meter.others()
        if others is None:
            self.active = False
            return None
        want = default_threads(c.cores, c.local, others, c.cap)
        if want == c.threads:
            self._pending = None
            return None
        if self._pending != want:  # one look is not enough: a burst of other work passes
            self._pending = want
            return None
        self._pending = None
        was, c.threads, c.others = c.threads, want, others
        torch.set_num_threads(want)
        note = f"threads: {was} -> {want} ({others:.1f} cores busy with other work)"
        c.notes.append(note)
        return note
