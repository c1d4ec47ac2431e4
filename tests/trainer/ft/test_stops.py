"""Stops with real processes: the node launcher that waits for nodes, the rendezvous store, and the
signal's name under ``fastmoe-train --nproc-per-node``. Every wait is bounded: a failure is an
error, not a hang."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from trainer.ft.elastic.job import read_events
from trainer.ft.elastic.local_nodes import descendants, free_port, kill_tree

REPO = Path(__file__).resolve().parents[3]
ENV = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie, exited and not yet reaped, does not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[-1].split()[0] != "Z"
    except OSError:
        return False


class _Lines:
    """A process's stdout, read line by line in a thread (so that waiting for a line has a deadline)."""

    def __init__(self, proc: subprocess.Popen) -> None:
        self.lines: list[str] = []
        self.thread = threading.Thread(target=lambda: self.lines.extend(iter(proc.stdout.readline, "")), daemon=True)
        self.thread.start()

    def wait_for(self, text: str, proc: subprocess.Popen, timeout: float) -> None:
        end = time.monotonic() + timeout
        while not any(text in line for line in self.lines):
            assert proc.poll() is None, f"exited with {proc.returncode} before {text!r}:\n{''.join(self.lines)}"
            assert time.monotonic() < end, f"no {text!r} within {timeout}s:\n{''.join(self.lines[-30:])}"
            time.sleep(0.1)


def test_ctrl_c_while_the_launcher_waits_for_nodes_ends_it_and_everything_it_started(tmp_path):
    out = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-m", "trainer.ft.launch", "--local-nodes", "1", "--nnodes", "2",
                             "--out", str(out), "--", "--steps", "5"], cwd=REPO, env=ENV, start_new_session=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        end = time.monotonic() + 120
        while not any(e["event"] == "node_start" for e in read_events(out)):
            assert proc.poll() is None and time.monotonic() < end, proc.communicate(timeout=30)
            time.sleep(0.2)
        time.sleep(1.0)  # in the rendezvous now, waiting for a second node that never comes
        started = descendants(proc.pid)  # the store and the node launcher (and their helpers)
        assert len(started) >= 2
        t0 = time.monotonic()
        os.kill(proc.pid, signal.SIGINT)  # the terminal's Ctrl-C reaches the launcher alone
        stdout, stderr = proc.communicate(timeout=30)
        took = time.monotonic() - t0
    finally:
        if proc.poll() is None:
            kill_tree(proc.pid)
            proc.wait(timeout=30)
    assert took < 10, took
    assert proc.returncode == 130, (stdout, stderr)
    assert stderr.strip() == ("stopped (SIGINT) while this node waited for a round; nothing needed saving (the "
                              "newest checkpoint, if any, stays); start the same job again to resume"), stderr
    assert "exitcode" not in stdout + stderr and "Traceback" not in stdout + stderr
    end = time.monotonic() + 10
    while any(_alive(p) for p in started) and time.monotonic() < end:
        time.sleep(0.1)
    assert not [p for p in started if _alive(p)], "a process the launcher started outlived it"


def test_the_store_exits_on_sigterm(tmp_path):
    ready = tmp_path / "ready"
    proc = subprocess.Popen([sys.executable, "-m", "trainer.ft.launch", "--serve-store", f"127.0.0.1:{free_port()}",
                             "--out", str(ready)], cwd=REPO, env=ENV, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    try:
        end = time.monotonic() + 60
        while not ready.exists():
            assert proc.poll() is None and time.monotonic() < end, proc.communicate(timeout=30)
            time.sleep(0.1)
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        stdout, _ = proc.communicate(timeout=30)
        took = time.monotonic() - t0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)
    assert proc.returncode == 0 and took < 10, (took, stdout)
    assert stdout.strip().splitlines()[-1] == "[launch store] stopped (SIGTERM)"


def test_ctrl_c_under_nproc_per_node_names_the_signal_it_got(tmp_path):
    """The terminal's Ctrl-C reaches the whole process group, and ``timeout`` passes it on once more:
    the echo is one stop, not a second signal, and the workers say SIGINT, the signal sent."""
    out = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-m", "trainer", "--nproc-per-node", "2", "--steps", "100000", "--out",
                             str(out), "--no-logging.plot", "--no-logging.tensorboard", "--no-eval.enabled"],
                            cwd=tmp_path, env=ENV, start_new_session=True, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    lines = _Lines(proc)
    try:
        lines.wait_for("run:", proc, 180)  # rank 0's start-up summary: training begins
        time.sleep(3)
        os.killpg(proc.pid, signal.SIGINT)  # the terminal's Ctrl-C to the foreground group
        os.kill(proc.pid, signal.SIGINT)  # and timeout's pass-on of it
        _wait_for_exit(proc, lines)
    finally:
        _reap(proc)
    _assert_one_sigint_stop(proc, lines)


def _wait_for_exit(proc: subprocess.Popen, lines: "_Lines") -> None:
    proc.wait(timeout=60)
    lines.thread.join(timeout=10)


def _reap(proc: subprocess.Popen) -> None:
    """The launcher and its workers ended, whatever the test saw."""
    if proc.poll() is None:
        kill_tree(proc.pid)
        proc.wait(timeout=30)


def _assert_one_sigint_stop(proc: subprocess.Popen, lines: "_Lines") -> None:
    """The run ended as one Ctrl-C ends it: status 130, one stopped line naming SIGINT, nothing aborted,
    no SIGTERM anywhere, no traceback."""
    text = "".join(lines.lines)
    assert proc.returncode == 130, text[-3000:]
    stopped = [line for line in lines.lines if line.startswith("stopped ")]
    assert len(stopped) == 1 and "(SIGINT)" in stopped[0], text[-3000:]
    assert "aborted" not in text and "SIGTERM" not in text and "Traceback" not in text, text[-3000:]


def test_an_echo_of_ctrl_c_during_the_agents_shutdown_leaves_the_workers_its_sigint(tmp_path):
    """The echo of a Ctrl-C (``timeout``'s, or the terminal's) may reach the launcher after torch's
    agent began passing the first on; on a loaded machine that is as the agent starts. It is one
    stop: no worker gets a SIGTERM from an interrupted shutdown, and the run says SIGINT. Here the
    launcher sends the echo to itself at that moment, so the order is the same on every run."""
    out = tmp_path / "run"
    argv = ["--nproc-per-node", "2", "--steps", "100000", "--out", str(out), "--no-logging.plot",
            "--no-logging.tensorboard", "--no-eval.enabled"]
    code = ("import os, signal, sys\n"
            "import trainer.ft.stop as stop\n"
            "stop.REPEAT_WINDOW_S = 3600.0  # the echo is never a second signal, however slow the machine\n"
            "from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent\n"
            "shutdown = LocalElasticAgent._shutdown\n"
            "def echoed(self, death_sig=signal.SIGTERM, *rest, **kw):  # torch 2.11 has no timeout argument\n"
            "    if death_sig == signal.SIGINT:  # the agent passes the Ctrl-C on: its echo lands now\n"
            "        os.kill(os.getpid(), signal.SIGINT)\n"
            "    return shutdown(self, death_sig, *rest, **kw)\n"
            "LocalElasticAgent._shutdown = echoed\n"
            "from trainer.cli import main\n"
            f"sys.exit(main({argv!r}))\n")
    proc = subprocess.Popen([sys.executable, "-c", code], cwd=tmp_path, env=ENV, start_new_session=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines = _Lines(proc)
    try:
        lines.wait_for("run:", proc, 180)
        # rank 0's record of step 2 follows step 1's stop agreement: every rank is in its training loop
        metrics, end = out / "metrics.jsonl", time.monotonic() + 180
        while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 2):
            assert proc.poll() is None, f"exited with {proc.returncode}:\n{''.join(lines.lines)}"
            assert time.monotonic() < end, f"no second step within 180s:\n{''.join(lines.lines[-30:])}"
            time.sleep(0.1)
        os.killpg(proc.pid, signal.SIGINT)  # the Ctrl-C
        _wait_for_exit(proc, lines)
    finally:
        _reap(proc)
    _assert_one_sigint_stop(proc, lines)


def test_ctrl_c_while_preprocessing_is_one_line_and_writes_nothing(tmp_path):
    (tmp_path / "c.txt").write_text("words of a corpus. " * 50)
    code = ("import os, signal, sys, time\n"
            "import trainer.data.preprocess as p\n"
            "def working(*args, **kw):  # the signal arrives while the input is being read\n"
            "    os.kill(os.getpid(), signal.SIGINT)\n"
            "    time.sleep(30)\n"
            "p.preprocess_files = working\n"
            "sys.exit(p.main(['--input', 'c.txt', '--context', '8', '--out', 'data', '--quiet']))\n")
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=ENV, capture_output=True, text=True,
                          timeout=60)
    assert time.monotonic() - t0 < 20
    assert proc.returncode == 130, proc.stderr
    assert proc.stderr.strip() == ("fastmoe-preprocess: stopped (SIGINT); nothing was written to --out data (a data "
                                   "set already there stays as it was)")
    assert list((tmp_path / "data").iterdir()) == []
