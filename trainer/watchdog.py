"""In-worker watchdog: a rank whose step counter stops advancing dumps every Python stack and exits.

The elastic agent (``trainer.launch``) only sees exits, so a hung rank must turn itself into one.
:class:`trainer.fault.Heartbeat` feeds :meth:`Watchdog.progress` on every beat; a daemon thread checks the
time since the last *advance* against a limit that depends on the phase (``startup`` before the
first completed step, ``checkpoint`` while a checkpoint is written, ``step`` otherwise). When it
fires it

1. writes every thread's stack (``faulthandler``) to stderr and ``OUT/stacks/<host>-rank-<r>.txt``;
2. names the culprit: every rank blocked on the hung one goes quiet too, so the rank that got least
   far (step, then phase, then the oldest heartbeat; read from the shared ``OUT/heartbeat`` files)
   is blamed; the first rank to fire appends ``{"kind": "hang", "host": <culprit's host>}`` to
   ``OUT/failures.jsonl`` (one record per stall: later ranks see it and do not add another);
3. exits with :data:`EXIT_HANG`, which the node agent turns into a restart, and, on the blamed
   node, into leaving the job.

It also ends the worker when its parent (the node agent) is gone: torch starts workers in their own
session, so a ``kill -9`` of the agent's process group would otherwise leave them running.

Switched on by the launcher through the environment (``TRAINER_HEARTBEAT_TIMEOUT`` and friends);
off in a plain ``python -m trainer`` run.
"""
from __future__ import annotations

import faulthandler
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any

from .records import FAILURES_FILE, append_jsonl, read_failures, read_heartbeats

#: Exit code of a rank stopped by its watchdog (no progress within the timeout).
EXIT_HANG = 77
#: Exit code of a worker whose node agent disappeared (nobody reads it; distinct for the logs).
EXIT_ORPHANED = 78
TIMEOUT_ENV = "TRAINER_HEARTBEAT_TIMEOUT"
CHECKPOINT_TIMEOUT_ENV = "TRAINER_CHECKPOINT_TIMEOUT"
STARTUP_TIMEOUT_ENV = "TRAINER_STARTUP_TIMEOUT"
PARENT_ENV = "TRAINER_WATCH_PARENT"
STACKS_DIR = "stacks"
#: Order of heartbeat phases within one ``step`` value: "done"/"checkpoint" of step s-1 write
#: ``step = s``, and "start" of step s comes after them.
PHASE_ORDER = {"startup": 0, "resumed": 1, "done": 2, "checkpoint": 3, "start": 4}


def progress_key(rec: dict[str, Any] | None) -> tuple:
    """Sort key of a heartbeat record by how far its rank got (no record: nowhere)."""
    if rec is None:
        return (-1, -1, 0.0)
    return (int(rec.get("step", -1)), PHASE_ORDER.get(rec.get("phase", ""), 0), float(rec.get("mtime", 0.0)))


def culprit(beats: dict[int, dict[str, Any]], world: int) -> int:
    """The rank to blame for a stall: the one that got least far, then the one silent longest."""
    return min(range(world), key=lambda r: progress_key(beats.get(r)))


class Watchdog:
    """Fires when :meth:`progress` has not seen the step advance within the phase's limit."""

    def __init__(self, out_dir: str | os.PathLike, rank: int, world: int, host: str, *, timeout: float,
                 checkpoint_timeout: float | None = None, startup_timeout: float | None = None,
                 parent_pid: int | None = None, poll: float = 0.2) -> None:
        if timeout <= 0:
            raise ValueError(f"heartbeat timeout must be > 0 seconds, got {timeout}")
        self.out = Path(out_dir)
        self.rank, self.world, self.host = rank, world, host
        self.timeout = timeout
        self.checkpoint_timeout = checkpoint_timeout or max(timeout, 1800.0)
        self.startup_timeout = startup_timeout or max(timeout, 900.0)
        self.parent_pid = parent_pid
        self.poll = poll
        self._step = -1
        self._phase = "startup"
        self._last = time.monotonic()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="trainer-watchdog", daemon=True)
        self._thread.start()

    @classmethod
    def from_env(cls, out_dir: str | os.PathLike, rank: int, host: str) -> "Watchdog | None":
        """The watchdog the launcher asked for through the environment, or None."""
        raw = os.environ.get(TIMEOUT_ENV, "").strip()
        if not raw:
            return None

        def seconds(name: str) -> float | None:
            v = os.environ.get(name, "").strip()
            return float(v) if v else None

        parent = os.environ.get(PARENT_ENV, "").strip()
        return cls(out_dir, rank, int(os.environ.get("WORLD_SIZE", "1")), host, timeout=float(raw),
                   checkpoint_timeout=seconds(CHECKPOINT_TIMEOUT_ENV), startup_timeout=seconds(STARTUP_TIMEOUT_ENV),
                   parent_pid=os.getppid() if parent == "1" else None)

    def progress(self, step: int, phase: str) -> None:
        """Called on every heartbeat; the clock restarts when the step (or the phase) moves on."""
        with self._lock:
            if step != self._step or phase != self._phase:
                self._step, self._phase, self._last = step, phase, time.monotonic()

    def limit(self) -> float:
        if self._phase == "checkpoint":
            return self.checkpoint_timeout
        if self._phase in ("startup", "resumed"):
            return self.startup_timeout
        return self.timeout

    def _run(self) -> None:
        while True:
            time.sleep(self.poll)
            if self.parent_pid is not None and os.getppid() != self.parent_pid:
                print(f"[watchdog] rank {self.rank}: the node agent (pid {self.parent_pid}) is gone; exiting",
                      file=sys.stderr, flush=True)
                os._exit(EXIT_ORPHANED)
            with self._lock:
                silent, limit, step, phase = time.monotonic() - self._last, self.limit(), self._step, self._phase
            if silent > limit:
                self.fire(step, phase, silent)

    def fire(self, step: int, phase: str, silent: float) -> None:
        """Dump stacks, record the culprit, exit with :data:`EXIT_HANG` (does not return)."""
        head = (f"[watchdog] rank {self.rank} on {self.host}: no progress for {silent:.1f}s "
                f"(limit {self.limit():.0f}s) at step {step} ({phase}); stacks of every thread follow")
        print(head, file=sys.stderr, flush=True)
        faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        try:
            d = self.out / STACKS_DIR
            d.mkdir(parents=True, exist_ok=True)
            with open(d / f"{self.host}-rank-{self.rank:05d}.txt", "a") as f:
                f.write(head + "\n")
                f.flush()
                faulthandler.dump_traceback(file=f, all_threads=True)
            beats = read_heartbeats(self.out)
            bad = culprit(beats, self.world)
            rec = beats.get(bad, {})
            stall = int(rec.get("step", -1))
            # one record per stall: the ranks whose watchdogs fire later find it already there
            if not any(r.get("kind") == "hang" and r.get("stall_step") == stall and r.get("rank") == bad
                       and r.get("pid") == rec.get("pid") for r in read_failures(self.out)):
                append_jsonl(self.out / FAILURES_FILE, {
                    "time": time.time(), "kind": "hang", "rank": bad, "host": rec.get("host"), "pid": rec.get("pid"),
                    "stall_step": stall, "phase": rec.get("phase"), "reported_by": self.rank,
                    "seconds_silent": round(silent, 3)})
        finally:
            os._exit(EXIT_HANG)
