"""Per-node launcher on torch's elastic agent: restarts, spares and blame for the trainer.

Run the same command once on every node, spares included (``mpiexec -ppn 1``,
``srun --ntasks-per-node 1``, or by hand)::

    python -m trainer.ft.launch --nnodes 2 --nproc-per-node 4 --rdzv-endpoint HOST:29400 --rdzv-id JOB \\
        --max-restarts 3 [--node-label NAME] [--heartbeat-timeout 300] --out OUT -- <trainer args>

or, on one machine, K node launchers sharing one rendezvous on 127.0.0.1::

    python -m trainer.ft.launch --local-nodes 3 --nnodes 2 --nproc-per-node 1 --out OUT -- <trainer args>

Each node runs torch's ``LocalElasticAgent`` with the ``c10d`` rendezvous; it starts only its own
ranks. The first ``--nnodes`` nodes to arrive train; later ones wait in the rendezvous (its
redundancy list) and take the place of a node that leaves. A failure anywhere makes every agent
restart its workers in a new rendezvous round; the trainer resumes from the newest valid checkpoint.
What this module adds to the agent:

* blame: a node whose rank reported a NaN/Inf (exit 75) or was named by a watchdog (exit 77) in
  ``OUT/failures.jsonl`` leaves the job (its agent stops, leaves the rendezvous and exits without
  closing it), so a spare replaces it;
* fatal codes (2: bad configuration or ``--out``; 76: checkpoint write failure or no valid
  checkpoint) stop the job on every node instead of restarting;
* the watchdog's settings for the workers (``trainer.ft.watchdog``), the node label
  (``TRAINER_HOST``), and ``OUT/launcher.jsonl``, appended by whichever node observes an event;
* a check that every node was started with the same ``--nnodes``/``--nproc-per-node``;
* ``--serve-store``: the rendezvous store in a process of its own, so that losing a training node
  never loses the store (``--local-nodes`` does this for its nodes);
* one rendezvous round per failure: a node that loses the race for the last slot waits as a spare
  instead of making every agent restart its workers again (:class:`RoundGuard`);
* workers stopped within ``--kill-grace`` s on every path (SIGCONT + SIGTERM, then SIGKILL), so a
  stopped worker does not hold a restart for torch's 30 s;
* ``--quorum-timeout``: once the job has trained, a round short of nodes stops the job with one line
  saying how many nodes it has and needs, instead of waiting ``join_timeout``;
* the rendezvous store's loss as one ``error:`` line (workers' stderr goes to their log files;
  each failure event carries one line per failed rank).

Exit codes and the cluster command lines: docs/fault.md.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

# The launcher's own C++ warnings are off (torch reads this when it loads; the workers get the
# user's setting back in run_node): when the store's host dies, c10's TCPStore prints a broken pipe
# with some 30 C++ frames before the launcher's one-line error could say what happened.
_CPP_LOG_ENV = "TORCH_CPP_LOG_LEVEL"
_QUIET_CPP = ((__name__ == "__main__" or os.path.basename(sys.argv[0] if sys.argv else "") == "fastmoe-launch")
              and _CPP_LOG_ENV not in os.environ and "torch" not in sys.modules)
if _QUIET_CPP:
    os.environ[_CPP_LOG_ENV] = "ERROR"

from .fault import EXIT_CHECKPOINT_FAILURE, EXIT_SOFT_FAILURE, HOST_ENV, check_out_dir
from .records import append_jsonl, read_failures, read_heartbeats, record_hang
from .stop import FORWARD_AS, LAUNCHER_ENV, STOP_SIGNALS, signal_name
from .watchdog import (
    CHECKPOINT_TIMEOUT_ENV, EXIT_HANG, PARENT_ENV, STARTUP_TIMEOUT_ENV, TIMEOUT_ENV,
)

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
_STOPPED_LINE = re.compile(r"stopped at step (\d+) \((SIG\w+)\); checkpoint at (.+?); ")
EVENTS_FILE = "launcher.jsonl"
DEFAULT_PORT = 29400
#: Rendezvous settings that make a dead node count as dead within seconds (torch: 5 s x 3) and
#: bound every wait; any of them can be overridden with --rdzv-conf.
DEFAULT_RDZV_CONF = {"join_timeout": "600", "last_call_timeout": "1", "close_timeout": "10",
                     "keep_alive_interval": "1", "keep_alive_max_attempt": "5", "read_timeout": "60"}


#: Seconds a worker gets between SIGTERM (with SIGCONT, so that a stopped one receives it) and SIGKILL.
DEFAULT_KILL_GRACE = 3.0
#: Seconds a new round may wait for ``--nnodes`` nodes once the job has trained, before it stops.
DEFAULT_QUORUM_TIMEOUT = 90.0


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def say(text: str, *, err: bool = False) -> None:
    """One line in one write: node launchers started together share the console, and a line split
    into its text and its newline interleaves with another process's."""
    stream = sys.stderr if err else sys.stdout
    stream.write(text + "\n")
    stream.flush()


def parse_nnodes(text: str) -> tuple[int, int]:
    """``"N"`` or ``"N:M"`` -> (min, max); only a fixed size (N == M) is supported (docs/fault.md)."""
    try:
        lo, _, hi = text.partition(":")
        n_min, n_max = int(lo), int(hi or lo)
    except ValueError:
        raise ValueError(f"--nnodes must be N or N:M with integers, got {text!r}") from None
    if n_min < 1 or n_max < n_min:
        raise ValueError(f"--nnodes {text!r}: need 1 <= N <= M")
    if n_max != n_min:
        raise ValueError(f"--nnodes {text!r}: only a fixed size is supported (N:N); start extra nodes as spares. "
                         "An elastic data-parallel size would change the micro-batches per rank of a running job")
    return n_min, n_max


def parse_rdzv_conf(text: str) -> dict[str, str]:
    conf = dict(DEFAULT_RDZV_CONF)
    for part in filter(None, (p.strip() for p in text.split(","))):
        key, sep, value = part.partition("=")
        if not sep or not key:
            raise ValueError(f"--rdzv-conf: expected key=value[,key=value...], got {part!r}")
        conf[key.strip()] = value.strip()
    return conf


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


# ============================================================================ the rendezvous
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
        self.received = 0  # signals to this launcher
        self.published = False
        self.agent: Any = None
        self._next_poll = 0.0

    # ------------------------------------------------------------------ signals to this launcher
    def install(self) -> None:
        for sig in STOP_SIGNALS:
            signal.signal(sig, self.handle)

    def handle(self, signum: int, frame: Any) -> None:
        # no buffered output here: the main thread may be inside a print (poll() logs the event)
        self.received += 1
        if self.received > 1:
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


class RoundGuard:
    """Two corrections to torch's c10d rendezvous for a fixed-size job with spares, and the
    quorum deadline.

    1. *A node that loses the race for the last slot waits as a spare.* When a round forms, every
       waiting node tries to join; the ones that arrive after it is full stay on torch's wait list,
       and every agent restarts its healthy workers whenever the wait list is not empty: a new
       round every couple of seconds, membership alternating, and such restarts do not count
       against ``--max-restarts`` (a restart storm). Here such a node moves from the wait list to the
       redundancy list (where a spare that arrives while the group is complete waits), and
       :meth:`nodes_waiting` counts waiting nodes only while the group has a free slot.
    2. *A job too small to go on stops.* In a round after the job started (torch's round > 0, or
       this node was a spare), the node waits at most ``quorum_timeout`` s for ``--nnodes`` nodes,
       instead of ``join_timeout`` (600 s); torch's own timeout path then removes it from the round.

    Both wrap the handler's operation executor and its ``num_nodes_waiting``; with a torch whose
    handler lacks these internals (checked by name) the launcher runs the handler unchanged."""

    def __init__(self, handler: Any, *, n_nodes: int, quorum_timeout: float) -> None:
        self.handler, self.n_nodes, self.quorum_timeout = handler, n_nodes, quorum_timeout
        self.have = 0
        self.quorum_expired: tuple[int, float] | None = None
        #: monotonic time since which this node waits in a round short of nodes (None: it does not)
        self.short_since: float | None = None
        #: the job's shared state (stop requests, the job's end), looked at while this node waits
        self.job: JobState | None = None
        #: for the lines a waiting node prints: its label, and the first round's join timeout
        self.label, self.join_timeout = "", 600.0
        self.said_spare = False
        self.installed = False
        try:
            from torch.distributed.elastic.rendezvous import dynamic_rendezvous as dr

            self._dr = dr
            needed = (hasattr(dr, "_RendezvousJoinOp") and hasattr(dr, "_Action")
                      and hasattr(dr._Action, "REMOVE_FROM_WAIT_LIST") and hasattr(handler, "_op_executor")
                      and hasattr(handler, "_state_holder") and hasattr(handler, "_heartbeat_lock"))
        except ImportError:
            needed = False
        if needed:
            handler._op_executor = _Executor(handler._op_executor, self)
            handler.num_nodes_waiting = self.nodes_waiting
            self.installed = True

    def nodes_waiting(self) -> int:
        """Nodes waiting for a slot that exists: 0 while the group is complete and full."""
        with self.handler._heartbeat_lock:
            self.handler._state_holder.sync()
            st = self.handler._state_holder.state
            if st.complete and len(st.participants) >= self.n_nodes:
                return 0
            return len(st.wait_list)


class _Executor:
    """The handler's operation executor with its join operation replaced by :class:`_JoinOp`."""

    def __init__(self, inner: Any, guard: RoundGuard) -> None:
        self._inner, self._guard = inner, guard

    def run(self, state_handler: Any, deadline: float, *args: Any, **kw: Any) -> None:
        if isinstance(state_handler, self._guard._dr._RendezvousJoinOp):
            state_handler = _JoinOp(state_handler, self._guard)
        return self._inner.run(state_handler, deadline, *args, **kw)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


class _JoinOp:
    def __init__(self, base: Any, guard: RoundGuard) -> None:
        self.base, self.guard = base, guard
        self.started = time.monotonic()
        self.quorum_deadline: float | None = None
        self.next_report = self.started + WAIT_REPORT_S
        self.polled = False

    def __call__(self, ctx: Any, deadline: float) -> Any:
        st, g, action = ctx.state, self.guard, self.guard._dr._Action
        if g.job is not None:  # another node stopped or ended the job: no new round (raises JobEnded)
            g.job.poll(force=not self.polled)
            self.polled = True
        full = len(st.participants) >= g.n_nodes
        if st.complete and not st.closed and full and ctx.node in st.wait_list:
            return action.REMOVE_FROM_WAIT_LIST  # and next, torch's op puts it on the redundancy list
        spare = ctx.node in st.redundancy_list
        now = time.monotonic()
        waiting = not st.closed and not (st.complete and ctx.node in st.participants)
        if spare:
            self.quorum_deadline = None  # a spare waits as long as the job runs
            if not g.said_spare:
                g.said_spare = True
                say(f"[launch {g.label}] spare: the job has its {g.n_nodes} node(s); waiting to take the place "
                    "of one that leaves")
        elif st.round > 0 and waiting:
            if self.quorum_deadline is None:
                self.quorum_deadline = now + g.quorum_timeout
            g.short_since = self.quorum_deadline - g.quorum_timeout
            if now > self.quorum_deadline and g.quorum_expired is None:
                g.quorum_expired = (g.have, g.quorum_timeout)
            deadline = min(deadline, self.quorum_deadline)
        if not spare and now <= deadline:
            g.have = len(set(st.participants) | set(st.wait_list) | {ctx.node})
        if not spare and waiting and now >= self.next_report:
            self.next_report = now + WAIT_REPORT_S
            limit = f"--quorum-timeout {g.quorum_timeout:.0f} s" if st.round > 0 else \
                f"the join timeout {g.join_timeout:.0f} s"
            say(f"[launch {g.label}] waiting for nodes: {g.have} of {g.n_nodes} joined "
                f"({now - self.started:.0f} s of {limit})")
        return self.base(ctx, deadline)


def _make_agent_class():
    # torch.distributed.elastic is imported lazily: the launcher's --help and input errors stay fast
    from torch.distributed.elastic.agent.server.api import RunResult, WorkerState
    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent

    class NodeAgent(LocalElasticAgent):
        """The elastic agent plus blame, fatal codes and events (see the module docstring)."""

        def __init__(self, *args: Any, opts: NodeOptions, events: Events, guard: RoundGuard, job: JobState,
                     **kw: Any) -> None:
            super().__init__(*args, **kw)
            self.opts, self.events = opts, events
            self.started = time.time()
            self.outcome = "running"
            self.exit_code = 0
            #: the line this node prints last when it ends the job or leaves it
            self.last_line = ""
            self._round_started = 0.0
            self._last_stop_s = 0.0
            self._role = ""
            self.guard = guard
            self.job = job
            job.agent = self
            #: worker pid -> when this agent first saw it stopped (SIGSTOP, a frozen cgroup)
            self._stopped_since: dict[int, float] = {}

        def _last_errors(self, result: Any) -> dict[str, str]:
            """Each failed rank's last error line from its stderr log (workers' stderr goes to
            ``OUT/logs/<label>/`` only; the console gets their stdout and these lines)."""
            stderrs = getattr(getattr(self, "_pcontext", None), "stderrs", None) or {}
            out = {}
            for rank, f in result.failures.items():
                path = stderrs.get(getattr(f, "local_rank", -1))
                code = getattr(f, "exitcode", 0) or 0
                line = _error_line(path) if path else ""
                if not line and code < 0:
                    try:
                        line = f"killed by {signal.Signals(-code).name}"
                    except ValueError:
                        line = f"killed by signal {-code}"
                out[str(rank)] = line
            return out

        def _stopped_workers(self, worker_group: Any) -> list[dict[str, Any]]:
            """The hang records (written to ``failures.jsonl``) of this node's workers that have been
            stopped (process state ``T``) for longer than ``--heartbeat-timeout``; [] otherwise."""
            pcontext = getattr(self, "_pcontext", None)
            pids = pcontext.pids() if pcontext is not None and hasattr(pcontext, "pids") else {}
            # Half as long again as the watchdogs wait: where they can tell (a stall inside a step),
            # they name the rank first, from every rank's progress and pulses.
            now, limit = time.monotonic(), 1.5 * self.opts.heartbeat_timeout
            records = []
            for local_rank, pid in pids.items():
                if not process_stopped(pid):
                    self._stopped_since.pop(pid, None)
                    continue
                since = self._stopped_since.setdefault(pid, now)
                if now - since <= limit:
                    continue
                workers = getattr(worker_group, "workers", [])
                rank = workers[local_rank].global_rank if local_rank < len(workers) else local_rank
                beat = read_heartbeats(self.opts.out).get(rank, {})
                stopped_s = now - since
                rec = record_hang(self.opts.out, {
                    "time": time.time(), "kind": "hang", "rank": rank, "host": self.opts.label, "pid": pid,
                    "stall_step": int(beat.get("step", -1)), "phase": beat.get("phase"),
                    "why": f"its process stopped (state T: SIGSTOP or a frozen cgroup) for {stopped_s:.1f}s",
                    "reported_by": f"launcher {self.opts.label}", "seconds_silent": round(stopped_s, 3)},
                    time.time() - stopped_s)
                if rec.get("host") == self.opts.label:  # a watchdog may have named another node for this stall
                    records.append(rec)
            return records

        def _blame_records(self) -> list[dict[str, Any]]:
            return [r for r in read_failures(self.opts.out)
                    if r.get("host") == self.opts.label and r.get("kind") in ("nonfinite", "hang")
                    and float(r.get("time", 0)) >= self.started]

        def _rendezvous(self, worker_group: Any) -> None:
            t0 = time.time()
            super()._rendezvous(worker_group)
            self.guard.short_since = None  # a full round formed
            self._round_started = time.time()
            ranks = [w.global_rank for w in worker_group.workers] if worker_group.workers else []
            self.events.log("round", group_rank=worker_group.group_rank, nodes=worker_group.group_world_size,
                            ranks=ranks or None, waited_s=round(self._round_started - t0, 3),
                            stop_s=self._last_stop_s)
            world = worker_group.group_world_size * self.opts.nproc
            role = (f"training node: ranks {_span(ranks)} of {world}; "
                    + ("the training progress follows" if 0 in ranks else "the node with rank 0 shows the progress"))
            if role != self._role:  # once, and again when it changes (a spare that joined)
                self._role = role
                say(f"[launch {self.opts.label}] {role}")

        def _stop_workers(self, worker_group: Any, *args: Any, **kw: Any) -> None:
            t0 = time.time()
            super()._stop_workers(worker_group, *args, **kw)
            self._last_stop_s = round(time.time() - t0, 3)

        def _start_workers(self, worker_group: Any) -> Any:
            ids = super()._start_workers(worker_group)
            self.job.install()  # torch's process context installs its own handlers when it starts
            pcontext = getattr(self, "_pcontext", None)
            if pcontext is not None and hasattr(pcontext, "close"):
                pcontext.close = _GracedClose(pcontext, self.opts.kill_grace, self._stopping)
            self.job.forward()  # a stop that came while the round formed: the new workers stop at once
            return ids

        def _stopping(self) -> bool:
            """Whether the job is stopping by signal: then workers end on their own after their
            checkpoint (``--kill-grace`` s, then SIGKILL); otherwise a close kills them at once."""
            if self.job.signum is not None:
                return True
            handlers = getattr(getattr(self, "_pcontext", None), "subprocess_handlers", None) or {}
            return any(getattr(h.proc, "returncode", None) in STOP_EXIT_CODES for h in handlers.values())

        def _shutdown(self, death_sig: signal.Signals = signal.SIGTERM, *args: Any, **kw: Any) -> None:
            """torch's shutdown, which closes the workers' processes, with ``--kill-grace`` on every
            path (torch waits its ``shutdown_timeout`` only when the agent exits, 30 s on a restart).

            The signature differs across torch releases (2.11: ``(death_sig)``; 2.13: ``(death_sig,
            timeout)``, and ``run`` passes ``timeout=`` there): whatever torch passes is accepted, and
            only ``death_sig`` is passed on; the grace is applied by the process context's ``close``,
            wrapped when the workers start (:class:`_GracedClose`). Without that wrapper (a torch
            whose agent keeps no ``_pcontext``) the grace goes as ``timeout`` where the base takes one."""
            base = super()._shutdown
            pcontext = getattr(self, "_pcontext", None)
            if pcontext is None or isinstance(getattr(pcontext, "close", None), _GracedClose) \
                    or not _accepts(base, "timeout"):
                base(death_sig)
            else:
                base(death_sig, self.opts.kill_grace)

        def _store_gone(self) -> BaseException | None:
            """The error of one read of the rendezvous state, or None when the store answers."""
            try:
                self.guard.handler.num_nodes_waiting()
            except Exception as e:  # noqa: BLE001 - any failure to read it means the same here
                return e
            return None

        def _monitor_workers(self, worker_group: Any) -> Any:
            self.job.poll(check_end=False)  # a stop asked of another node reaches this one's workers
            # named by a watchdog of another node while ours still runs (stuck or stopped). A
            # non-finite record waits for this node's workers to exit: the ranks write theirs
            # before a barrier, so by then every node's record is there (every node's: the job stops)
            blamed = [r for r in self._blame_records() if r.get("kind") == "hang"]
            if blamed:
                return self._leave(blamed, {})
            # A worker of this node stopped for longer than the heartbeat timeout: a hang whatever its
            # phase (the watchdogs allow a checkpoint write half an hour, and a stopped process's own
            # watchdog is stopped with it), blamed on this node.
            stopped = self._stopped_workers(worker_group)
            if stopped:
                return self._leave(stopped, {})
            result = super()._monitor_workers(worker_group)
            if result.state != WorkerState.FAILED:
                return result
            codes = {rank: f.exitcode for rank, f in result.failures.items()}
            errors = self._last_errors(result)
            stops = [c for c in codes.values() if c in STOP_EXIT_CODES]
            if stops or self.job.signum is not None:  # stopped by a signal here or on another node
                self._remaining_restarts = 0
                name = STOP_EXIT_CODES[stops[0]] if stops else signal_name(self.job.signum)
                self.outcome, self.exit_code = "stopped", 128 + int(signal.Signals[name])
                self.last_line = self._stopped_line(result, name)
                self.events.log("workers_stopped", exit_codes={str(r): c for r, c in codes.items()},
                                line=self.last_line)
                return result
            # a peer's death is also how a worker sees the store's host die: ask the store first,
            # so that its loss is one line and not a restart
            gone = self._store_gone()
            if gone is not None:
                raise StoreLost(_cause(gone)) from gone
            fatal = sorted({c for c in codes.values() if c in FATAL_EXIT_CODES})
            blamed = self._blame_records()
            self.events.log("failure", exit_codes={str(r): c for r, c in codes.items()},
                            remaining_restarts=self._remaining_restarts, errors=errors)
            if fatal:
                self._remaining_restarts = 0
                self.outcome, self.exit_code = "fatal", fatal[0]
                rank = next(r for r, c in sorted(codes.items()) if c == fatal[0])
                said = errors.get(str(rank), "").removeprefix("error: ")
                self.last_line = (f"error: the job stopped (exit {fatal[0]}: {FATAL_EXIT_CODES[fatal[0]]}; not "
                                  f"retried): rank {rank} on {self.opts.label}: {said or 'no message'}")
                self.events.log("give_up", reason=f"exit {fatal[0]}: {FATAL_EXIT_CODES[fatal[0]]} (not retried)")
                return result
            if blamed:
                everywhere = self._nonfinite_everywhere(blamed, worker_group.group_world_size)
                if everywhere:  # not a node's fault: a spare would meet it too
                    self._remaining_restarts = 0
                    self.outcome, self.exit_code, self.last_line = "fatal", EXIT_SOFT_FAILURE, everywhere
                    self.events.log("give_up", reason="non-finite values on every node")
                    return result
                return self._leave(blamed, codes)
            if self._remaining_restarts > 0:
                self.events.log("restart", remaining_restarts=self._remaining_restarts - 1)
            else:
                self.outcome, self.exit_code = "gave_up", EXIT_GAVE_UP
                last = "; ".join(f"rank {r}: exit {codes[int(r)]}" + (f" ({e})" if e else "")
                                 for r, e in sorted(errors.items(), key=lambda kv: int(kv[0])))
                self.last_line = (f"error: the job stopped: restart limit {self.opts.max_restarts} reached on "
                                  f"{self.opts.label}; last failure: {last}")
                self.events.log("give_up", reason=f"restart limit {self.opts.max_restarts} reached")
            return result

        def _nonfinite_everywhere(self, blamed: list[dict[str, Any]], nodes: int) -> str:
            """The job's last line when the non-finite values of this failure were on every node
            of the round (every rank records its own before any exits), else ``""``."""
            last = blamed[-1]
            if last.get("kind") != "nonfinite":
                return ""
            recs = [r for r in read_failures(self.opts.out) if r.get("kind") == "nonfinite"
                    and r.get("step") == last.get("step") and float(r.get("time", 0)) >= self._round_started]
            if len({r.get("host") for r in recs}) < nodes:
                return ""
            what = " and ".join(sorted({str(r.get("what", "values")) for r in recs}))
            return (f"error: the job stopped (exit {EXIT_SOFT_FAILURE}): non-finite {what} at step {last.get('step')} "
                    f"on every node (ranks {_span(sorted({int(r['rank']) for r in recs}))}), stopped before the update: "
                    "not a node's fault, a spare would meet it too. Lower the learning rate or check the data, "
                    "then start the job again: it resumes from the newest valid checkpoint")

        def _stopped_line(self, result: Any, name: str) -> str:
            """``stopped at step N (SIG); checkpoint at PATH; ...`` from this node's workers' logs
            (every rank prints the trainer's line there), or what is known without it."""
            stderrs = getattr(getattr(self, "_pcontext", None), "stderrs", None) or {}
            for path in stderrs.values():
                m = _STOPPED_LINE.search(_tail(path))
                if m:
                    return (f"stopped at step {m.group(1)} ({m.group(2)}); checkpoint at {m.group(3)}; "
                            "start the same job again to resume")
            return (f"stopped ({name}) before a training step ended; the newest checkpoint stays; start the same "
                    "job again to resume")

        def _leave(self, records: list[dict[str, Any]], codes: dict[int, int]) -> Any:
            self._remaining_restarts = 0
            kinds = sorted({r["kind"] for r in records})
            self.outcome = "left"
            self.exit_code = EXIT_SOFT_FAILURE if "nonfinite" in kinds else EXIT_HANG
            self.last_line = (f"left the job (exit {self.exit_code}): {_describe_failure(records[-1])}; a spare "
                              "takes this node's place if one waits")
            self.events.log("leave", reason=kinds, records=records[-3:])
            return RunResult(state=WorkerState.FAILED, failures={})

        def _restart_workers(self, worker_group: Any) -> None:
            self.events.log("stop_workers", reason="restart")
            super()._restart_workers(worker_group)

    return NodeAgent


class _GracedClose:
    """A worker process context's ``close``, however torch calls it (its agent's shutdown on a
    restart, a leave or the end, and its own poll once a worker has exited with an error).

    SIGTERM is not used: a worker takes it for a stop request (a scheduler sends it to every
    process of the job), finishes its step and checkpoints. So a close kills the workers with
    SIGKILL at once; while the job stops by signal (``stopping()``), the workers, which end on
    their own after the stop checkpoint, get ``grace`` s first."""

    def __init__(self, pcontext: Any, grace: float, stopping: Any = lambda: False) -> None:
        self.pcontext, self.grace, self.stopping = pcontext, grace, stopping
        self.inner = pcontext.close

    def __call__(self, death_sig: Any = None, timeout: float = 30, *args: Any, **kw: Any) -> None:
        if self.stopping():
            # SIGCONT is the one signal that asks nothing of a worker: torch's close sends it, waits
            # up to the grace for the workers to end, then kills what is left with SIGKILL
            self.inner(signal.SIGCONT, min(timeout, self.grace), *args, **kw)
        else:
            self.inner(signal.SIGKILL, min(timeout, self.grace), *args, **kw)


def _span(ranks: Sequence[int]) -> str:
    """``[3, 4, 5]`` -> ``"3-5"``; ``[2]`` -> ``"2"``; anything else comma-separated."""
    ranks = sorted(ranks)
    if not ranks:
        return "none"
    if len(ranks) > 1 and ranks == list(range(ranks[0], ranks[-1] + 1)):
        return f"{ranks[0]}-{ranks[-1]}"
    return ",".join(map(str, ranks))


def _tail(path: str | os.PathLike, size: int = 65536) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - size))
            return f.read().decode(errors="replace")
    except OSError:
        return ""


def process_stopped(pid: int) -> bool:
    """Whether process ``pid`` is stopped (state ``T`` or ``t`` in ``/proc/<pid>/stat``); False where
    that cannot be read (not Linux, the process gone)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return False
    state = stat[stat.rfind(b")") + 2:stat.rfind(b")") + 3]  # the field after the command's closing ")"
    return state in (b"T", b"t")


def _describe_failure(rec: dict[str, Any]) -> str:
    """A ``failures.jsonl`` record in a few words: what, where, which step."""
    where = f"rank {rec.get('rank')} on {rec.get('host')}"
    if rec.get("kind") == "nonfinite":
        return f"non-finite {rec.get('what', 'values')} at step {rec.get('step')} on {where}"
    if rec.get("kind") == "hang":
        return f"no progress at step {rec.get('stall_step')} on {where} ({rec.get('why', 'watchdog')})"
    return f"{rec.get('kind')} on {where}"


def agent_kwargs(agent_base: Any, kill_grace: float) -> dict[str, Any]:
    """Keyword arguments for torch's ``LocalElasticAgent``: ``shutdown_timeout`` only where its
    signature has it (torch 2.13 does, 2.11 does not). Either way the agent's ``_shutdown`` applies
    ``--kill-grace`` itself."""
    kw: dict[str, Any] = {"exit_barrier_timeout": 60}
    if _accepts(agent_base.__init__, "shutdown_timeout"):
        kw["shutdown_timeout"] = kill_grace
    return kw


def _accepts(fn: Any, name: str) -> bool:
    """Whether ``fn`` takes a parameter ``name`` (a feature check across torch versions)."""
    import inspect

    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False
    return name in params or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())


def _error_line(path: str | os.PathLike, limit: int = 2000) -> str:
    """The line of a worker's stderr that says what went wrong: the last ``error:``, watchdog or
    exception line (not indented, not a stack frame), else the last line."""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 65536))
            lines = [ln.rstrip() for ln in f.read().decode(errors="replace").splitlines() if ln.strip()]
    except OSError:
        return ""
    for ln in reversed(lines):
        if ln.startswith(("error:", "[watchdog]")):
            return ln[:limit]
    for ln in reversed(lines):
        if not ln[0].isspace() and not ln.startswith(("Thread 0x", "Current thread", "Traceback", "File ")) \
                and ":" in ln:
            return ln[:limit]
    return lines[-1][:limit] if lines else ""


def _cause(e: BaseException) -> str:
    """The innermost cause of ``e`` in a few words (torch wraps the store's error in its own)."""
    seen = e
    while seen.__cause__ is not None or (seen.__context__ is not None and not seen.__suppress_context__):
        seen = seen.__cause__ or seen.__context__
    text = " ".join(str(seen).split())
    text = text.split(". See inner exception")[0][:160]
    return f"{type(seen).__name__}: {text}" if text else type(seen).__name__


def run_node(opts: NodeOptions) -> int:
    """Run this node's agent until the job finishes, this node leaves, or the job gives up."""
    from torch.distributed import TCPStore
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, Std
    from torch.distributed.elastic.agent.server.api import WorkerSpec
    from torch.distributed.elastic.rendezvous import RendezvousParameters
    from torch.distributed.elastic.rendezvous import registry as rdzv_registry
    from torch.distributed.elastic.rendezvous.api import (
        RendezvousClosedError, RendezvousGracefulExitError, RendezvousTimeoutError,
    )

    events = Events(opts.out, opts.label)
    if _QUIET_CPP:
        os.environ.pop(_CPP_LOG_ENV, None)  # torch has read it; the workers keep their C++ warnings
    os.environ[HOST_ENV] = opts.label
    os.environ[TIMEOUT_ENV] = str(opts.heartbeat_timeout)
    os.environ[CHECKPOINT_TIMEOUT_ENV] = str(opts.checkpoint_timeout)
    os.environ[STARTUP_TIMEOUT_ENV] = str(opts.startup_timeout)
    os.environ[PARENT_ENV] = "1"
    os.environ[LAUNCHER_ENV] = "1"  # the workers take SIGUSR1/SIGUSR2 for a stop passed on (trainer/ft/stop.py)
    # SIGTERM and SIGINT are this launcher's (JobState); torch's process context would install its
    # own handlers for them whenever workers start (they are put back after it, too)
    os.environ["TORCHELASTIC_SIGNALS_TO_HANDLE"] = "SIGHUP,SIGQUIT"
    # torch's "Sending process N closing signal ..." per worker on every close: the events say it
    import logging

    logging.getLogger("torch.distributed.elastic.multiprocessing.api").setLevel(logging.ERROR)
    # The ranks of this machine share its cores (fastmoe_xpu/threads.py; run_local_nodes counts
    # every node it starts here).
    from fastmoe_xpu import threads

    os.environ.setdefault(threads.LOCAL_PROCESSES_ENV, str(opts.nproc))
    os.environ.setdefault("OMP_NUM_THREADS", str(threads.share(local=int(os.environ[threads.LOCAL_PROCESSES_ENV]))))
    # The agent's shared TCPStore for the workers is created once by the first round's rank 0 and
    # its address cached by every agent; after that node dies the survivors' workers would look for
    # it there. Without sharing, every round's rank-0 worker hosts a fresh store (docs/fault.md).
    os.environ["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    events.log("node_start", pid=os.getpid(), host=socket.gethostname(), nnodes=f"{opts.n_min}:{opts.n_max}",
               nproc_per_node=opts.nproc, endpoint=opts.endpoint, run_id=opts.run_id)
    host, port = parse_endpoint(opts.endpoint)
    read_timeout = float(opts.rdzv_conf.get("read_timeout", 60))
    params = RendezvousParameters(backend="c10d", endpoint=opts.endpoint, run_id=opts.run_id, min_nodes=opts.n_min,
                                  max_nodes=opts.n_max, **opts.rdzv_conf)
    try:
        handler = rdzv_registry.get_rendezvous_handler(params)
        # every node must describe the same job: the first one's settings are kept in the store
        store = TCPStore(host, port, is_master=False, timeout=datetime.timedelta(seconds=read_timeout),
                         wait_for_workers=False)
        mine = json.dumps({"nnodes": f"{opts.n_min}:{opts.n_max}", "nproc_per_node": opts.nproc})
        theirs = store.compare_set(f"trainer.launch/{opts.run_id}/config", "", mine).decode()
        if theirs != mine:
            msg = (f"node {opts.label} was started with {mine} but the job {opts.run_id!r} runs with {theirs}; "
                   "start every node with the same --nnodes and --nproc-per-node")
            events.log("error", reason=msg)
            say(f"error: {msg}", err=True)
            return EXIT_CONFIG
    except Exception as e:  # noqa: BLE001 - torch raises several kinds; all end here in one line
        msg = (f"cannot reach the rendezvous store at {opts.endpoint} within {read_timeout:.0f}s "
               f"({type(e).__name__}: {' '.join(str(e).split())[:300]}); is --serve-store (or the first node) "
               "running there, and is the port open?")
        events.log("error", reason=msg)
        say(f"error: {msg}", err=True)
        return EXIT_GAVE_UP
    guard = RoundGuard(handler, n_nodes=opts.n_max, quorum_timeout=opts.quorum_timeout)
    spec = WorkerSpec(role="trainer", local_world_size=opts.nproc, entrypoint=opts.command[0],
                      args=tuple(opts.command[1:]), rdzv_handler=handler, max_restarts=opts.max_restarts,
                      monitor_interval=opts.monitor_interval)
    # workers' stdout is echoed, their stderr goes to the log files only: a failure shows up as one
    # line per rank in the "failure" event (a peer's death makes every other rank print a stack)
    logs = DefaultLogsSpecs(log_dir=str(opts.out / "logs" / opts.label), redirects=Std.ALL, tee=Std.OUT)
    agent_cls = _make_agent_class()
    guard.label, guard.join_timeout = opts.label, float(opts.rdzv_conf.get("join_timeout", 600))
    job = guard.job = JobState(store, opts, events)
    agent = agent_cls(spec, logs_specs=logs, start_method="spawn", opts=opts, events=events, guard=guard, job=job,
                      **agent_kwargs(agent_cls.__mro__[1], opts.kill_grace))
    job.install()
    try:
        result = agent.run()
    except JobEnded as e:  # another node ended the job while this one waited for a round
        return _ended_by_other(events, e.record)
    except (RendezvousClosedError, RendezvousGracefulExitError):
        end = job.job_end()
        if end is not None:  # closed by a node that ended the job: its line and code
            return _ended_by_other(events, end)
        if guard.short_since is not None:  # another node of this short round gave up first
            waited = time.monotonic() - guard.short_since
            return _fail(events, str(QuorumLost(guard.have, opts.n_max, waited, "the rendezvous was closed",
                                                _departures(opts.out, agent.started))), None)
        result = None
    except RendezvousTimeoutError as e:
        if guard.quorum_expired is not None:
            have, waited = guard.quorum_expired
            e = QuorumLost(have, opts.n_max, waited, "--quorum-timeout", _departures(opts.out, agent.started))
        else:
            e = QuorumLost(guard.have or 1, opts.n_max, float(opts.rdzv_conf.get("join_timeout", 600)),
                           "join_timeout")
        return _fail(events, str(e), handler, job)
    except Exception as e:  # noqa: BLE001 - a lost store surfaces as several kinds of error
        if isinstance(e, StoreLost) or _store_error(e):
            msg = (f"lost the rendezvous store at {opts.endpoint} ({_cause(e)}); its host died or cannot be "
                   "reached. Restart the job: it resumes from the newest valid checkpoint; run the store with "
                   "--serve-store on a node that does not train to survive a training node's loss")
        else:
            msg = f"{type(e).__name__}: {' '.join(str(e).split())[:500]}"
        return _fail(events, msg, None)
    if result is None:  # a spare never needed, or the job closed while this node waited
        if job.signum is not None:  # a stop with nobody training (no worker said at which step)
            line = (f"stopped ({signal_name(job.signum)}) while this node waited for a round; the newest "
                    "checkpoint stays; start the same job again to resume")
            return _end(events, 128 + job.signum, line, job, handler)
        events.log("released")
        return 0
    if agent.outcome == "left":
        _leave_rendezvous(handler)
        events.log("left", exit_code=agent.exit_code, stop_s=agent._last_stop_s)
        say(agent.last_line, err=True)
        return agent.exit_code
    if result.is_failed():
        return _end(events, agent.exit_code or EXIT_GAVE_UP, agent.last_line or "error: the job stopped", job,
                    handler)
    _close(handler)
    events.log("finished", seconds=round(time.time() - agent.started, 3))
    return 0


def _end(events: Events, code: int, line: str, job: JobState, handler: Any) -> int:
    """This node ends the job: the record first (a node that finds the rendezvous closed reads it),
    then the rendezvous closed (spares and stragglers stop waiting), then the line, last."""
    job.end_job(code, line)
    _close(handler)
    say(line, err=True)
    return code


def _ended_by_other(events: Events, record: dict[str, Any]) -> int:
    """Another node ended the job: the same line (from that node) and exit code here."""
    code, line = int(record.get("code", EXIT_GAVE_UP)), str(record.get("line", "the job ended"))
    events.log("job_ended", code=code, by=record.get("node"))
    say(line, err=True)
    return code


def _departures(out: Path, since: float) -> str:
    """Why nodes left the job since ``since`` (the blame records), for the line of a job that
    ends short of nodes."""
    recs = [r for r in read_failures(out) if r.get("kind") in ("nonfinite", "hang")
            and float(r.get("time", 0)) >= since]
    seen, parts = set(), []
    for r in recs:  # one per node: the first record that named it
        if r.get("host") not in seen:
            seen.add(r.get("host"))
            parts.append(f"{r.get('host')} left after {_describe_failure(r)}")
    if not parts:
        return "a node is gone and no spare was left to take its place"
    return "; ".join(parts) + "; no spare was left to take their place"


def _fail(events: Events, msg: str, handler: Any, job: JobState | None = None) -> int:
    """One ``error:`` line (and event); close the rendezvous when ``handler`` is given, so that
    spares and stragglers stop waiting too (with ``job``, they print this line and exit 1 too)."""
    events.log("error", reason=msg)
    if job is not None:
        job.end_job(EXIT_GAVE_UP, f"error: {msg}")
    if handler is not None:
        _close(handler)
    say(f"error: {msg}", err=True)
    return EXIT_GAVE_UP


def _store_error(e: BaseException) -> bool:
    """Whether ``e`` (or what it wraps) is a failure to talk to the rendezvous store."""
    from torch.distributed.elastic.rendezvous.api import RendezvousConnectionError, RendezvousStateError

    while e is not None:
        if isinstance(e, (RendezvousConnectionError, RendezvousStateError, ConnectionError, TimeoutError)):
            return True
        name = type(e).__name__
        if "Store" in name or "Connection" in name or "store" in str(e).lower():
            return True
        e = e.__cause__ or e.__context__
    return False


def _leave_rendezvous(handler: Any) -> None:
    """Leave the rendezvous without closing it (the other nodes go on with a spare). Uses the
    handler's own exit operation, as ``next_rendezvous`` does; if that fails, the node's missing
    keep-alive removes it after keep_alive_interval x keep_alive_max_attempt seconds."""
    try:
        from torch.distributed.elastic.rendezvous.dynamic_rendezvous import _RendezvousExitOp

        handler._stop_heartbeats()
        handler._op_executor.run(_RendezvousExitOp(), time.monotonic() + 10)
    except Exception as e:  # noqa: BLE001
        say(f"[launch] could not leave the rendezvous cleanly ({e}); keep-alive expiry will")


def _close(handler: Any) -> None:
    try:
        handler.shutdown()  # closes the rendezvous: waiting spares are released
    except Exception:  # noqa: BLE001
        pass


# ============================================================================ the store
def serve_store(endpoint: str, *, ready: Path | None = None) -> int:
    """Host the rendezvous store until killed (a node that does not train, or --local-nodes)."""
    from torch.distributed import TCPStore

    host, port = parse_endpoint(endpoint)
    store = TCPStore("0.0.0.0" if host not in ("127.0.0.1", "localhost") else host, port, is_master=True,
                     wait_for_workers=False, multi_tenant=True, use_libuv=True)
    say(f"[launch store] serving the rendezvous store on {host}:{store.port}")
    if ready is not None:
        ready.write_text(str(store.port))
    # SIGTERM is a scheduler's stop notice to every process of the job: the node launchers use the
    # store while they stop after their step, so it keeps serving; SIGINT or SIGKILL ends it
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        while True:
            time.sleep(0.5)
    except KeyboardInterrupt:
        pass
    return 0


# ============================================================================ K nodes on this machine
def run_local_nodes(k: int, node_argv: list[str], out: Path, *, timeout: float | None = None,
                    ranks: int | None = None) -> int:
    """Start a store process and ``k`` node launchers (labels node0..node{k-1}, each in its own
    session so that a node can be killed as a whole); 0 when some node finished the job.
    ``ranks``: the training processes that run on this machine at once (default ``k``)."""
    port = free_port()
    endpoint = f"127.0.0.1:{port}"
    ready = out / f".store-{os.getpid()}"
    from fastmoe_xpu import threads

    env = dict(os.environ)
    env.setdefault(threads.LOCAL_PROCESSES_ENV, str(ranks or k))
    env.setdefault("OMP_NUM_THREADS", str(threads.share(local=int(env[threads.LOCAL_PROCESSES_ENV]))))
    mod = __package__ + ".launch"  # the package may be installed under another name
    # in a session of its own, like the nodes: the terminal's Ctrl-C must not end the store under them
    store = subprocess.Popen([sys.executable, "-m", mod, "--serve-store", endpoint, "--out", str(ready)], env=env,
                             start_new_session=True)
    deadline = time.time() + 60
    while not ready.exists():
        if store.poll() is not None or time.time() > deadline:
            say("error: the local rendezvous store did not start", err=True)
            store.kill()
            return EXIT_GAVE_UP
        time.sleep(0.05)
    ready.unlink()
    started = time.time()
    nodes: list[subprocess.Popen] = []
    received: list[int] = []

    def on_signal(signum: int, frame: Any) -> None:
        # Ctrl-C reaches this process only (the nodes run in sessions of their own): pass it on to
        # every node launcher, which stops the job after its step; a second one kills them all
        received.append(signum)
        if len(received) > 1:
            for p in nodes:
                _kill_tree(p.pid)
            store.kill()
            os.write(2, f"\naborted at once ({signal_name(signum)} again); the newest complete checkpoint stays "
                        "valid\n".encode())
            os._exit(128 + signum)
        for p in nodes:
            try:
                os.kill(p.pid, signum)
            except OSError:
                pass

    previous = {sig: signal.signal(sig, on_signal) for sig in STOP_SIGNALS}
    try:
        for i in range(k):
            nodes.append(subprocess.Popen([sys.executable, "-m", mod, "--node-label", f"node{i}", "--rdzv-endpoint",
                                           endpoint, *node_argv], env=env, start_new_session=True))
        end = None if timeout is None else time.time() + timeout
        for p in nodes:
            p.wait(timeout=None if end is None else max(1.0, end - time.time()))
    except subprocess.TimeoutExpired:
        for p in nodes:
            _kill_tree(p.pid)
        say(f"error: --timeout {timeout:.0f} s reached; the node launchers were killed", err=True)
        return EXIT_GAVE_UP
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)
        store.kill()  # it ignores SIGTERM
        store.wait(timeout=30)
    codes = [p.returncode for p in nodes]
    ev = [e for e in read_events(out) if float(e.get("time", 0)) >= started]
    finished = any(e["event"] == "finished" for e in ev)
    ends = [e for e in ev if e["event"] == "job_end"]
    # the job's end in the last line: the line of the node that ended it (each node printed it too)
    verdict = "finished" if finished else ends[-1]["line"] if ends else "not finished"
    say(f"[launch] nodes exited with {codes}; {verdict}")
    if finished:
        return 0
    if ends:
        return int(ends[-1]["code"])
    # a launcher's own verdict (fatal first) before a node killed by a signal
    return (next((c for c in codes if c in FATAL_EXIT_CODES), None) or next((c for c in codes if c and c > 0), None)
            or EXIT_GAVE_UP)


def descendants(pid: int) -> list[int]:
    """Every live descendant of ``pid`` (Linux /proc), children first."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        try:
            for task in os.listdir(f"/proc/{p}/task"):
                with open(f"/proc/{p}/task/{task}/children") as f:
                    kids = [int(x) for x in f.read().split()]
                out += kids
                todo += kids
        except OSError:
            continue
    return out


def _kill_tree(pid: int, sig: int = signal.SIGKILL) -> None:
    for p in [pid, *descendants(pid)]:
        try:
            os.kill(p, sig)
        except ProcessLookupError:
            pass


# ============================================================================ CLI
def _has_out(args: Sequence[str]) -> str | None:
    for i, a in enumerate(args):
        for flag in ("--out", "--logging.out"):
            if a == flag and i + 1 < len(args):
                return args[i + 1]
            if a.startswith(flag + "="):
                return a.split("=", 1)[1]
    return None


#: The trainer's own package, under whichever name it is installed (``--entry``'s default).
_TRAINER_ENTRY = __package__.split(".")[0]
#: Set for the node launchers ``--local-nodes`` starts: their parent checked the trainer's arguments.
_ARGS_CHECKED_ENV = "FASTMOE_LAUNCH_ARGS_CHECKED"


def check_trainer_args(trainer_args: Sequence[str], world: int) -> int | None:
    """Parse and validate the trainer's arguments for ``world`` ranks here, before any rendezvous, so
    that a bad preset, option, value or layout ends the launch at once with the trainer's one line
    (exit 2) instead of in every worker after the rendezvous. None when they pass; else the exit
    status (0 after the trainer's ``--help``)."""
    from ..cli import config_from_args
    from ..config import validate

    try:
        cfg, _ = config_from_args(list(trainer_args))
        validate(cfg, world)
    except SystemExit as e:  # argparse printed its own line (an unknown option) or the help
        return e.code if isinstance(e.code, int) else EXIT_CONFIG
    except ValueError as e:  # ConfigError, or a data set that cannot be read
        print(f"error: {' '.join(str(e).split())}", file=sys.stderr, flush=True)
        return EXIT_CONFIG
    return None


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="fastmoe-launch",
        description="Per-node launcher: torch's elastic agent with spares, blame and a watchdog (docs/fault.md).",
        epilog="Everything after -- goes to the trainer; the launcher appends the resume flag.",
    )
    ap.add_argument("--nnodes", default="1", help="N (fixed size; nodes started beyond N are spares)")
    ap.add_argument("--nproc-per-node", type=int, default=1, help="ranks per node")
    ap.add_argument("--rdzv-endpoint", default=None, help="HOST:PORT of the rendezvous store")
    ap.add_argument("--rdzv-id", default="trainer", help="job id shared by every node")
    ap.add_argument("--rdzv-conf", default="", help="key=value,... for the c10d rendezvous "
                    f"(defaults: {','.join(f'{k}={v}' for k, v in DEFAULT_RDZV_CONF.items())}; is_host=0|1)")
    ap.add_argument("--max-restarts", type=int, default=3, help="worker-group restarts per node before giving up")
    ap.add_argument("--node-label", default=None, help="this node's name in logs and records (default: host name)")
    ap.add_argument("--local-nodes", type=int, default=0, help="start K node launchers on this machine")
    ap.add_argument("--serve-store", default=None, metavar="HOST:PORT", help="only host the rendezvous store")
    ap.add_argument("--heartbeat-timeout", type=float, default=300.0,
                    help="seconds without progress before a rank's watchdog dumps stacks and exits 77")
    ap.add_argument("--startup-timeout", type=float, default=900.0, help="the same before the first step")
    ap.add_argument("--checkpoint-timeout", type=float, default=1800.0, help="the same while writing a checkpoint")
    ap.add_argument("--monitor-interval", type=float, default=0.5, help="seconds between the agent's polls")
    ap.add_argument("--kill-grace", type=float, default=DEFAULT_KILL_GRACE,
                    help="seconds between SIGTERM (and SIGCONT) and SIGKILL when workers are stopped")
    ap.add_argument("--quorum-timeout", type=float, default=DEFAULT_QUORUM_TIMEOUT,
                    help="once the job has started, seconds a new round waits for --nnodes nodes before the "
                         "job stops (exit 1, one line saying how many nodes it has and needs)")
    ap.add_argument("--timeout", type=float, default=None, help="--local-nodes: give up after this many seconds")
    ap.add_argument("--out", default=None, help="run directory (default: the trainer's --out)")
    # the trainer's own package, under whichever name it is installed
    ap.add_argument("--entry", default=_TRAINER_ENTRY,
                    help="python module (or .py script) to run on every rank (the trainer's arguments are checked "
                         "before the rendezvous when it is the trainer)")
    ap.add_argument("--resume-arg", default="--checkpoint.resume",
                    help="arguments appended to the trainer's so every start resumes from the newest checkpoint")
    ap.add_argument("trainer_args", nargs=argparse.REMAINDER, help="-- then the trainer's arguments")
    return ap


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    ap = build_parser()
    args = ap.parse_args(argv)
    if args.serve_store:
        return serve_store(args.serve_store, ready=Path(args.out) if args.out else None)
    rest = list(args.trainer_args)
    if rest and rest[0] == "--":
        rest = rest[1:]
    out = args.out or _has_out(rest)
    if out is None:
        ap.error("give --out (or --out in the trainer's arguments): nodes share records there")
    try:
        check_out_dir(out)  # before any rendezvous: a bad --out is not retried
        n_min, n_max = parse_nnodes(args.nnodes)
        conf = parse_rdzv_conf(args.rdzv_conf)
        if args.nproc_per_node < 1:
            raise ValueError(f"--nproc-per-node must be >= 1, got {args.nproc_per_node}")
        if args.max_restarts < 0:
            raise ValueError(f"--max-restarts must be >= 0, got {args.max_restarts}")
        if args.local_nodes < 0:
            raise ValueError(f"--local-nodes must be >= 0, got {args.local_nodes}")
        if args.rdzv_endpoint:
            parse_endpoint(args.rdzv_endpoint)
        for name in ("heartbeat_timeout", "startup_timeout", "checkpoint_timeout", "monitor_interval", "kill_grace",
                     "quorum_timeout"):
            if getattr(args, name) <= 0:
                raise ValueError(f"--{name.replace('_', '-')} must be > 0")
    except ValueError as e:
        say(f"error: {e}", err=True)
        return EXIT_CONFIG
    trainer_world = n_min * args.nproc_per_node
    if args.entry == _TRAINER_ENTRY and os.environ.get(_ARGS_CHECKED_ENV) != "1":
        code = check_trainer_args(rest, trainer_world)
        if code is not None:
            return code
    if args.local_nodes:
        if args.node_label or args.rdzv_endpoint:
            say("error: --local-nodes picks the node labels and the endpoint itself", err=True)
            return EXIT_CONFIG
        node_argv = _strip(argv, {"--local-nodes": 1, "--timeout": 1})
        if "--rdzv-conf" in node_argv:  # the store runs apart: no node may host it
            i = node_argv.index("--rdzv-conf")
            node_argv[i + 1] = "is_host=0," + node_argv[i + 1]
        else:
            node_argv = ["--rdzv-conf", "is_host=0", *node_argv]
        if _has_out(rest) is None and args.out is None:
            node_argv = ["--out", out, *node_argv]
        os.environ[_ARGS_CHECKED_ENV] = "1"  # the nodes' launchers inherit it: the arguments were checked here
        try:
            return run_local_nodes(args.local_nodes, node_argv, Path(out), timeout=args.timeout,
                                   ranks=min(args.local_nodes, n_max) * args.nproc_per_node)
        finally:
            os.environ.pop(_ARGS_CHECKED_ENV, None)
    if _has_out(rest) is None:
        rest += ["--out", out]
    entry = [args.entry] if args.entry.endswith(".py") else ["-m", args.entry]
    opts = NodeOptions(label=args.node_label or socket.gethostname(), out=Path(out),
                       command=[sys.executable, *entry, *rest, *args.resume_arg.split()], n_min=n_min, n_max=n_max,
                       nproc=args.nproc_per_node, endpoint=args.rdzv_endpoint or f"127.0.0.1:{DEFAULT_PORT}",
                       run_id=args.rdzv_id, max_restarts=args.max_restarts, rdzv_conf=conf,
                       heartbeat_timeout=args.heartbeat_timeout, checkpoint_timeout=args.checkpoint_timeout,
                       startup_timeout=args.startup_timeout, monitor_interval=args.monitor_interval,
                       kill_grace=args.kill_grace, quorum_timeout=args.quorum_timeout)
    return run_node(opts)


def _strip(argv: list[str], flags: dict[str, int]) -> list[str]:
    """``argv`` before ``--`` without ``flags`` (and their values); the rest unchanged."""
    out, i = [], 0
    while i < len(argv):
        a = argv[i]
        if a == "--":
            return out + argv[i:]
        name = a.split("=", 1)[0]
        if name in flags:
            i += 1 + (0 if "=" in a else flags[name])
            continue
        out.append(a)
        i += 1
    return out


if __name__ == "__main__":
    sys.exit(main())
