"""What every node launcher of a job shares: the exit codes and defaults, the node's options, the
events file ``OUT/launcher.jsonl``, and the job's state in the rendezvous store (a stop by signal,
the job's end), beside torch's rendezvous."""
from __future__ import annotations

import json
import os
import re
import signal
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..fault import EXIT_CHECKPOINT_FAILURE, EXIT_SOFT_FAILURE
from ..records import append_jsonl
from ..stop import FORWARD_AS, STOP_SIGNALS, SignalCount, signal_name
from ..watchdog import EXIT_HANG

EXIT_CONFIG = 2
#: Worker exit codes a restart cannot fix: the job stops on every node.
FATAL_EXIT_CODES = {EXIT_CONFIG: "bad configuration, input or output directory",
                    EXIT_CHECKPOINT_FAILURE: "checkpoint write failure or no valid checkpoint"}
#: Worker exit codes whose node may be to blame (confirmed by a failures.jsonl record naming it).
BLAME_EXIT_CODES = {EXIT_SOFT_FAILURE: "NaN/Inf", EXIT_HANG: "hang (watchdog)"}
#: Worker exit codes of a run stopped by a signal (the trainer's 128 + SIGINT / SIGTERM): the job
#: stops on every node, each launcher says at which step and exits with the same code.
STOP_EXIT_CODES = {128 + int(s): s.name for s in STOP_SIGNALS}
#: Node launcher exit codes besides the workers' own.
EXIT_GAVE_UP = 1
#: Seconds between two "waiting for nodes" lines.
WAIT_REPORT_S = 10.0
#: The trainer's line when a signal stopped it (every rank prints it under the launcher).
STOPPED_LINE = re.compile(r"stopped at step (\d+) \((SIG\w+)\); checkpoint at (.+?); ")
EVENTS_FILE = "launcher.jsonl"
DEFAULT_PORT = 29400


#: Seconds a worker gets between SIGTERM (with SIGCONT, so that a stopped one receives it) and SIGKILL.
DEFAULT_KILL_GRACE = 3.0
#: Seconds a new round may wait for ``--nnodes`` nodes once the job has trained, before it stops.
DEFAULT_QUORUM_TIMEOUT = 90.0


def say(text: str, *, err: bool = False) -> None:
    """One line in one write: node launchers started together share the console, and a line split
    into its text and its newline interleaves with another process's."""
    stream = sys.stderr if err else sys.stdout
    stream.write(text + "\n")
    stream.flush()

def parse_endpoint(text: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep:
        return text, DEFAULT_PORT
    try:
        return host, int(port)
    except ValueError:
        raise ValueError(f"--rdzv-endpoint must be HOST:PORT, got {text!r}") from None

class Events:
    """``OUT/launcher.jsonl``, shared by every node (one O_APPEND write per line), echoed to stdout."""

    def __init__(self, out: Path, node: str) -> None:
        self.path = out / EVENTS_FILE
        self.node = node

    def log(self, event: str, **fields: Any) -> dict[str, Any]:
        record = {"time": time.time(), "event": event, "node": self.node, **fields}
        say(f"[launch {self.node}] {json.dumps(record, sort_keys=True)}")
        append_jsonl(self.path, record)
        return record

def read_events(out: str | os.PathLike) -> list[dict[str, Any]]:
    path = Path(out) / EVENTS_FILE
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]

@dataclass
class NodeOptions:
    label: str
    out: Path
    command: list[str]
    n_min: int
    n_max: int
    nproc: int
    endpoint: str
    run_id: str
    max_restarts: int
    rdzv_conf: dict[str, str] = field(default_factory=dict)
    heartbeat_timeout: float = 300.0
    checkpoint_timeout: float = 1800.0
    startup_timeout: float = 900.0
    monitor_interval: float = 0.5
    kill_grace: float = DEFAULT_KILL_GRACE
    quorum_timeout: float = DEFAULT_QUORUM_TIMEOUT

class QuorumLost(RuntimeError):
    """A round after the job started found fewer than ``--nnodes`` nodes for ``--quorum-timeout`` s."""

    def __init__(self, have: int, need: int, waited: float, flag: str, why: str = "") -> None:
        super().__init__(f"the job has {have} of the {need} nodes it needs (waited {waited:.0f}s, {flag})"
                         f"{': ' + why if why else ''}; stopping. Restart it with more nodes (or a smaller "
                         "--nnodes): it resumes from the newest valid checkpoint")
        self.have, self.need = have, need

class StoreLost(RuntimeError):
    """The rendezvous store stopped answering."""

class JobEnded(RuntimeError):
    """Another node ended the job as a whole (a stop by signal, a fatal exit code, the restart
    limit): this node ends with that node's line and code instead of forming a new round."""

    def __init__(self, record: dict[str, Any]) -> None:
        super().__init__(record.get("line", ""))
        self.record = record

class StoppedWaiting(RuntimeError):
    """A stop by signal (to this node or another) while this node waited for a round: no worker
    trains here, so nothing needs saving."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal_name(signum))
        self.signum = signum

class JobState:
    """What a node launcher shares with the others through the rendezvous store, beside torch's
    rendezvous: a stop requested by a signal (``<run_id>/stop``), and the job's end
    (``<run_id>/end``: the exit code and the line every node prints last). Both are also events
    in ``OUT/launcher.jsonl`` for people.

    A signal to any node launcher stops the whole job: the launcher passes it on to its workers
    (SIGUSR1 for SIGTERM, SIGUSR2 for SIGINT, :mod:`trainer.ft.stop`), which agree on the step to stop
    after, checkpoint it and exit 143 (130); the other launchers read the request here within a
    second and pass it on too (it matters when the signalled node has no workers: a spare, a
    round being formed). A second signal to a launcher kills its workers and exits at once."""

    def __init__(self, store: Any, opts: "NodeOptions", events: "Events") -> None:
        self.store, self.events, self.label = store, events, opts.label
        self.prefix = f"trainer.launch/{opts.run_id}/"
        self.started = time.time()
        #: the job's stop signal, once this node knows of one (its own, or another node's)
        self.signum: int | None = None
        self.received = SignalCount()  # signals to this launcher
        self.published = False
        self.agent: Any = None
        self._next_poll = 0.0

    # ------------------------------------------------------------------ signals to this launcher
    def install(self) -> None:
        for sig in STOP_SIGNALS:
            signal.signal(sig, self.handle)

    def handle(self, signum: int, frame: Any) -> None:
        # no buffered output here: the main thread may be inside a print (poll() logs the event)
        if self.received.again():
            self.abort(signum)
        if self.signum is None:
            self.signum = signum
            self.forward()

    def abort(self, signum: int) -> None:
        for pid in self.worker_pids():
            try:
                os.killpg(pid, signal.SIGKILL)
            except OSError:
                pass
        line = f"aborted at once ({signal_name(signum)} again); the newest complete checkpoint stays valid"
        try:
            append_jsonl(self.events.path, {"time": time.time(), "event": "aborted", "node": self.label,
                                            "signal": signal_name(signum)})
        finally:
            os.write(2, f"\n{line}\n".encode())
            os._exit(128 + signum)

    def worker_pids(self) -> list[int]:
        pcontext = getattr(self.agent, "_pcontext", None)
        try:
            return list(pcontext.pids().values()) if pcontext is not None else []
        except Exception:  # noqa: BLE001 - closed
            return []

    def forward(self) -> None:
        """Pass the stop on to this node's running workers (the worker itself, not its group)."""
        if self.signum is None:
            return
        for pid in self.worker_pids():
            try:
                os.kill(pid, FORWARD_AS[signal.Signals(self.signum)])
            except OSError:
                pass

    # ------------------------------------------------------------------ the store
    def _get(self, name: str) -> dict[str, Any] | None:
        key = self.prefix + name
        if not self.store.check([key]):
            return None
        rec = json.loads(self.store.get(key).decode())
        # a record of an earlier job on a store that outlived it (clocks agree within seconds)
        return rec if float(rec.get("time", 0)) >= self.started - 60 else None

    def _set(self, name: str, rec: dict[str, Any]) -> None:
        self.store.set(self.prefix + name, json.dumps(rec))

    def poll(self, force: bool = False, check_end: bool = True) -> None:
        """Publish this node's stop request, take up another node's, and (``check_end``) raise
        :class:`JobEnded` when another node ended the job (at most one look a second unless
        ``force``)."""
        now = time.monotonic()
        if not force and now < self._next_poll:
            return
        self._next_poll = now + 1.0
        try:
            end = self._get("end")
            if self.signum is not None and not self.published:
                self.published = True
                self.events.log("stop_requested", signal=signal_name(self.signum), by=self.label)
                self._set("stop", {"signal": self.signum, "time": time.time(), "node": self.label})
            elif self.signum is None:
                rec = self._get("stop")
                if rec is not None:
                    self.signum = int(rec["signal"])
                    self.published = True
                    self.events.log("stop_requested", signal=signal_name(self.signum), by=rec.get("node"))
                    self.forward()
        except Exception:  # noqa: BLE001 - the store's loss is reported by the rendezvous
            return
        if end is not None and check_end:
            raise JobEnded(end)

    def job_end(self) -> dict[str, Any] | None:
        """The job's end as another node recorded it, if any."""
        try:
            rec = self._get("end")
        except Exception:  # noqa: BLE001
            rec = None
        if rec is None:  # the store may be gone with its host: the shared events file says it too
            ends = [e for e in read_events(self.events.path.parent) if e["event"] == "job_end"
                    and float(e.get("time", 0)) >= self.started - 60]
            rec = ends[-1] if ends else None
        return rec

    def end_job(self, code: int, line: str, **fields: Any) -> None:
        """Record that this node ends the job: the others print ``line`` and exit ``code``."""
        rec = {"code": code, "line": line, "time": time.time(), "node": self.label, **fields}
        try:
            self._set("end", rec)
        except Exception:  # noqa: BLE001
            pass
        self.events.log("job_end", **{k: v for k, v in rec.items() if k not in ("time", "node")})

def describe_failure(rec: dict[str, Any]) -> str:
    """A ``failures.jsonl`` record in a few words: what, where, which step."""
    where = f"rank {rec.get('rank')} on {rec.get('host')}"
    if rec.get("kind") == "nonfinite":
        return f"non-finite {rec.get('what', 'values')} at step {rec.get('step')} on {where}"
    if rec.get("kind") == "hang":
        return f"no progress at step {rec.get('stall_step')} on {where} ({rec.get('why', 'watchdog')})"
    return f"{rec.get('kind')} on {where}"
