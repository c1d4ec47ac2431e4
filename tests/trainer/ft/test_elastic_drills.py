"""Fault drills under ``python -m trainer.ft.launch --local-nodes 3 --nnodes 2`` (torch's elastic agent,
c10d rendezvous, gloo, one rank per node, the stand-in trainer of _ft_toy.py): two nodes train, one
waits as a spare. A killed node, a killed rank, a NaN, a hang and a stopped rank each end with the
spare in the job (or the right node gone) and the exact state of an uninterrupted run, within one
rendezvous round per failure and a time bound; a job left with too few nodes, the rendezvous
store's death and bad input end with one clear line in bounded time. Select them with ``-m drill``.

The time bounds are behaviour, not speed goals: each is several times what the drill takes on a
busy 2-core machine, and far below what the failure modes they guard against take (a restart
storm never trains again, a stopped worker took 30 s to kill, a short-handed job waited 600 s)."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import _ft_toy as toy
from trainer.ft import fault
from trainer.checkpoint.slots import latest_valid
from trainer.ft.elastic.job import read_events
from trainer.ft.elastic.local_nodes import descendants, free_port

pytestmark = pytest.mark.drill

REPO = Path(__file__).resolve().parents[3]
STEPS, INTERVAL = 8, 2
LIMIT = 240.0  # seconds any drill may take before it counts as hung
RECOVERY_BOUND = 30.0  # seconds from a fault (or a hang's detection) to the first new step


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict[str, torch.Tensor]:
    out = tmp_path_factory.mktemp("reference")
    codes = toy.spawn(2, ["--out", str(out), "--steps", str(STEPS), "--interval", "0", "--dump", str(out / "dump")])
    assert codes == [0, 0], (out / "spawn-rank-0.log").read_text()[-2000:]
    return toy.assemble(toy.load_dumps(out / "dump"))


def _env(extra: dict[str, str] | None = None) -> dict[str, str]:
    return dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1", **(extra or {}))


def _launch(out: Path, *trainer: str, env: dict[str, str] | None = None, launcher: tuple[str, ...] = (),
            nodes: int = 3) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "trainer.ft.launch", "--local-nodes", str(nodes), "--nnodes", "2",
           "--max-restarts", "2", "--monitor-interval", "0.2", "--entry", str(REPO / "tests" / "_ft_toy.py"),
           "--timeout", str(LIMIT), "--out", str(out), *launcher, "--", "--steps", str(STEPS), "--interval",
           str(INTERVAL), "--dump", str(out / "dump"), *trainer]
    return subprocess.Popen(cmd, env=_env(env), cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)


def _finish(p: subprocess.Popen, timeout: float = LIMIT + 30) -> str:
    try:
        stdout, _ = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        _kill_tree(p.pid)
        stdout, _ = p.communicate()
        pytest.fail("the launcher did not finish in time:\n" + stdout[-4000:])
    assert p.returncode == 0, stdout[-6000:]
    return stdout


def _kill_tree(pid: int) -> None:
    for q in [pid, *descendants(pid)]:
        try:
            os.kill(q, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _assert_same(out: Path, reference: dict[str, torch.Tensor]) -> None:
    got = toy.assemble(toy.load_dumps(out / "dump"))
    assert got.keys() == reference.keys()
    for k, v in reference.items():
        assert torch.equal(got[k], v), k


def _active(ev: list[dict]) -> list[str]:
    return sorted({e["node"] for e in ev if e["event"] == "round"})


@pytest.mark.parametrize("writes", [(), ("--async",)], ids=["sync-checkpoints", "async-checkpoints"])
def test_kill9_of_a_node_tree_the_spare_takes_over(tmp_path: Path, reference, writes) -> None:
    """With ``--async`` the checkpoints are written in the background while the ranks train on: the
    node killed in step 3 may take a background write with it, and the job still resumes from a
    valid slot to the uninterrupted run's exact state."""
    out = tmp_path / "run"
    p = _launch(out, "--step-sleep", "0.3", *writes)
    end = time.time() + LIMIT
    while time.time() < end:  # rank 1 inside step 3 (after the step-2 checkpoint)
        b = fault.read_heartbeats(out).get(1)
        if b and b["phase"] == "start" and b["step"] >= INTERVAL + 1:
            break
        time.sleep(0.02)
    else:
        _kill_tree(p.pid)
        pytest.fail("rank 1 never reached step 3")
    victim = b["host"]
    (node_pid,) = [e["pid"] for e in read_events(out) if e["event"] == "node_start" and e["node"] == victim]
    killed_at = time.time()
    _kill_tree(node_pid)  # the node launcher, its agent's workers and anything they started
    first_new = _first_new_step(out, killed_at, end, p)
    _finish(p)
    ev = read_events(out)
    assert [e["node"] for e in ev if e["event"] == "finished"] and victim not in \
        [e["node"] for e in ev if e["event"] in ("finished", "round") and e["time"] > killed_at]
    spare = ({"node0", "node1", "node2"} - set(_active([e for e in ev if e["time"] < killed_at]))).pop()
    assert spare in _active([e for e in ev if e["time"] > killed_at])
    assert first_new is not None and first_new - killed_at < RECOVERY_BOUND, first_new
    assert _rounds_after(ev, killed_at) == 1, [e for e in ev if e["time"] > killed_at]
    print(f"kill -9 of {victim}: first new step {first_new - killed_at:.2f}s after the kill")
    _assert_same(out, reference)


def _rounds_after(ev: list[dict], t0: float) -> int:
    """Rendezvous rounds formed after ``t0``: round events of the same round come within a second."""
    times = sorted(e["time"] for e in ev if e["event"] == "round" and e["time"] > t0)
    return sum(1 for i, t in enumerate(times) if i == 0 or t - times[i - 1] > 1.0)


def _first_new_step(out: Path, since: float, end: float, p: subprocess.Popen) -> float | None:
    """Wait for the first step completed by a process started after ``since``."""
    while p.poll() is None and time.time() < end:
        first = fault.first_new_step(out, since)
        if first is not None:
            return first
        time.sleep(0.02)
    return None


def _beat_at(out: Path, rank: int, step: int, p: subprocess.Popen, end: float, phase: str = "start") -> dict:
    while time.time() < end and p.poll() is None:
        b = fault.read_heartbeats(out).get(rank)
        if b and b["phase"] == phase and b["step"] >= step:
            return b
        time.sleep(0.02)
    _kill_tree(p.pid)
    pytest.fail(f"rank {rank} never reached step {step} ({phase}):\n{p.communicate()[0][-3000:]}")


def _stop_rank(out: Path, b: dict, p: subprocess.Popen, end: float) -> tuple[float, float | None, list, dict]:
    """SIGSTOP of the worker of heartbeat ``b``, then the run to its end: (when it was stopped, the
    first new step, the events, the one hang record, which must name that rank's node)."""
    stopped_at = time.time()
    os.kill(b["pid"], signal.SIGSTOP)
    first_new = _first_new_step(out, stopped_at, end, p)
    _finish(p)
    hangs = [r for r in fault.read_failures(out) if r["kind"] == "hang"]
    assert [(r["rank"], r["host"]) for r in hangs] == [(b["rank"], b["host"])], hangs
    return stopped_at, first_new, read_events(out), hangs[0]


def test_rank_kill_one_round_and_a_late_spare_restarts_nobody(tmp_path: Path, reference) -> None:
    """Two nodes train; a spare that arrives while the group is complete waits without restarting
    anyone. Then ``kill -9`` of one rank (its node launcher alive): exactly one new rendezvous round
    (the node that loses the race for a slot waits as a spare; before, the agents restarted every
    couple of seconds, 6 to 68 rounds), the first new step within the bound, the exact end state."""
    out = tmp_path / "run"
    port = free_port()
    store = subprocess.Popen([sys.executable, "-m", "trainer.ft.launch", "--serve-store", f"127.0.0.1:{port}"],
                             env=_env(), cwd=REPO, stdout=subprocess.DEVNULL)
    args = ("--steps", str(STEPS), "--step-sleep", "0.5", "--dump", str(out / "dump"))
    try:
        nodes = {h: _node(out, h, f"127.0.0.1:{port}", "--rdzv-conf", "is_host=0", "--max-restarts", "2",
                          trainer=args) for h in ("h0", "h1")}
        end = time.time() + LIMIT
        while sum(e["event"] == "round" for e in read_events(out)) < 2:  # the group is complete
            assert time.time() < end and nodes["h0"].poll() is None, "no first round"
            time.sleep(0.05)
        nodes["h2"] = _node(out, "h2", f"127.0.0.1:{port}", "--rdzv-conf", "is_host=0", "--max-restarts", "2",
                            trainer=args)
        while not [e for e in read_events(out) if e["event"] == "node_start" and e["node"] == "h2"]:
            assert time.time() < end and nodes["h2"].poll() is None, "the spare never started"
            time.sleep(0.05)
        time.sleep(2.0)  # in the rendezvous by now (it joins within a second of starting)
        b = _beat_at(out, 1, INTERVAL + 1, nodes["h0"], end)
        assert b["step"] < STEPS - 1, "the run was nearly over before the spare arrived"
        assert not [e for e in read_events(out) if e["event"] in ("stop_workers", "failure")], \
            "a spare that arrived while the group was complete restarted it"
        killed_at = time.time()
        os.kill(b["pid"], signal.SIGKILL)
        first_new = _first_new_step(out, killed_at, end, nodes["h0"])
        codes = {h: _wait(q, LIMIT)[0] for h, q in nodes.items()}
    finally:
        store.kill()  # the store ignores SIGTERM (a scheduler's stop notice)
        store.wait(timeout=30)
    ev = read_events(out)
    assert sorted(codes.values()) == [0, 0, 0], codes
    assert first_new is not None and first_new - killed_at < RECOVERY_BOUND, first_new
    assert _rounds_after(ev, killed_at) == 1, [e for e in ev if e["time"] > killed_at]
    assert sum(e["event"] == "stop_workers" for e in ev) <= 2  # each active node restarted once
    print(f"kill -9 of rank 1: one round, first new step {first_new - killed_at:.2f}s after the kill")
    _assert_same(out, reference)


def test_a_stopped_rank_is_blamed_its_node_leaves_and_it_is_killed_at_once(tmp_path: Path, reference) -> None:
    """SIGSTOP of rank 1's worker: every rank of the job sits at the same step, so "who got least
    far" cannot tell; the stopped process alone sends no watchdog pulse. It is named (before, the
    healthy node was blamed in 3 runs of 4), its node leaves, the stopped worker is killed within
    the grace (SIGCONT + SIGTERM, then SIGKILL; before, 30 s), the spare joins, and the run ends
    with an uninterrupted run's exact state."""
    out = tmp_path / "run"
    p = _launch(out, "--step-sleep", "0.3", launcher=("--heartbeat-timeout", "4", "--kill-grace", "2"))
    end = time.time() + LIMIT
    b = _beat_at(out, 1, INTERVAL + 1, p, end)
    stopped_at, first_new, ev, hang = _stop_rank(out, b, p, end)
    assert "stopped answering" in hang["why"]
    assert [e["node"] for e in ev if e["event"] == "left"] == [b["host"]]
    left = [e for e in ev if e["event"] == "left"][0]
    assert left["stop_s"] < 2 + 1.5, left  # SIGSTOP'd worker gone within the grace
    with pytest.raises(ProcessLookupError):
        os.kill(b["pid"], 0)
    detected = hang["time"]
    assert first_new is not None and first_new - detected < RECOVERY_BOUND, (first_new, detected)
    assert _rounds_after(ev, stopped_at) == 1
    _assert_same(out, reference)


def test_a_rank_stopped_while_a_checkpoint_is_written_is_found_by_its_launcher(tmp_path: Path, reference) -> None:
    """SIGSTOP of rank 1's worker inside the checkpoint phase, where the watchdogs allow a write half
    an hour: its node launcher sees the process stopped for longer than the heartbeat timeout, records
    the hang on its node and leaves; the stopped worker is killed, the spare joins, and the run ends
    with an uninterrupted run's exact state, well inside the checkpoint limit."""
    out = tmp_path / "run"
    p = _launch(out, "--step-sleep", "0.1", "--checkpoint-sleep", "1.5",
                launcher=("--heartbeat-timeout", "3", "--kill-grace", "2"))
    end = time.time() + LIMIT
    b = _beat_at(out, 1, INTERVAL, p, end, phase="checkpoint")
    stopped_at, first_new, ev, hang = _stop_rank(out, b, p, end)
    assert hang["phase"] == "checkpoint" and "process stopped" in hang["why"], hang
    assert hang["time"] - stopped_at < 3 * 1.5 + 5, hang  # 1.5 x the heartbeat timeout, and the polls
    assert [e["node"] for e in ev if e["event"] == "left"] == [b["host"]]
    with pytest.raises(ProcessLookupError):
        os.kill(b["pid"], 0)
    assert first_new is not None and first_new - hang["time"] < RECOVERY_BOUND, (first_new, hang)
    _assert_same(out, reference)


def test_too_few_nodes_the_job_stops_with_one_line(tmp_path: Path) -> None:
    """Two nodes and no spare; ``kill -9`` of one node's tree. The survivor waits at most
    ``--quorum-timeout`` for a second node, then stops with one line saying it has 1 of the 2 nodes
    it needs, exit 1 (before, it waited out join_timeout, 600 s, silently)."""
    out = tmp_path / "run"
    p = _launch(out, "--step-sleep", "0.3", nodes=2, launcher=("--quorum-timeout", "4"))
    end = time.time() + LIMIT
    b = _beat_at(out, 1, INTERVAL + 1, p, end)
    (node_pid,) = [e["pid"] for e in read_events(out) if e["event"] == "node_start" and e["node"] == b["host"]]
    killed_at = time.time()
    _kill_tree(node_pid)
    code, stdout, took = _wait(p, 120)
    # the dead node's keep-alive expires (5 s), the survivor's round waits 4 s, plus start-up slack
    assert code == 1 and took < 5 + 4 + 25, (code, took, stdout[-3000:])
    errors = [ln for ln in stdout.splitlines() if ln.startswith("error:")]
    assert len(errors) == 1 and "has 1 of the 2 nodes it needs" in errors[0] and "--quorum-timeout" in errors[0], \
        stdout[-3000:]
    print(f"the survivor stopped {time.time() - killed_at:.1f}s after the kill: {errors[0]}")


def test_nan_on_one_node_the_node_leaves_and_the_spare_joins(tmp_path: Path, reference) -> None:
    out = tmp_path / "run"
    p = _launch(out, env={fault.NAN_ENV: f"step=5,rank=1,once={tmp_path / 'nan.fired'}"})
    _finish(p)
    ev = read_events(out)
    (rec,) = fault.read_failures(out)
    assert (rec["kind"], rec["rank"], rec["step"]) == ("nonfinite", 1, 5)
    leave = [e for e in ev if e["event"] == "leave"]
    assert [e["node"] for e in leave] == [rec["host"]]
    assert [e["node"] for e in ev if e["event"] == "left"] == [rec["host"]]
    first = _active([e for e in ev if e["time"] < leave[0]["time"]])
    after = _active([e for e in ev if e["time"] > leave[0]["time"]])
    assert rec["host"] in first and rec["host"] not in after and len(after) == 2 and set(after) - set(first)
    _assert_same(out, reference)  # the bad step changed no weight: the end equals an uninterrupted run


def test_hang_on_one_node_the_watchdog_fires_and_the_run_recovers(tmp_path: Path, reference) -> None:
    out = tmp_path / "run"
    t0 = time.time()
    p = _launch(out, env={fault.HANG_ENV: f"step=3,rank=0,once={tmp_path / 'hang.fired'}"},
                launcher=("--heartbeat-timeout", "3"))
    _finish(p)
    ev = read_events(out)
    hangs = [r for r in fault.read_failures(out) if r["kind"] == "hang"]
    assert hangs and {r["rank"] for r in hangs} == {0}
    culprit = hangs[0]["host"]
    assert [e["node"] for e in ev if e["event"] == "leave"] == [culprit]
    stacks = out / "stacks" / f"{culprit}-rank-00000.txt"
    text = stacks.read_text()
    assert "no progress for" in text and "maybe_hang" in text  # the hung frame is in the dump
    # fired within the timeout plus a poll, not at some later collective timeout (gloo's is 120 s)
    assert hangs[0]["seconds_silent"] < 3 + 1.0
    assert time.time() - t0 < LIMIT
    _assert_same(out, reference)


def _node(out: Path, label: str, endpoint: str, *extra: str, nnodes: str = "2",
          trainer: tuple[str, ...] = ("--steps", "40", "--step-sleep", "0.2")) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "trainer.ft.launch", "--node-label", label, "--rdzv-endpoint", endpoint, "--nnodes",
           nnodes, "--max-restarts", "1", "--monitor-interval", "0.2", "--entry",
           str(REPO / "tests" / "_ft_toy.py"), "--out", str(out), *extra, "--", "--interval", str(INTERVAL),
           *trainer]
    return subprocess.Popen(cmd, env=_env(), cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)


def _wait(p: subprocess.Popen, timeout: float) -> tuple[int, str, float]:
    t0 = time.time()
    try:
        stdout, _ = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        _kill_tree(p.pid)
        stdout, _ = p.communicate()
        pytest.fail(f"no exit within {timeout}s:\n{stdout[-3000:]}")
    return p.returncode, stdout, time.time() - t0


def test_death_of_the_node_hosting_the_store_ends_the_others_with_a_clear_error(tmp_path: Path) -> None:
    """Without --serve-store the first node hosts the rendezvous store (is_host=1); when it dies,
    the survivor cannot form a new round: it stops with one line naming the store and the remedy."""
    out = tmp_path / "run"
    endpoint = f"127.0.0.1:{free_port()}"
    conf = "read_timeout=10,keep_alive_interval=1,keep_alive_max_attempt=3"
    host = _node(out, "hostnode", endpoint, "--rdzv-conf", f"is_host=1,{conf}")
    time.sleep(1.0)
    other = _node(out, "other", endpoint, "--rdzv-conf", f"is_host=0,{conf}")
    end = time.time() + LIMIT
    while time.time() < end and not any(h["step"] >= 2 for h in fault.read_heartbeats(out).values()):
        time.sleep(0.05)
    _kill_tree(host.pid)
    host.communicate()
    code, stdout, took = _wait(other, 120)
    assert code != 0
    errors = [e for e in read_events(out) if e["event"] == "error" and e["node"] == "other"]
    assert errors and "--serve-store" in errors[0]["reason"] and endpoint in errors[0]["reason"], stdout[-3000:]
    # one line that starts with what happened; no worker stack (a peer's death makes gloo print one)
    lines = [ln for ln in stdout.splitlines() if ln.startswith("error:")]
    assert len(lines) == 1 and lines[0].startswith(f"error: lost the rendezvous store at {endpoint}"), stdout[-3000:]
    assert "Traceback" not in stdout and "See inner exception" not in stdout, stdout[-3000:]
    assert took < 30, took
    print(f"survivor stopped {took:.1f}s after the store's host died")


def test_unreachable_endpoint_is_a_clear_error_in_bounded_time(tmp_path: Path) -> None:
    endpoint = f"127.0.0.1:{free_port()}"  # nothing listens there
    p = _node(tmp_path / "run", "lonely", endpoint, "--rdzv-conf", "is_host=0,read_timeout=3")
    code, stdout, took = _wait(p, 60)
    assert code == 1 and f"cannot reach the rendezvous store at {endpoint}" in stdout, stdout[-3000:]
    assert took < 45


def test_mismatched_nnodes_is_a_clear_error(tmp_path: Path) -> None:
    out = tmp_path / "run"
    port = free_port()
    store = subprocess.Popen([sys.executable, "-m", "trainer.ft.launch", "--serve-store", f"127.0.0.1:{port}"],
                             env=_env(), cwd=REPO)
    try:
        time.sleep(2.0)
        first = _node(out, "a", f"127.0.0.1:{port}", "--rdzv-conf", "is_host=0")
        time.sleep(2.0)
        second = _node(out, "b", f"127.0.0.1:{port}", "--rdzv-conf", "is_host=0", nnodes="3")
        code, stdout, took = _wait(second, 60)
        assert code == 2 and "start every node with the same --nnodes" in stdout, stdout[-3000:]
        _kill_tree(first.pid)
        first.communicate()
    finally:
        store.kill()  # the store ignores SIGTERM (a scheduler's stop notice)
        store.wait(timeout=30)


# ============================================================================ stopping by signal
def _stop_lines(stdout: str) -> list[str]:
    return [ln for ln in stdout.splitlines() if ln.startswith("stopped at step")]


def _node_ends(out: Path, since: float) -> dict[str, dict]:
    """Each node launcher's last job event since ``since``: ``job_end`` (it ended the job) or
    ``job_ended`` (another node did; it took that node's line and code)."""
    ends = {}
    for e in read_events(out):
        if e["event"] in ("job_end", "job_ended") and e["time"] >= since:
            ends[e["node"]] = e
    return ends


def test_sigterm_to_one_launcher_then_ctrl_c_stop_at_a_step_and_the_job_resumes_exactly(tmp_path: Path,
                                                                                        reference) -> None:
    """A scheduler's SIGTERM to one node launcher (the one holding rank 0), then Ctrl-C (SIGINT to
    ``--local-nodes``, which passes it to every launcher): each time every rank finishes its step,
    one checkpoint of that step is written, every launcher (the spare too) ends with
    ``stopped at step N (SIG...); checkpoint at ...`` and exits 143 (130) within seconds; started
    again, the job resumes there and ends with an uninterrupted run's exact state. Before, the
    launchers exited 1, 1 and -15 within 0.5 s with the newest checkpoint some steps back."""
    out = tmp_path / "run"
    slow = ("--step-sleep", "0.8")
    stops = []
    for sig, target in ((signal.SIGTERM, "rank0-node"), (signal.SIGINT, "local-nodes")):
        p = _launch(out, *slow)
        start = time.time()
        end = start + LIMIT
        last = stops[-1] if stops else 0
        b = _beat_at(out, 0, last + 1, p, end)  # rank 0 inside a step after the resume
        if target == "rank0-node":
            (pid,) = [e["pid"] for e in read_events(out) if e["event"] == "node_start" and e["node"] == b["host"]
                      and e["time"] >= start]
            os.kill(pid, sig)
        else:
            os.kill(p.pid, sig)
        t0 = time.time()
        code, stdout, took = _wait(p, 120)
        assert code == 128 + sig, (code, stdout[-4000:])
        assert took < 30, took  # a scheduler's grace is 30 s or more (Slurm's KillWait default)
        lines = _stop_lines(stdout)
        assert len(lines) == 3, stdout[-4000:]  # one per node launcher
        assert len(set(lines)) == 1 and f"({sig.name})" in lines[0] and \
            lines[0].endswith("start the same job again to resume"), lines
        assert stdout.rstrip().splitlines()[-1].endswith(f"; {lines[0]}")  # --local-nodes: the same, last
        ends = _node_ends(out, start)
        assert sorted(ends) == ["node0", "node1", "node2"] and {e["code"] for e in ends.values()} == {128 + sig}, ends
        step = int(lines[0].split()[3])
        assert last < step < STEPS, (last, step)
        newest = latest_valid(out / "checkpoints")
        assert newest is not None and newest.step == step and str(newest.path) in lines[0], (newest, lines[0])
        assert not [e for e in read_events(out) if e["event"] in ("restart", "failure") and e["time"] >= t0]
        stops.append(step)
        print(f"{sig.name} to {target}: stopped at step {step}, every launcher out {took:.1f}s after the signal")
    _finish(_launch(out))
    _assert_same(out, reference)


def test_every_checkpoint_slot_damaged_stops_every_node_with_76_and_nothing_restarts(tmp_path: Path) -> None:
    """Checkpoints exist and none is valid: every rank exits 76, every node launcher (the spare
    too) ends with the trainer's reason naming each slot and exits 76; no node restarts its
    workers and the slots are left as they were."""
    out = tmp_path / "run"
    codes = toy.spawn(2, ["--out", str(out), "--steps", "4", "--interval", "2"])
    assert codes == [0, 0], (out / "spawn-rank-0.log").read_text()[-2000:]
    sizes = {}
    for slot in ("slot-A", "slot-B"):
        f = out / "checkpoints" / slot / "meta.json"
        f.write_text(f.read_text() + " ")  # fails its sha256 check
        sizes[slot] = f.stat().st_size  # the time and host in meta.json: its size varies
    before = {f: f.read_bytes() for f in (out / "checkpoints").rglob("*") if f.is_file()}
    t0 = time.time()
    p = _launch(out)
    code, stdout, took = _wait(p, LIMIT)
    assert code == fault.EXIT_CHECKPOINT_FAILURE, stdout[-4000:]
    lines = [ln for ln in stdout.splitlines() if ln.startswith("error: the job stopped (exit 76")]
    assert len(lines) == 3, stdout[-4000:]  # one per node launcher
    # each training node names its own failed rank; the reason is the trainer's, the same everywhere
    assert len({ln.split(" on node", 1)[1].split(": ", 1)[1] for ln in lines}) == 1, lines
    assert "none is valid" in lines[0], lines[0]
    for slot, n in sizes.items():
        assert f"{slot}/meta.json has {n} bytes, the manifest says {n - 1}" in lines[0], (slot, n, lines[0])
    last = stdout.rstrip().splitlines()[-1]
    assert any(last.endswith(f"; {ln}") for ln in lines), last  # --local-nodes: the same, last
    ends = _node_ends(out, t0)
    assert sorted(ends) == ["node0", "node1", "node2"] and {e["code"] for e in ends.values()} == {76}, ends
    ev = read_events(out)
    assert not [e for e in ev if e["event"] in ("restart", "finished", "released")], ev
    assert sum(e["event"] == "round" for e in ev) == 2  # the first round, never another
    assert {f: f.read_bytes() for f in (out / "checkpoints").rglob("*") if f.is_file()} == before


def test_waiting_for_nodes_is_said_every_10s_and_ends_at_the_join_timeout(tmp_path: Path) -> None:
    """One node of two: a line every 10 s while it waits, then at the join timeout one ``error:``
    line with the counts, exit 1 (before, nothing was printed for the 600 s)."""
    out = tmp_path / "run"
    p = _launch(out, nodes=1, launcher=("--rdzv-conf", "join_timeout=14"))
    code, stdout, took = _wait(p, 120)
    assert code == 1, stdout[-3000:]
    waiting = [ln for ln in stdout.splitlines() if "waiting for nodes: 1 of 2 joined" in ln]
    assert len(waiting) == 1 and "of the join timeout 14 s" in waiting[0], stdout[-3000:]
    errors = [ln for ln in stdout.splitlines() if ln.startswith("error:")]
    assert len(errors) == 1 and "has 1 of the 2 nodes it needs" in errors[0] and "join_timeout" in errors[0], \
        stdout[-3000:]
    assert took < 14 + 30, took


def test_nan_on_every_node_stops_the_job_with_the_step_and_ranks(tmp_path: Path) -> None:
    """Non-finite values on every rank at once are not a node's fault: instead of every node
    leaving in turn until the spares are used up, the job stops (exit 75 on every node, the spare
    too) with one line naming the step and the ranks; nothing restarts."""
    out = tmp_path / "run"
    t0 = time.time()
    p = _launch(out, env={fault.NAN_ENV: "step=3"})
    code, stdout, took = _wait(p, LIMIT)
    assert code == fault.EXIT_SOFT_FAILURE, stdout[-4000:]
    lines = [ln for ln in stdout.splitlines() if ln.startswith("error: the job stopped (exit 75)")]
    assert len(lines) == 3 and "non-finite loss and gradients at step 3 on every node (ranks 0-1)" in lines[0], \
        stdout[-4000:]
    ends = _node_ends(out, t0)
    assert sorted(ends) == ["node0", "node1", "node2"] and {e["code"] for e in ends.values()} == {75}, ends
    ev = read_events(out)
    assert not [e for e in ev if e["event"] in ("restart", "left", "finished")], ev
    assert sum(e["event"] == "round" for e in ev) == 2
