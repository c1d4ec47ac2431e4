"""torch's elastic agent with what the launcher adds: the rendezvous corrections for a fixed-size
job with spares (:class:`RoundGuard`), the node agent (blame, fatal codes, events), and workers
closed within ``--kill-grace`` s."""
from __future__ import annotations

import os
import signal
import time
from typing import Any, Sequence

from ..fault import EXIT_SOFT_FAILURE
from ..records import read_failures, read_heartbeats, record_hang
from ..stop import signal_name
from ..watchdog import EXIT_HANG
from .job import (EXIT_GAVE_UP, FATAL_EXIT_CODES, STOP_EXIT_CODES, STOPPED_LINE, WAIT_REPORT_S, Events, JobState,
                  StoppedWaiting,
                  NodeOptions, StoreLost, describe_failure, say)

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
            if g.job.signum is not None and not st.complete:
                # a stop by signal here or on another node while no round trains: nothing to wait for (a
                # spare of a training group waits for its end, and prints its line)
                raise StoppedWaiting(g.job.signum)
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

def make_agent_class():
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
                raise StoreLost(cause(gone)) from gone
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
                m = STOPPED_LINE.search(_tail(path))
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
            self.last_line = (f"left the job (exit {self.exit_code}): {describe_failure(records[-1])}; a spare "
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

def cause(e: BaseException) -> str:
    """The innermost cause of ``e`` in a few words (torch wraps the store's error in its own)."""
    seen = e
    while seen.__cause__ is not None or (seen.__context__ is not None and not seen.__suppress_context__):
        seen = seen.__cause__ or seen.__context__
    text = " ".join(str(seen).split())
    text = text.split(". See inner exception")[0][:160]
    return f"{type(seen).__name__}: {text}" if text else type(seen).__name__
