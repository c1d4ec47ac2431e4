"""One node launcher: its agent run until the job finishes, this node leaves or the job gives up
(:func:`run_node`), and the rendezvous store in a process of its own (:func:`serve_store`)."""
from __future__ import annotations

import datetime
import json
import logging
import os
import signal
import socket
import threading
import time
from pathlib import Path
from typing import Any

from ..fault import HOST_ENV
from ..records import read_failures
from ..stop import LAUNCHER_ENV, STOP_SIGNALS, signal_name
from ..watchdog import CHECKPOINT_TIMEOUT_ENV, PARENT_ENV, STARTUP_TIMEOUT_ENV, TIMEOUT_ENV
from .agent import RoundGuard, agent_kwargs, cause, make_agent_class
from .job import (EXIT_CONFIG, EXIT_GAVE_UP, Events, JobEnded, JobState, NodeOptions, QuorumLost, StoppedWaiting,
                  StoreLost, describe_failure, parse_endpoint, say)

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
    def connect() -> tuple[Any, Any]:
        handler = rdzv_registry.get_rendezvous_handler(params)
        # every node must describe the same job: the first one's settings are kept in the store
        return handler, TCPStore(host, port, is_master=False, timeout=datetime.timedelta(seconds=read_timeout),
                                 wait_for_workers=False)

    try:
        handler, store = _interruptible(connect)
        mine = json.dumps({"nnodes": f"{opts.n_min}:{opts.n_max}", "nproc_per_node": opts.nproc})
        theirs = store.compare_set(f"trainer.launch/{opts.run_id}/config", "", mine).decode()
        if theirs != mine:
            msg = (f"node {opts.label} was started with {mine} but the job {opts.run_id!r} runs with {theirs}; "
                   "start every node with the same --nnodes and --nproc-per-node")
            events.log("error", reason=msg)
            say(f"error: {msg}", err=True)
            return EXIT_CONFIG
    except _StoppedConnecting as e:  # nothing runs here yet: nothing to save
        line = (f"stopped ({signal_name(e.signum)}) while this node connected to the rendezvous store at "
                f"{opts.endpoint}; nothing needed saving")
        events.log("stopped", signal=signal_name(e.signum), line=line)
        say(line, err=True)
        return 128 + e.signum
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
    agent_cls = make_agent_class()
    guard.label, guard.join_timeout = opts.label, float(opts.rdzv_conf.get("join_timeout", 600))
    job = guard.job = JobState(store, opts, events)
    agent = agent_cls(spec, logs_specs=logs, start_method="spawn", opts=opts, events=events, guard=guard, job=job,
                      **agent_kwargs(agent_cls.__mro__[1], opts.kill_grace))
    _quiet_torch_while_stopping(opts.out / "logs" / opts.label / "torch-elastic.log", agent._stopping)
    job.install()
    try:
        result = agent.run()
    except JobEnded as e:  # another node ended the job while this one waited for a round
        return _ended_by_other(events, e.record)
    except StoppedWaiting:  # Ctrl-C or SIGTERM (here or on another node) while this node waited for one
        return _stopped_waiting(events, job, handler)
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
            msg = (f"lost the rendezvous store at {opts.endpoint} ({cause(e)}); its host died or cannot be "
                   "reached. Restart the job: it resumes from the newest valid checkpoint; run the store with "
                   "--serve-store on a node that does not train to survive a training node's loss")
        else:
            msg = f"{type(e).__name__}: {' '.join(str(e).split())[:500]}"
        return _fail(events, msg, None)
    if result is None:  # a spare never needed, or the job closed while this node waited
        if job.signum is not None:  # a stop with nobody training (no worker said at which step)
            return _stopped_waiting(events, job, handler)
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

class _StoppedConnecting(Exception):
    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum

def _interruptible(fn: Any) -> Any:
    """``fn()`` in a helper thread, so that SIGINT or SIGTERM ends the wait at once
    (:class:`_StoppedConnecting`): torch's store client connects in C++, where a signal's Python
    handler would run only after its timeout (``read_timeout``, 60 s by default)."""
    box: dict[str, Any] = {}
    got: list[int] = []

    def run() -> None:
        try:
            box["value"] = fn()
        except BaseException as e:  # noqa: BLE001 - raised in the caller's thread below
            box["error"] = e

    previous = {sig: signal.signal(sig, lambda signum, frame: got.append(signum)) for sig in STOP_SIGNALS}
    try:
        thread = threading.Thread(target=run, name="connect", daemon=True)
        thread.start()
        while thread.is_alive() and not got:
            thread.join(0.1)
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)
    if got:
        raise _StoppedConnecting(got[0])
    if "error" in box:
        raise box["error"]
    return box["value"]

class _TorchLogFilter(logging.Filter):
    """torch elastic's own lines ("failed (exitcode: 143) ...") always go to the node's log file, and
    to the console only while the job is not stopping as asked (there they read like a crash)."""

    def __init__(self, path: Path, stopping: Any) -> None:
        super().__init__()
        self.path, self.stopping = path, stopping
        self.format = logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s").format

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with open(self.path, "a", encoding="utf-8") as f:
                f.write(self.format(record) + "\n")
        except OSError:
            pass
        try:
            return not self.stopping()
        except Exception:  # noqa: BLE001 - the agent half torn down: the line goes out as torch meant
            return True

def _quiet_torch_while_stopping(path: Path, stopping: Any) -> None:
    flt = _TorchLogFilter(path, stopping)
    for name in [n for n in list(logging.root.manager.loggerDict) if n.startswith("torch.distributed.elastic")]:
        logger = logging.getLogger(name)
        for old in [f for f in logger.filters if isinstance(f, _TorchLogFilter)]:
            logger.removeFilter(old)
        logger.addFilter(flt)

def _end(events: Events, code: int, line: str, job: JobState, handler: Any) -> int:
    """This node ends the job: the record first (a node that finds the rendezvous closed reads it),
    then the rendezvous closed (spares and stragglers stop waiting), then the line, last."""
    job.end_job(code, line)
    _close(handler)
    say(line, err=True)
    return code

def _stopped_waiting(events: Events, job: JobState, handler: Any) -> int:
    """A stop by signal with no worker training on this node: nothing to save here."""
    line = (f"stopped ({signal_name(job.signum)}) while this node waited for a round; nothing needed saving "
            "(the newest checkpoint, if any, stays); start the same job again to resume")
    return _end(events, 128 + job.signum, line, job, handler)

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
            parts.append(f"{r.get('host')} left after {describe_failure(r)}")
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

#: Seconds the rendezvous store serves after SIGTERM before it exits.
STORE_TERM_GRACE = 5.0

def serve_store(endpoint: str, *, ready: Path | None = None) -> int:
    """Host the rendezvous store until SIGINT or SIGTERM (a node that does not train, or --local-nodes)."""
    from torch.distributed import TCPStore

    host, port = parse_endpoint(endpoint)
    store = TCPStore("0.0.0.0" if host not in ("127.0.0.1", "localhost") else host, port, is_master=True,
                     wait_for_workers=False, multi_tenant=True, use_libuv=True)
    say(f"[launch store] serving the rendezvous store on {host}:{store.port}")
    if ready is not None:
        ready.write_text(str(store.port))
    # SIGTERM (a scheduler's stop notice to every process of the job, or the launcher that started
    # it): the node launchers may still use the store while their workers stop after their step, so
    # it serves STORE_TERM_GRACE s more and exits; a second signal or SIGINT ends it at once
    termed: list[float] = []
    signal.signal(signal.SIGTERM, lambda signum, frame: termed.append(time.monotonic()))
    try:
        while not termed or (len(termed) == 1 and time.monotonic() - termed[0] < STORE_TERM_GRACE):
            time.sleep(0.1)
    except KeyboardInterrupt:
        pass
    say(f"[launch store] stopped ({'SIGTERM' if termed else 'SIGINT'})")
    return 0
