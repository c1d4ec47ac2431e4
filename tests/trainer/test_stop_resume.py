"""Stopping by signal and resuming: Ctrl-C / SIGTERM finish the step, write a checkpoint, print one
line and exit 130 / 143; a second signal aborts at once; a resume on another schedule is refused
without ``--checkpoint.reschedule``; metrics, summary and charts cover the whole run, one record
per step; metrics.jsonl is strict JSON.
"""
from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from trainer.checkpoint.slots import latest_valid
from trainer.cli import main
from trainer.config import ConfigError
from trainer.records.metrics import MetricsWriter, read_metrics
from trainer.records.progress import LINES, LineProgress
from trainer.trainer import Trainer
from trainer_util import data_cache, one_thread, small_cfg  # noqa: F401 (fixtures)

REPO = Path(__file__).resolve().parents[2]


def _strict(path: Path) -> list[dict]:
    """The records of a metrics file, refusing NaN / Infinity (not JSON)."""
    def bad(token: str) -> None:
        raise ValueError(f"{path}: {token} is not JSON")

    return [json.loads(line, parse_constant=bad) for line in path.read_text().splitlines()]


def _train_cmd(out: Path, cache: str, *extra: str) -> list[str]:
    return [sys.executable, "-m", "trainer", "--preset", "tiny-moe", "--steps", "1000", "--context", "16",
            "--global-batch", "4", "--micro-batch", "2", "--data.cache_dir", cache, "--out", str(out),
            "--no-logging.tensorboard", "--no-logging.plot", "--logging.peak_tflops", "1", "--no-eval.enabled",
            *extra]


def _interrupt(cmd: list[str], out: Path, after_steps: int, sig: int) -> subprocess.CompletedProcess:
    """Start ``cmd``, send ``sig`` to it once metrics.jsonl holds ``after_steps`` records, wait."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    metrics = out / "metrics.jsonl"
    deadline = time.monotonic() + 240
    try:
        while time.monotonic() < deadline and proc.poll() is None:
            if metrics.is_file() and len(metrics.read_text().splitlines()) >= after_steps:
                break
            time.sleep(0.2)
        assert proc.poll() is None, f"ended before the signal:\n{proc.communicate()[1][-3000:]}"
        proc.send_signal(sig)
        stdout, stderr = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    return subprocess.CompletedProcess(cmd, proc.returncode, stdout, stderr)


@pytest.mark.slow
def test_ctrl_c_under_the_launcher_saves_one_checkpoint_and_says_so(tmp_path, data_cache):  # noqa: F811
    """Two processes (``--nproc-per-node 2``, torchrun's launcher) stopped by SIGINT. About 25 s on
    two shared cores: the launcher and both workers import torch; it is the one end-to-end check of
    the signal path through torchrun's agent."""
    out = tmp_path / "run"
    first = _interrupt(_train_cmd(out, data_cache, "--nproc-per-node", "2"), out, 2, signal.SIGINT)
    assert first.returncode == 130, first.stderr[-3000:]
    assert "Traceback" not in first.stderr + first.stdout, first.stderr[-3000:]
    lines = [ln for ln in first.stderr.splitlines() if ln.startswith("stopped at step")]
    assert len(lines) == 1, first.stderr
    step = int(lines[0].split()[3])
    ckpt = lines[0].split("checkpoint at ")[1].split(";")[0]
    assert lines[0].endswith("run the same command to resume")
    newest = latest_valid(out / "checkpoints")  # checksums verified
    assert newest is not None and newest.step == step and Path(newest.path) == Path(ckpt)
    assert [r["step"] for r in _strict(out / "metrics.jsonl")] == list(range(1, step + 1))

    # resuming from it: test_resume_on_another_schedule_is_refused_unless_asked (in-process)


def test_a_second_signal_aborts_at_once():
    code = ("import os, signal, time\n"
            "from trainer.ft.stop import StopRequest\n"
            "s = StopRequest().install(); s.deferred = True\n"
            "os.kill(os.getpid(), signal.SIGINT); time.sleep(0.1)\n"
            "assert s.signum == signal.SIGINT\n"
            "os.kill(os.getpid(), signal.SIGINT); time.sleep(5)\n"
            "print('not aborted')\n")
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 130 and "not aborted" not in proc.stdout, proc.stderr
    assert time.monotonic() - t0 < 5
    assert proc.stderr.strip().startswith("aborted at once (SIGINT again)"), proc.stderr
    assert "Traceback" not in proc.stderr


def test_the_launchers_passed_on_stop_is_never_a_second_signal():
    """Under the node launcher a worker gets the scheduler's SIGTERM and the launcher's SIGUSR1 (its
    SIGTERM passed on), in either order: one stop, for SIGTERM, no abort; a second SIGTERM from
    outside still aborts."""
    code = ("import os, signal, time\n"
            "from trainer.ft.stop import StopRequest\n"
            "s = StopRequest().install(); s.deferred = True\n"
            "os.kill(os.getpid(), signal.SIGUSR1); time.sleep(0.1)\n"
            "os.kill(os.getpid(), signal.SIGTERM); time.sleep(0.1)\n"
            "os.kill(os.getpid(), signal.SIGUSR1); time.sleep(0.1)\n"
            "assert s.signum == signal.SIGTERM\n"
            "print('one stop', flush=True)\n"
            "os.kill(os.getpid(), signal.SIGTERM); time.sleep(5)\n"
            "print('not aborted')\n")
    env = {**os.environ, "TRAINER_NODE_LAUNCHER": "1"}
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60, env=env)
    assert proc.returncode == 143 and proc.stdout.splitlines() == ["one stop"], (proc.stdout, proc.stderr)
    assert proc.stderr.strip().startswith("aborted at once (SIGTERM again)"), proc.stderr


def test_resume_on_another_schedule_is_refused_unless_asked(tmp_path, data_cache, capsys):  # noqa: F811
    out = str(tmp_path / "run")
    t = Trainer(small_cfg(data_cache, out, steps=6, checkpoint__interval=2))
    t.fit(steps=3)  # a run cut after step 3: checkpoint at 2, records 1..3
    resumed = Trainer(small_cfg(data_cache, out, steps=9, checkpoint__interval=2))
    with pytest.raises(ConfigError, match=r"--steps 6 -> 9.*--checkpoint.reschedule"):
        resumed.fit()
    again = Trainer(small_cfg(data_cache, out, steps=9, checkpoint__interval=2, checkpoint__reschedule=True))
    capsys.readouterr()
    again.fit()
    assert "warning: the checkpoint" in capsys.readouterr().out
    records = _strict(Path(out) / "metrics.jsonl")
    assert [r["step"] for r in records] == list(range(1, 10))  # step 3 once, though done twice
    assert records[0]["grad_norm_mean"] is None  # step 1 has no earlier norms: null, not NaN
    assert all(math.isfinite(r["grad_norm_mean"]) for r in records[1:])
    summary = json.loads((Path(out) / "summary.json").read_text())
    assert summary["steps"] == 9 and summary["steps_this_run"] == 7
    assert summary["loss_first"] == records[0]["loss"]
    assert [r["step"] for r in again.run_records()] == list(range(1, 10))


def test_metrics_are_strict_json(tmp_path):
    w = MetricsWriter(str(tmp_path), tensorboard=False)
    w.write({"step": 1, "loss": float("nan"), "lists": [1.0, float("inf")]})
    w.write({"step": 2, "loss": 1.5, "lists": [1.0, 2.0]})
    w.close()
    assert _strict(tmp_path / "metrics.jsonl")[0] == {"step": 1, "loss": None, "lists": [1.0, None]}
    # a resume from step 1 drops the later record (and a line cut short)
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"step": 3, "lo')
    MetricsWriter(str(tmp_path), tensorboard=False, append=True, start_step=1).close()
    assert [r["step"] for r in read_metrics(str(tmp_path / "metrics.jsonl"))] == [1]


def test_progress_outside_a_terminal_is_a_few_lines():
    import io

    buf = io.StringIO()
    bar = LineProgress(total=1000, initial=0, desc="tiny-moe", file=buf)
    for i in range(1000):
        bar.update(1)
        bar.set_postfix(loss=f"{1 / (i + 1):.3f}")
    bar.close()
    lines = buf.getvalue().splitlines()
    assert len(lines) == LINES and "\r" not in buf.getvalue()
    assert lines[-1].startswith("tiny-moe: step 1000/1000") and "loss=0.001" in lines[-1]


def test_progress_lines_show_their_own_steps_loss(tmp_path, data_cache, capsys):  # noqa: F811
    import re

    t = Trainer(small_cfg(data_cache, str(tmp_path / "run"), steps=4, logging__progress=True, eval__enabled=False))
    hist = t.fit()
    err = capsys.readouterr().err  # not a terminal: one line per step here (4 steps < LINES)
    shown = {int(m.group(1)): m.group(2) for m in re.finditer(r"step (\d+)/4 .* loss=(\S+)", err)}
    assert sorted(shown) == [1, 2, 3, 4], err
    assert len({r["loss"] for r in hist}) == 4  # the losses differ, so a line one step late would show
    for r in hist:
        assert shown[r["step"]] == f"{r['loss']:.3f}", (r["step"], shown)


def test_progress_outside_a_terminal_at_least_every_10_seconds(monkeypatch, capsys):
    """Slow steps (here 4 s each on a fake clock) still give a line at least every 10 s; under the
    node launcher the lines go to stdout, which the launcher holding rank 0 shows."""
    import io

    import trainer.records.progress as progress
    from trainer.ft.stop import LAUNCHER_ENV

    clock = [0.0]
    monkeypatch.setattr(progress.time, "perf_counter", lambda: clock[0])
    buf = io.StringIO()
    bar = LineProgress(total=1000, initial=0, desc="big", file=buf)  # a line every 50 steps by count
    for _ in range(10):
        clock[0] += 4.0
        bar.update(1)
    lines = buf.getvalue().splitlines()
    assert [ln.split()[2] for ln in lines] == ["3/1000", "6/1000", "9/1000"], lines  # 12 s, 24 s, 36 s
    monkeypatch.setenv(LAUNCHER_ENV, "1")
    bar = progress.progress_bar(total=2, desc="tiny-moe")
    bar.update(2)
    bar.close()
    out, err = capsys.readouterr()
    assert out.startswith("tiny-moe: step 2/2") and err == ""


def test_cli_stop_before_training_is_one_line(tmp_path, capsys, monkeypatch):
    """A signal during start-up (here: while the config is read) stops at once with the status."""
    import trainer.cli as cli

    def interrupted(*a, **k):
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(1)  # the handler raises in here
        raise AssertionError("the signal did not stop the command")

    monkeypatch.setattr(cli, "config_from_args", interrupted)
    assert main(["--preset", "tiny-moe"]) == 143
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["stopped by SIGTERM before training began; nothing needed saving"]
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # handlers put back


def test_sigterm_is_left_to_an_agent_that_restarts_workers(monkeypatch):
    from trainer.ft.stop import handled_signals

    monkeypatch.delenv("TORCHELASTIC_MAX_RESTARTS", raising=False)
    assert set(handled_signals()) == {signal.SIGINT, signal.SIGTERM}
    monkeypatch.setenv("TORCHELASTIC_MAX_RESTARTS", "0")  # plain torchrun
    assert set(handled_signals()) == {signal.SIGINT, signal.SIGTERM}
    monkeypatch.setenv("TORCHELASTIC_MAX_RESTARTS", "3")  # torchrun --max-restarts 3
    assert handled_signals() == (signal.SIGINT,)
    monkeypatch.setenv("TRAINER_NODE_LAUNCHER", "1")  # fastmoe-launch: it restarts with SIGKILL
    assert set(handled_signals()) == {signal.SIGINT, signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2}


def test_release_process_groups_ends_gloo_threads_held_in_a_cycle(tmp_path):
    """The trainer's objects hold its process groups in reference cycles: destroyed but not freed,
    their gloo threads would run into interpreter shutdown (where one that needs the interpreter
    aborts the process: ``terminate called without an active exception``). After
    ``release_process_groups`` none is left."""
    import datetime

    import torch.distributed as dist

    from trainer.cli import release_process_groups

    def gloo_threads() -> int:
        names = []
        for t in os.listdir("/proc/self/task"):
            try:
                with open(f"/proc/self/task/{t}/comm") as f:
                    names.append(f.read().strip())
            except OSError:
                pass
        return sum(n.startswith(("pt_gloo", "gloo_")) for n in names)

    before = gloo_threads()
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1, timeout=datetime.timedelta(seconds=30))

    class Holder:
        pass

    def settled(want) -> int:  # noqa: ANN001
        """The gloo threads once ``want(count)`` holds, or after 10 s: a thread names itself after it
        starts and is gone only after it ends, so on a loaded machine the count lags the calls."""
        end = time.monotonic() + 10
        while not want(n := gloo_threads()) and time.monotonic() < end:
            time.sleep(0.01)
        return n

    h = Holder()
    h.me, h.group = h, dist.new_group([0])  # a cycle, as in the trainer
    del h
    assert settled(lambda n: n > before) > before
    release_process_groups()
    assert not dist.is_initialized() and settled(lambda n: n == before) == before
