"""In-worker watchdog: a rank whose step counter stops advancing dumps every Python stack and exits.

The elastic agent (``trainer.ft.launch``) only sees exits, so a hung rank must turn itself into one.
:class:`trainer.ft.fault.Heartbeat` feeds :meth:`Watchdog.progress` on every beat; a daemon thread checks the
time since the last *advance* against a limit that depends on the phase (``startup`` before the
first completed step, ``checkpoint`` while a checkpoint is written, ``step`` otherwise). When it
fires it

1. writes every thread's stack (``faulthandler``) to stderr and ``OUT/stacks/<host>-rank-<r>.txt``;
2. names the culprit from every rank's last progress, not from who timed out first: every rank
   blocked on the hung one goes quiet too, so the rank that got least far (step, then phase; the
   shared ``OUT/heartbeat/rank-*.json`` files) is blamed; among ranks equally far, one that stopped
   answering (no pulse: a stopped or frozen process), then one that is not waiting inside a
   ``torch.distributed`` call while the others are, then the one silent longest. The pulse is
   ``OUT/heartbeat/pulse-<r>.json``, written by this thread only while its rank has made no
   progress for a quarter of the limit (so a healthy run writes none): time, step, phase, and
   whether the watched thread is inside ``torch.distributed``. The first rank to fire appends
   ``{"kind": "hang", "host": <culprit's host>, "why": ...}`` to ``OUT/failures.jsonl`` under a
   lock of that file (one record per stall: later ranks see it and do not add another);
3. exits with :data:`EXIT_HANG`, which the node agent turns into a restart, and, on the blamed
   node, into leaving the job.

It also ends the worker when its parent (the node agent) is gone: torch starts workers in their own
session, so a ``kill -9`` of the agent's process group would otherwise leave them running.

Switched on by the launcher through the environment (``TRAINER_HEARTBEAT_TIMEOUT`` and friends);
off in a plain ``python -m trainer`` run.
"""
from __future__ import annotations

import faulthandler
import json
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any

from .records import HEARTBEAT_DIR, read_heartbeats, record_hang

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


PULSE_PREFIX = "pulse-"


def progress_key(rec: dict[str, Any] | None) -> tuple:
    """Sort key of a heartbeat record by how far its rank got (no record: nowhere)."""
    if rec is None:
        return (-1, -1, 0.0)
    return (int(rec.get("step", -1)), PHASE_ORDER.get(rec.get("phase", ""), 0), float(rec.get("mtime", 0.0)))


def read_pulses(out_dir: str | os.PathLike) -> dict[int, dict[str, Any]]:
    """``{rank: last pulse record}`` from ``OUT/heartbeat/pulse-*.json``."""
    out = {}
    for f in (Path(out_dir) / HEARTBEAT_DIR).glob(PULSE_PREFIX + "*.json"):
        try:
            rec = json.loads(f.read_text())
            out[int(rec["rank"])] = rec
        except (OSError, ValueError, KeyError):
            continue
    return out


def rank_state(beat: dict[str, Any] | None, pulse: dict[str, Any] | None, now: float) -> str:
    """``"unresponsive"`` (no recent pulse from the process of its last heartbeat), ``"working"``
    (answering, not inside torch.distributed) or ``"waiting"`` (answering, inside a collective)."""
    if pulse is None or (beat is not None and pulse.get("pid") != beat.get("pid")):
        return "unresponsive"
    if now - float(pulse.get("time", 0.0)) > 3 * float(pulse.get("interval", 1.0)) + 1.0:
        return "unresponsive"
    return "waiting" if pulse.get("waiting") else "working"


_STATE_ORDER = {"unresponsive": 0, "working": 1, "waiting": 2}


def culprit(beats: dict[int, dict[str, Any]], world: int, pulses: dict[int, dict[str, Any]] | None = None,
            now: float | None = None) -> tuple[int, str]:
    """The rank to blame for a stall and why: the one that got least far (step, phase); among
    those, the one not answering, then one working while others wait in a collective, then the one
    silent longest. Without pulses (``pulses=None``) only progress and silence count."""
    now = time.time() if now is None else now

    def key(r: int) -> tuple:
        step, phase, mtime = progress_key(beats.get(r))
        state = _STATE_ORDER[rank_state(beats.get(r), pulses.get(r), now)] if pulses is not None else 0
        return (step, phase, state, mtime)

    keys = {r: key(r) for r in range(world)}
    bad = min(range(world), key=keys.__getitem__)
    k = keys[bad]
    beat = beats.get(bad)
    where = "no heartbeat" if beat is None else f"step {beat.get('step')} ({beat.get('phase')})"
    others = [keys[r] for r in range(world) if r != bad]
    if not others or all(o[:2] > k[:2] for o in others):
        why = f"least progress: {where}; every other rank got further"
    elif pulses is not None and all(o[:3] > k[:3] for o in others if o[:2] == k[:2]):
        state = rank_state(beat, pulses.get(bad), now)
        why = (f"{where} like others; it stopped answering (no watchdog pulse: stopped or frozen)"
               if state == "unresponsive" else
               f"{where} like others; it is not inside torch.distributed while they wait there")
    else:
        why = f"{where} like others; silent longest"
    return bad, why


def _in_distributed(frame: Any) -> bool:
    """Whether a stack (innermost ``frame``) is inside a ``torch.distributed`` call."""
    while frame is not None:
        name = frame.f_code.co_filename.replace(os.sep, "/")
        if "/torch/distributed/" in name and "/elastic/" not in name:
            return True
        frame = frame.f_back
    return False


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
        self._watched = threading.get_ident()  # the training thread: the one that creates the watchdog
        self._last_pulse = 0.0
        self._stopped = threading.Event()
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

    def stop(self) -> None:
        """End the watching thread (it does not fire after this returns)."""
        self._stopped.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stopped.wait(self.poll):
            if self.parent_pid is not None and os.getppid() != self.parent_pid:
                print(f"[watchdog] rank {self.rank}: the node agent (pid {self.parent_pid}) is gone; exiting",
                      file=sys.stderr, flush=True)
                os._exit(EXIT_ORPHANED)
            with self._lock:
                silent, limit, step, phase = time.monotonic() - self._last, self.limit(), self._step, self._phase
            if silent > limit:
                self.fire(step, phase, silent)
            interval = self.pulse_interval(limit)
            if silent > limit / 4 and time.monotonic() - self._last_pulse >= interval:
                self.pulse(step, phase, interval)

    @staticmethod
    def pulse_interval(limit: float) -> float:
        return max(0.2, min(5.0, limit / 10))

    def pulse(self, step: int, phase: str, interval: float) -> None:
        """Say this process still answers, and whether its training thread waits in torch.distributed."""
        self._last_pulse = time.monotonic()
        frame = sys._current_frames().get(self._watched)
        rec = {"rank": self.rank, "pid": os.getpid(), "host": self.host, "time": time.time(), "step": step,
               "phase": phase, "interval": interval, "waiting": _in_distributed(frame)}
        try:
            path = self.out / HEARTBEAT_DIR / f"{PULSE_PREFIX}{self.rank:05d}.json"
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(".tmp")
            tmp.write_text(json.dumps(rec))
            os.replace(tmp, path)
        except OSError:
            pass

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
            bad, why = culprit(beats, self.world, read_pulses(self.out))
            rec = beats.get(bad, {})
            since = time.time() - silent  # this stall began after this rank's last progress
            # one record per stall: the ranks whose watchdogs fire later find it there
            record_hang(self.out, {
                "time": time.time(), "kind": "hang", "rank": bad, "host": rec.get("host"), "pid": rec.get("pid"),
                "stall_step": int(rec.get("step", -1)), "phase": rec.get("phase"), "why": why,
                "reported_by": self.rank, "seconds_silent": round(silent, 3)}, since)
        finally:
            os._exit(EXIT_HANG)
