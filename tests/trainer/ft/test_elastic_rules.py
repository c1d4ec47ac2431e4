"""The node launcher's decisions with tiny stand-in workers (one node, no training): fatal exit codes
stop the job without a restart, ordinary failures restart until the limit, and bad input is one
line and exit 2 before any rendezvous."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from trainer.ft import fault
from trainer.ft.elastic.job import read_events
from trainer.ft.launch import main as launch_main, parse_nnodes, parse_rdzv_conf

REPO = Path(__file__).resolve().parents[3]


def _run(tmp_path: Path, code: str, *launcher: str) -> tuple[int, list[dict]]:
    script = tmp_path / "worker.py"
    script.write_text(code)
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "trainer.ft.launch", "--local-nodes", "1", "--nnodes", "1", "--monitor-interval", "0.2",
           "--entry", str(script), "--timeout", "120", "--out", str(out), *launcher, "--"]
    p = subprocess.run(cmd, env=dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1"), cwd=REPO,
                       capture_output=True, text=True, timeout=180)
    return p.returncode, read_events(out)


def test_fatal_exit_codes_are_not_retried(tmp_path: Path) -> None:
    code, ev = _run(tmp_path, f"import sys; sys.exit({fault.EXIT_CHECKPOINT_FAILURE})", "--max-restarts", "3")
    assert code == fault.EXIT_CHECKPOINT_FAILURE
    kinds = [e["event"] for e in ev]
    assert kinds == ["node_start", "round", "failure", "give_up", "job_end"], kinds
    assert "not retried" in ev[-2]["reason"]
    assert ev[-1]["code"] == fault.EXIT_CHECKPOINT_FAILURE and ev[-1]["line"].startswith("error: the job stopped (exit 76")


def test_restart_limit(tmp_path: Path) -> None:
    code, ev = _run(tmp_path, "import sys; sys.exit(3)", "--max-restarts", "1")
    assert code == 1
    kinds = [e["event"] for e in ev]
    assert kinds.count("round") == 2 and kinds.count("failure") == 2 and kinds.count("restart") == 1, kinds
    assert kinds[-2:] == ["give_up", "job_end"] and "restart limit 1 reached" in ev[-2]["reason"]
    assert ev[-1]["code"] == 1 and "restart limit 1 reached" in ev[-1]["line"] and "exit 3" in ev[-1]["line"], ev[-1]


def test_a_worker_whose_agent_dies_exits(tmp_path: Path) -> None:
    """The watchdog ends a worker orphaned by its agent (torch starts workers in their own session)."""
    child = tmp_path / "child.py"
    child.write_text(
        "import os, sys, time; sys.path.insert(0, %r)\n"
        "os.environ.update(TRAINER_HEARTBEAT_TIMEOUT='60', TRAINER_WATCH_PARENT='1')\n"
        "from trainer.ft.fault import Heartbeat\nhb = Heartbeat(%r, 0)\nprint('ready', flush=True)\ntime.sleep(60)\n"
        % (str(REPO), str(tmp_path)))
    parent = subprocess.Popen([sys.executable, "-c",
                               "import subprocess, sys, time; p = subprocess.Popen([sys.executable, %r], "
                               "start_new_session=True, stdout=sys.stdout); print(p.pid, flush=True); time.sleep(60)"
                               % str(child)], stdout=subprocess.PIPE, text=True)
    pid = int(parent.stdout.readline())
    assert parent.stdout.readline().strip() == "ready"
    parent.kill()
    parent.wait()
    import time
    for _ in range(100):
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            break
        time.sleep(0.1)
    else:
        os.kill(pid, 9)
        pytest.fail("the orphaned worker kept running")


@pytest.mark.parametrize("text,ok", [("2", (2, 2)), ("3:3", (3, 3)), ("1:2", None), ("x", None), ("0", None)])
def test_parse_nnodes(text: str, ok) -> None:
    if ok is None:
        with pytest.raises(ValueError):
            parse_nnodes(text)
    else:
        assert parse_nnodes(text) == ok


def test_parse_rdzv_conf() -> None:
    conf = parse_rdzv_conf("join_timeout=30, is_host=0")
    assert conf["join_timeout"] == "30" and conf["is_host"] == "0" and conf["keep_alive_interval"] == "1"
    with pytest.raises(ValueError):
        parse_rdzv_conf("join_timeout")


def test_launcher_cli_errors(tmp_path: Path, capsys) -> None:
    assert launch_main(["--nnodes", "1:2", "--out", str(tmp_path), "--"]) == 2
    assert "fixed size" in capsys.readouterr().err
    f = tmp_path / "file"
    f.write_text("")
    assert launch_main(["--out", str(f / "sub"), "--"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and str(f / "sub") in err and "regular file" in err
    with pytest.raises(SystemExit):
        launch_main(["--nnodes", "1", "--"])  # no --out anywhere


@pytest.mark.parametrize("trainer_args, says", [
    (["--preset", "nope"], "error: unknown preset 'nope'"),
    (["--ep", "3"], "error: num_experts=8 is not divisible by EP=3"),
    (["--stepz", "3"], "error: unrecognized arguments: --stepz 3 (did you mean --steps?)"),
    (["--dp", "3"], "error: world size 2 != PP x DP x EP = 1 x 3 x 1"),  # checked for --nnodes x --nproc-per-node
])
def test_bad_trainer_arguments_fail_before_the_rendezvous(tmp_path: Path, capsys, trainer_args, says) -> None:
    from trainer.ft.launch import check_trainer_args

    out = tmp_path / "out"
    # an endpoint nobody serves: reaching the rendezvous would wait there and fail otherwise
    argv = ["--nnodes", "1", "--nproc-per-node", "2", "--rdzv-endpoint", "127.0.0.1:9", "--rdzv-conf",
            "read_timeout=60", "--out", str(out), "--", *trainer_args]
    assert launch_main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith(says), err
    assert read_events(out) == []  # no node started its agent
    assert check_trainer_args(["--preset", "tiny-moe", "--ep", "2"], 2) is None  # a good layout passes


# ============================================================================ hang blame (no processes)
def test_culprit_least_progress_first() -> None:
    from trainer.ft.watchdog import culprit

    beats = {0: {"step": 4, "phase": "start", "mtime": 10.0, "pid": 1},
             1: {"step": 3, "phase": "done", "mtime": 20.0, "pid": 2}}
    rank, why = culprit(beats, 2, pulses={}, now=30.0)
    assert rank == 1 and "least progress" in why
    assert culprit({0: beats[0]}, 2, pulses={})[0] == 1  # no heartbeat at all: nowhere


def test_culprit_same_progress_the_stopped_rank_not_the_oldest_heartbeat() -> None:
    """Every rank at the same step and phase (a SIGSTOP inside a step): the rank whose process stopped
    answering is blamed even when its heartbeat is the newest; then one working while others wait
    in a collective; without pulses, the oldest heartbeat (the rule that blamed a healthy node)."""
    from trainer.ft.watchdog import culprit

    now = 100.0
    beats = {r: {"step": 3, "phase": "start", "mtime": 50.0 + r, "pid": 10 + r} for r in range(4)}
    waiting = {r: {"rank": r, "pid": 10 + r, "time": now - 0.5, "interval": 1.0, "waiting": True} for r in range(4)}
    assert culprit(beats, 4, pulses=None, now=now)[0] == 0  # the old rule: silent longest
    stopped = {r: p for r, p in waiting.items() if r != 3}
    rank, why = culprit(beats, 4, pulses=stopped, now=now)
    assert rank == 3 and "stopped answering" in why
    stale = {**waiting, 2: dict(waiting[2], time=now - 10.0)}  # pulses stopped 10 s ago
    assert culprit(beats, 4, pulses=stale, now=now)[0] == 2
    other_pid = {**waiting, 1: dict(waiting[1], pid=99)}  # a pulse of the rank's previous process
    assert culprit(beats, 4, pulses=other_pid, now=now)[0] == 1
    working = {**waiting, 2: dict(waiting[2], waiting=False)}
    rank, why = culprit(beats, 4, pulses=working, now=now)
    assert rank == 2 and "not inside torch.distributed" in why
    # progress still comes first: a rank one step behind is blamed over a stopped one
    behind = {**beats, 1: dict(beats[1], step=2)}
    assert culprit(behind, 4, pulses=stopped, now=now)[0] == 1


def test_in_distributed_reads_the_stack() -> None:
    import sys as _sys

    from trainer.ft.watchdog import _in_distributed

    ns: dict = {}
    exec(compile("import sys\ndef here():\n    return sys._getframe()\ndef call(f):\n    return f()\n",
                 "/site-packages/torch/distributed/distributed_c10d.py", "exec"), ns)
    assert _in_distributed(ns["here"]())
    assert _in_distributed(ns["call"](lambda: _sys._getframe()))  # called from inside torch.distributed
    assert not _in_distributed(_sys._getframe())


def test_watchdog_pulses_only_while_silent(tmp_path: Path) -> None:
    from trainer.ft.watchdog import Watchdog, read_pulses

    wd = Watchdog(tmp_path, 0, 1, "hx", timeout=2.0, poll=0.05)  # pulses after 0.5 s without progress
    try:
        wd.progress(1, "start")
        assert read_pulses(tmp_path) == {}
        import time as _time
        _time.sleep(1.0)
        pulse = read_pulses(tmp_path)[0]
        assert (pulse["step"], pulse["phase"], pulse["pid"], pulse["waiting"]) == (1, "start", os.getpid(), False)
    finally:
        wd.stop()


# ============================================================================ the rendezvous corrections
class _Holder:
    def __init__(self, state) -> None:
        self.state = state

    def sync(self):
        return None


def _rdzv(participants: int, waiting: int = 0, spares: int = 0, *, complete: bool, round_: int = 1):
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import _NodeDesc, _RendezvousState

    st = _RendezvousState()
    st.round, st.complete = round_, complete
    nodes = [_NodeDesc(f"n{i}", i, 0) for i in range(participants + waiting + spares)]
    for i, n in enumerate(nodes[:participants]):
        st.participants[n] = i
    st.wait_list.update(nodes[participants:participants + waiting])
    st.redundancy_list.update(nodes[participants + waiting:])
    return st, nodes


def _guard(st, quorum: float = 60.0):
    import threading as _threading
    from types import SimpleNamespace

    from trainer.ft.elastic.agent import RoundGuard

    handler = SimpleNamespace(_op_executor=SimpleNamespace(run=None), _state_holder=_Holder(st),
                              _heartbeat_lock=_threading.Lock(), num_nodes_waiting=lambda: -1)
    g = RoundGuard(handler, n_nodes=2, quorum_timeout=quorum)
    assert g.installed
    return g, handler


def _ctx(node, st):
    from datetime import timedelta

    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import (
        RendezvousSettings, RendezvousTimeout, _RendezvousContext,
    )

    settings = RendezvousSettings("job", 2, 2, RendezvousTimeout(join=timedelta(seconds=600)),
                                  keep_alive_interval=timedelta(seconds=1), keep_alive_max_attempt=5)
    return _RendezvousContext(node, st, settings)


def test_a_node_that_lost_the_race_waits_as_a_spare_and_counts_as_nobody_waiting() -> None:
    """The restart storm: a round completed with 2 of 3 nodes; the third, left on torch's wait list,
    made every agent restart its workers. Now it moves to the redundancy list, and while the
    group is complete and full no node counts as waiting."""
    import time as _time

    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import _Action, _RendezvousJoinOp

    from trainer.ft.elastic.agent import _JoinOp

    st, nodes = _rdzv(2, waiting=1, complete=True)
    g, handler = _guard(st)
    assert handler.num_nodes_waiting() == 0  # torch's count would be 1: a restart every round
    op = _JoinOp(_RendezvousJoinOp(), g)
    late = nodes[2]
    assert op(_ctx(late, st), _time.monotonic() + 600) == _Action.REMOVE_FROM_WAIT_LIST
    st.wait_list.discard(late)
    assert op(_ctx(late, st), _time.monotonic() + 600) == _Action.ADD_TO_REDUNDANCY_LIST
    # a free slot (a participant left): waiting nodes count, and a spare leaves the redundancy list
    st2, nodes2 = _rdzv(1, waiting=1, spares=1, complete=True)
    g2, handler2 = _guard(st2)
    assert handler2.num_nodes_waiting() == 1
    assert _JoinOp(_RendezvousJoinOp(), g2)(_ctx(nodes2[2], st2), _time.monotonic() + 600) == \
        _Action.REMOVE_FROM_REDUNDANCY_LIST


def test_quorum_deadline_applies_after_the_job_started_only() -> None:
    import time as _time

    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import _Action, _RendezvousJoinOp

    from trainer.ft.elastic.agent import _JoinOp

    far = _time.monotonic() + 600
    # round 1, one participant of two, the quorum time spent: torch's timeout path (leave, then error)
    st, nodes = _rdzv(1, complete=False, round_=1)
    g, _ = _guard(st, quorum=0.2)
    op = _JoinOp(_RendezvousJoinOp(), g)
    assert op(_ctx(nodes[0], st), far) in (_Action.KEEP_ALIVE, _Action.SYNC)  # starts the clock
    _time.sleep(0.3)
    assert op(_ctx(nodes[0], st), far) == _Action.REMOVE_FROM_PARTICIPANTS
    assert g.quorum_expired == (1, 0.2)
    # the job's first round waits join_timeout (nodes of a large job start over minutes)
    st0, nodes0 = _rdzv(1, complete=False, round_=0)
    g0, _ = _guard(st0, quorum=0.0)
    op0 = _JoinOp(_RendezvousJoinOp(), g0)
    for _ in range(2):
        assert op0(_ctx(nodes0[0], st0), far) in (_Action.KEEP_ALIVE, _Action.SYNC)
    assert g0.quorum_expired is None
    # a spare waits while the group is full, however long
    sts, nodess = _rdzv(2, spares=1, complete=True, round_=3)
    gs, _ = _guard(sts, quorum=0.0)
    ops = _JoinOp(_RendezvousJoinOp(), gs)
    for _ in range(2):
        assert ops(_ctx(nodess[2], sts), far) in (_Action.KEEP_ALIVE, _Action.SYNC)
    assert gs.quorum_expired is None


def test_agent_kwargs_follow_the_signature() -> None:
    """torch 2.11's LocalElasticAgent has no shutdown_timeout; 2.13's has: a feature check."""
    from trainer.ft.elastic.agent import agent_kwargs

    class Old:
        def __init__(self, spec, logs_specs, start_method="spawn", exit_barrier_timeout=300.0) -> None: ...

    class New:
        def __init__(self, spec, logs_specs, start_method="spawn", exit_barrier_timeout=300.0,
                     shutdown_timeout=30) -> None: ...

    assert "shutdown_timeout" not in agent_kwargs(Old, 2.0)
    assert agent_kwargs(New, 2.0)["shutdown_timeout"] == 2.0
    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent

    import inspect
    assert ("shutdown_timeout" in agent_kwargs(LocalElasticAgent, 2.0)) == \
        ("shutdown_timeout" in inspect.signature(LocalElasticAgent.__init__).parameters)


def test_a_second_signal_to_a_launcher_aborts_at_once(tmp_path: Path) -> None:
    """A worker that does not stop after the first SIGTERM (this one ignores the launcher's SIGUSR1):
    the second SIGTERM to its node launcher kills it and exits 143 at once, with one line."""
    import signal
    import time

    script = tmp_path / "worker.py"
    pidfile = tmp_path / "worker.pid"
    script.write_text("import os, signal, time\nsignal.signal(signal.SIGUSR1, signal.SIG_IGN)\n"
                      f"open({str(pidfile)!r}, 'w').write(str(os.getpid()))\ntime.sleep(120)\n")
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "trainer.ft.launch", "--local-nodes", "1", "--nnodes", "1", "--monitor-interval", "0.2",
           "--entry", str(script), "--timeout", "120", "--out", str(out), "--"]
    p = subprocess.Popen(cmd, env=dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1"), cwd=REPO,
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        end = time.time() + 90
        while not pidfile.exists() or not pidfile.read_text():
            assert time.time() < end and p.poll() is None, "the worker never started"
            time.sleep(0.1)
        worker = int(pidfile.read_text())
        (node,) = [e["pid"] for e in read_events(out) if e["event"] == "node_start"]
        os.kill(node, signal.SIGTERM)
        time.sleep(1.5)
        assert p.poll() is None  # waiting for its worker to stop after its step
        t0 = time.time()
        os.kill(node, signal.SIGTERM)
        stdout, _ = p.communicate(timeout=30)
        took = time.time() - t0
    finally:
        if p.poll() is None:
            p.kill()
    assert took < 5, took
    assert "aborted at once (SIGTERM again); the newest complete checkpoint stays valid" in stdout, stdout[-3000:]
    try:  # gone, or a zombie whose parent (the launcher) died before reaping it
        with open(f"/proc/{worker}/stat") as f:
            assert f.read().rsplit(")", 1)[1].split()[0] == "Z", "the worker outlived its launcher's abort"
    except FileNotFoundError:
        pass
    assert [e["event"] for e in read_events(out)][-1] == "aborted"


def test_process_stopped_reads_the_process_state() -> None:
    """The launcher's stopped-worker check: a SIGSTOP'd process reads as stopped, running or gone as not."""
    from trainer.ft.elastic.agent import process_stopped

    if not Path("/proc/self/stat").exists():
        pytest.skip("needs /proc/<pid>/stat")
    p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        assert not process_stopped(p.pid)
        os.kill(p.pid, signal.SIGSTOP)
        deadline = time.time() + 10
        while not process_stopped(p.pid):
            assert time.time() < deadline, "SIGSTOP never showed in /proc"
            time.sleep(0.01)
        os.kill(p.pid, signal.SIGCONT)
        deadline = time.time() + 10
        while process_stopped(p.pid):
            assert time.time() < deadline, "SIGCONT never showed in /proc"
            time.sleep(0.01)
    finally:
        p.kill()
        p.wait(timeout=30)
    assert not process_stopped(p.pid)  # gone


def test_one_hang_record_per_stall(tmp_path: Path) -> None:
    """A rank's watchdog and a node launcher that find the same stall write one record between them:
    the later finder gets the earlier record back."""
    from trainer.ft.records import read_failures, record_hang

    t0 = time.time()
    first = record_hang(tmp_path, {"time": t0 + 1, "kind": "hang", "host": "n1", "why": "watchdog"}, t0)
    again = record_hang(tmp_path, {"time": t0 + 2, "kind": "hang", "host": "n1", "why": "launcher"}, t0)
    assert again == first and [r["why"] for r in read_failures(tmp_path)] == ["watchdog"]
    later = record_hang(tmp_path, {"time": t0 + 10, "kind": "hang", "host": "n0", "why": "next stall"}, t0 + 5)
    assert later["why"] == "next stall" and len(read_failures(tmp_path)) == 2
