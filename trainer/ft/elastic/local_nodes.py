"""K node launchers on this machine sharing one rendezvous (``fastmoe-launch --local-nodes K``), and
the process helpers the fault drills and benchmarks use with them."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from ..stop import STOP_SIGNALS, SignalCount, signal_name
from .job import EXIT_GAVE_UP, FATAL_EXIT_CODES, read_events, say

def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]

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
    mod = __package__.rpartition(".")[0] + ".launch"  # the package may be installed under another name
    store: subprocess.Popen | None = None
    nodes: list[subprocess.Popen] = []
    received: list[int] = []  # the signal that stops the job
    count = SignalCount()

    def on_signal(signum: int, frame: Any) -> None:
        # Ctrl-C reaches this process only (the nodes run in sessions of their own): pass it on to
        # every node launcher, which stops the job after its step; a second one kills them all
        if count.again():
            for p in nodes:
                kill_tree(p.pid)
            if store is not None:
                store.kill()
            os.write(2, f"\naborted at once ({signal_name(signum)} again); the newest complete checkpoint stays "
                        "valid\n".encode())
            os._exit(128 + signum)
        if received:
            return  # an echo of the first: the nodes have it
        received.append(signum)
        for p in nodes:
            try:
                os.kill(p.pid, signum)
            except OSError:
                pass

    previous = {sig: signal.signal(sig, on_signal) for sig in STOP_SIGNALS}
    started = time.time()
    try:
        # in a session of its own, like the nodes: the terminal's Ctrl-C must not end the store under them
        store = subprocess.Popen([sys.executable, "-m", mod, "--serve-store", endpoint, "--out", str(ready)],
                                 env=env, start_new_session=True, preexec_fn=_die_with_parent(signal.SIGKILL))
        deadline = time.time() + 60
        while not ready.exists() and not received:
            if store.poll() is not None or time.time() > deadline:
                say("error: the local rendezvous store did not start", err=True)
                return EXIT_GAVE_UP
            time.sleep(0.05)
        for i in range(k):
            if received:  # the nodes started so far have it; the others are not needed
                break
            nodes.append(subprocess.Popen([sys.executable, "-m", mod, "--node-label", f"node{i}", "--rdzv-endpoint",
                                           endpoint, *node_argv], env=env, start_new_session=True,
                                          preexec_fn=_die_with_parent(signal.SIGTERM)))
        end = None if timeout is None else time.time() + timeout
        for p in nodes:
            p.wait(timeout=None if end is None else max(1.0, end - time.time()))
    except subprocess.TimeoutExpired:
        for p in nodes:
            kill_tree(p.pid)
        say(f"error: --timeout {timeout:.0f} s reached; the node launchers were killed", err=True)
        return EXIT_GAVE_UP
    finally:
        for p in nodes:  # none outlives this process, whatever ended it
            if p.poll() is None:
                kill_tree(p.pid)
                p.wait(timeout=30)
        if store is not None:
            store.kill()  # the nodes are gone: no grace needed
            store.wait(timeout=30)
        for sig, old in previous.items():
            signal.signal(sig, old)
        ready.unlink(missing_ok=True)
    if received and not nodes:  # stopped before any node started
        say(f"stopped ({signal_name(received[0])}) before the nodes started; nothing needed saving", err=True)
        return 128 + received[0]
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

def _die_with_parent(sig: int) -> Any:
    """A ``preexec_fn`` that has Linux send ``sig`` to the child when this process dies, even by
    SIGKILL (None elsewhere): no store or node launcher outlives the launcher that started it."""
    if not sys.platform.startswith("linux"):
        return None

    def arm() -> None:
        import ctypes

        try:
            ctypes.CDLL(None, use_errno=True).prctl(1, int(sig))  # PR_SET_PDEATHSIG
        except (OSError, AttributeError):
            pass
    return arm

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

def kill_tree(pid: int, sig: int = signal.SIGKILL) -> None:
    for p in [pid, *descendants(pid)]:
        try:
            os.kill(p, sig)
        except ProcessLookupError:
            pass
