"""The lease on an output directory (trainer/ft/lease.py): one job writes it at a time; a live
holder is named in one line, a gone one (its process dead, its heartbeat stale) is taken over, and
every process of one job shares the job's lease. In-process checks with a holder in a small
subprocess, and two end-to-end checks of fastmoe-train (marked slow). Every wait is bounded."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from trainer.ft import lease as lease_mod
from trainer.ft.lease import JOB_ENV, LeaseHeld, job_id, lease_path, take_lease
from trainer.records.metrics import read_metrics
from trainer_util import data_cache  # noqa: F401 (fixture)

REPO = Path(__file__).resolve().parents[3]
ENV = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
ENV.pop(JOB_ENV, None)

_HOLD = ("import sys, time; from trainer.ft.lease import take_lease; "
         "take_lease(sys.argv[1], what='--out x', command='holder'); print('held', flush=True); time.sleep(120)")


@pytest.fixture(autouse=True)
def _own_job(monkeypatch):
    """This test process as a job of its own (no launcher, scheduler or torchrun around it)."""
    for name in (JOB_ENV, "TORCHELASTIC_RUN_ID", "SLURM_JOB_ID", "PBS_JOBID", "LSB_JOBID", "FLUX_JOB_ID"):
        monkeypatch.delenv(name, raising=False)
    yield
    for held in list(lease_mod._HELD.values()):
        held.release()


def _holder(path: Path, env: dict | None = None) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", _HOLD, str(path)], env=env or ENV, stdout=subprocess.PIPE,
                            text=True)
    assert proc.stdout.readline().strip() == "held"  # bounded: the child prints or exits
    return proc


def test_a_live_holder_is_refused_in_one_line_and_a_killed_one_taken_over(tmp_path, capsys):
    path = lease_path(tmp_path)
    proc = _holder(path)
    try:
        with pytest.raises(LeaseHeld) as e:
            take_lease(path, what=f"--out {tmp_path}", command="test")
        msg = str(e.value)
        assert "\n" not in msg and f"pid {proc.pid}" in msg and "host " in msg and "another --out" in msg
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    held = take_lease(path, what=f"--out {tmp_path}", command="test")
    assert held is not None and json.loads(path.read_text())["pid"] == os.getpid()
    line = capsys.readouterr().out
    assert "taking over the lease" in line and f"pid {proc.pid}" in line and "process is gone" in line
    held.release()
    assert not path.exists()  # released: the directory as it was found


def _record(path: Path, age: float, **over) -> None:
    rec = {"host": "elsewhere", "pid": 1, "job": "slurm:1", "command": "fastmoe-train", "started": time.time() - 99,
           "token": "t", "refreshed": time.time() - age, **over}
    path.write_text(json.dumps(rec))
    os.utime(path, (time.time() - age, time.time() - age))


def test_another_hosts_lease_is_held_while_its_heartbeat_is_fresh(tmp_path, monkeypatch, capsys):
    """Where the lock says nothing (another node), the heartbeat decides, against a bound the line names."""
    monkeypatch.setenv(lease_mod.STALE_ENV, "30")
    path = lease_path(tmp_path)
    _record(path, age=5)
    with pytest.raises(LeaseHeld, match="host elsewhere, pid 1, job slurm:1.*silent for 30 s"):
        take_lease(path, what="--out o", command="test")
    _record(path, age=45)
    assert take_lease(path, what="--out o", command="test") is not None
    assert "heartbeat is 45 s old, over the 30 s bound" in capsys.readouterr().out


def test_the_holder_refreshes_its_heartbeat(tmp_path, monkeypatch):
    monkeypatch.setattr(lease_mod, "REFRESH_S", 0.05)
    path = lease_path(tmp_path)
    held = take_lease(path, what="--out o", command="test")
    first = json.loads(path.read_text())["refreshed"]
    deadline = time.monotonic() + 10
    while json.loads(path.read_text())["refreshed"] == first and time.monotonic() < deadline:
        time.sleep(0.05)
    assert json.loads(path.read_text())["refreshed"] > first
    held.release()


def test_the_processes_of_one_job_share_its_lease(tmp_path, monkeypatch):
    """A launcher's workers (and the workers of its restarts) join the lease their job holds."""
    path = lease_path(tmp_path)
    monkeypatch.setenv(JOB_ENV, "local:h:1:abc")
    proc = _holder(path, env={**ENV, JOB_ENV: "local:h:1:abc"})
    try:
        assert take_lease(path, what="--out o", command="worker") is None  # joined, not taken, not refused
        monkeypatch.setenv(JOB_ENV, "local:h:2:def")  # another launcher's job
        with pytest.raises(LeaseHeld):
            take_lease(path, what="--out o", command="worker")
    finally:
        proc.kill()
        proc.wait(timeout=30)


def test_job_ids(monkeypatch):
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "abc")  # torchrun: the same for every worker and restart
    assert job_id() == "torchrun:abc"
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "none")  # a static rendezvous: its store tells jobs apart
    monkeypatch.setenv("MASTER_ADDR", "n1")
    monkeypatch.setenv("MASTER_PORT", "29500")
    assert job_id() == "torchrun:none@n1:29500"
    monkeypatch.setenv("SLURM_JOB_ID", "77")
    monkeypatch.setenv("SLURM_RESTART_COUNT", "1")  # a requeued job is another job
    assert job_id().startswith("slurm:77..1+")
    monkeypatch.setenv(JOB_ENV, "launch:x@y")
    assert job_id() == "launch:x@y"
    monkeypatch.delenv(JOB_ENV)
    assert lease_mod.launcher_job("launch:x@y", shared=True).startswith("launch:x@y+slurm:77")


def _train(out: Path, cache: Path, steps: int, *extra: str) -> list[str]:
    return [sys.executable, "-m", "trainer", "--preset", "tiny-moe", "--steps", str(steps), "--context", "16",
            "--global-batch", "4", "--micro-batch", "2", "--data.cache_dir", str(cache), "--out", str(out),
            "--no-logging.tensorboard", "--no-logging.plot", "--logging.peak_tflops", "1", "--no-eval.enabled",
            "--no-logging.progress", *extra]


def _losses(out: Path) -> list[float]:
    return [r["loss"] for r in read_metrics(out / "metrics.jsonl")]


@pytest.mark.slow
def test_a_second_run_into_one_out_is_refused_and_the_first_unharmed(tmp_path):
    """Two runs 2 s apart into one --out: the second ends within 10 s naming the first; the first's
    losses equal a run alone's, bit for bit."""
    cache = tmp_path / "cache"
    subprocess.run(_train(tmp_path / "warm", cache, 1), env=ENV, cwd=REPO, timeout=240, check=True,
                   capture_output=True)  # the data set is built once, before the timing below
    alone = subprocess.Popen(_train(tmp_path / "alone", cache, 25), env=ENV, cwd=REPO, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
    first = subprocess.Popen(_train(tmp_path / "run", cache, 25), env=ENV, cwd=REPO, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
    try:
        time.sleep(2)
        t0 = time.monotonic()
        second = subprocess.run(_train(tmp_path / "run", cache, 25, "--seed", "7"), env=ENV, cwd=REPO, timeout=60,
                                capture_output=True, text=True)
        took = time.monotonic() - t0
        assert first.wait(timeout=300) == 0, first.communicate()[1][-3000:]
        assert alone.wait(timeout=300) == 0, alone.communicate()[1][-3000:]
    finally:
        for p in (first, alone):
            if p.poll() is None:
                p.kill()
    assert second.returncode == 2 and took < 10, (took, second.stderr)
    lines = second.stderr.strip().splitlines()
    assert len(lines) == 1 and "in use by another job" in lines[0] and f"pid {first.pid}" in lines[0], lines
    assert "host " in lines[0] and "Traceback" not in second.stderr
    assert _losses(tmp_path / "run") == _losses(tmp_path / "alone") and len(_losses(tmp_path / "run")) == 25
    assert not (tmp_path / "run" / "lease.json").exists()  # the first released it at its end


@pytest.mark.slow
def test_a_killed_holders_lease_is_taken_over_and_the_run_resumes(tmp_path):
    out, cache = tmp_path / "run", tmp_path / "cache"
    cmd = _train(out, cache, 30, "--checkpoint.interval", "4")
    proc = subprocess.Popen(cmd, env=ENV, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline and proc.poll() is None:
            if (out / "metrics.jsonl").is_file() and len((out / "metrics.jsonl").read_text().splitlines()) >= 9:
                break
            time.sleep(0.1)
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert json.loads((out / "lease.json").read_text())["pid"] == proc.pid  # left behind by the killed holder
    again = subprocess.run(cmd, env=ENV, cwd=REPO, timeout=300, capture_output=True, text=True)
    assert again.returncode == 0, again.stderr[-3000:]
    took = [ln for ln in again.stdout.splitlines() if "taking over the lease" in ln]
    assert len(took) == 1 and f"pid {proc.pid}" in took[0] and "process is gone" in took[0], again.stdout
    assert "resumed from" in again.stdout
    assert [r["step"] for r in read_metrics(out / "metrics.jsonl")][-1] == 30


@pytest.mark.slow
def test_a_launcher_job_holds_the_lease_for_its_workers(tmp_path):
    """fastmoe-launch takes the lease and its worker joins it; another launcher job and a plain run
    into the same --out are refused, naming the launcher."""
    out, cache = tmp_path / "run", tmp_path / "cache"
    trainer_args = _train(out, cache, 100000)[3:]  # past "-m trainer"
    launch = [sys.executable, "-m", "trainer.ft.launch", "--nnodes", "1", "--nproc-per-node", "1", "--out", str(out),
              "--", *[a for i, a in enumerate(trainer_args) if a != "--out" and trainer_args[i - 1] != "--out"]]
    first = subprocess.Popen(launch, env=ENV, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline and not (out / "metrics.jsonl").is_file():
            assert first.poll() is None
            time.sleep(0.2)
        holder = json.loads((out / "lease.json").read_text())
        assert holder["pid"] == first.pid and holder["command"] == "fastmoe-launch"
        other = subprocess.run([*launch[:3], "--rdzv-id", "other", "--rdzv-endpoint", "127.0.0.1:29555",
                                *launch[3:]], env=ENV, cwd=REPO, timeout=120, capture_output=True, text=True)
        plain = subprocess.run(_train(out, cache, 5), env=ENV, cwd=REPO, timeout=120, capture_output=True, text=True)
        for r in (other, plain):
            assert r.returncode == 2 and f"pid {first.pid}, job launch:trainer@None, fastmoe-launch" in r.stderr, \
                r.stderr[-2000:]
    finally:
        first.send_signal(signal.SIGINT)
        try:
            first.wait(timeout=120)
        finally:
            if first.poll() is None:
                first.kill()


def test_a_trainer_dropped_without_fit_gives_its_lease_up(data_cache, tmp_path):  # noqa: F811
    """A Trainer built and used step by step (a benchmark, a notebook) holds --out while it lives; once
    collected, another job may take the directory (it kept it until the process ended)."""
    import gc

    from trainer.trainer import Trainer
    from trainer_util import small_cfg

    out = tmp_path / "run"
    t = Trainer(small_cfg(data_cache, str(out), steps=2, eval__enabled=False))
    path = lease_path(out)
    assert json.loads(path.read_text())["pid"] == os.getpid()
    proc = subprocess.run([sys.executable, "-c", _HOLD.replace("time.sleep(120)", "pass"), str(path)], env=ENV,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0 and "in use by another job" in proc.stderr
    del t
    gc.collect()
    assert not path.exists() and str(path) not in lease_mod._HELD
    proc = subprocess.run([sys.executable, "-c", _HOLD.replace("time.sleep(120)", "pass"), str(path)], env=ENV,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and proc.stdout.strip() == "held", proc.stderr[-2000:]
