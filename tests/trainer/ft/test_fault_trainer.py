"""Fault tolerance inside the real trainer (``tiny-moe``, shrunk): a NaN caught before the update,
--init-from, and kill -9 of one node under ``trainer.ft.launch --local-nodes 3`` (world 2 on gloo, a spare) ending with an
uninterrupted run's exact state. (Exact resume itself: test_trainer.py.)"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import _ft_toy as toy
from trainer.checkpoint.optim_state import optimizer_steps
from trainer.checkpoint.slots import verify
from trainer.ft import fault
from trainer.ft.elastic.job import read_events
from trainer.ft.elastic.local_nodes import descendants

REPO = Path(__file__).resolve().parents[3]
# tiny-moe with one layer, 8 instances of 16 tokens per step, warmup 1 step: quick, still MoE with EPSO
SMALL = ["--preset", "tiny-moe", "--model.num_layers", "1", "--context", "16", "--global-batch", "8",
         "--micro-batch", "4", "--warmup", "1", "--peak-tflops", "1", "--no-logging.progress", "--no-logging.plot",
         "--no-logging.tensorboard"]


@pytest.fixture(scope="module")
def small(tmp_path_factory) -> list[str]:
    """SMALL with a data cache of this module's own (the corpus is prepared once)."""
    return [*SMALL, "--data.cache_dir", str(tmp_path_factory.mktemp("data_cache"))]


def _config(args: list[str], out: Path, *extra: str):
    from trainer.cli import config_from_args

    cfg, _ = config_from_args([*args, "--out", str(out), *extra])
    return cfg


def _weights(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.named_parameters()}


def _saved_weights(saved: dict[str, torch.Tensor], model) -> dict[str, torch.Tensor]:
    """Checkpointed weights by parameter name (merged expert weights are stored per expert)."""
    out = {}
    for name, w in model.named_parameters():
        out[name] = saved[f"w/{name}"] if f"w/{name}" in saved else \
            torch.stack([saved[f"w/{name}/{e}"] for e in range(w.shape[0])])
    return out


def test_nan_is_caught_before_the_update(tmp_path: Path, monkeypatch, small) -> None:
    """The loss turns NaN in step index 2: fit raises SoftFailure with the weights still equal to
    the step-2 checkpoint's, and the host is recorded."""
    from trainer.trainer import Trainer

    out = tmp_path / "run"
    monkeypatch.setenv(fault.NAN_ENV, "step=2")
    monkeypatch.setenv(fault.HOST_ENV, "bad-host")
    t = Trainer(_config(small, out, "--steps", "4", "--checkpoint.interval", "2"))
    with pytest.raises(fault.SoftFailure, match="step 2"):
        t.fit()
    assert t.step == 2
    (rec,) = fault.read_failures(out)
    assert (rec["step"], rec["rank"], rec["host"], rec["what"]) == (2, 0, "bad-host", "loss and gradients")
    saved = _saved_weights(toy.read_checkpoint(out / "checkpoints" / "slot-A"), t.model)
    for name, w in _weights(t.model).items():  # untouched by the poisoned step
        assert torch.equal(w, saved[name]), name
    assert optimizer_steps(t.optimizer) == {b.name: 2 for b in t.optimizer.buckets}


def test_init_from_a_model_only_checkpoint(tmp_path: Path, small) -> None:
    from trainer.trainer import Trainer

    src = Trainer(_config(small, tmp_path / "src", "--steps", "2", "--checkpoint.model_interval", "2"))
    src.fit()
    path = tmp_path / "src" / "checkpoints" / "model-step-00000002"
    assert verify(path) is None
    t = Trainer(_config(small, tmp_path / "dst", "--steps", "3", "--checkpoint.init_from", str(path)))
    assert t.step == 0 and optimizer_steps(t.optimizer) == {b.name: 0 for b in t.optimizer.buckets}
    for name, w in _weights(src.model).items():
        assert torch.equal(_weights(t.model)[name], w.to(torch.bfloat16).float()), name
    t.fit()  # trains on from there with a fresh optimizer


def test_kill9_of_one_rank_relaunches_on_a_spare_and_ends_with_uninterrupted_weights(tmp_path: Path, small) -> None:
    steps, interval = "6", "2"

    def launch(out: Path, *launcher: str) -> subprocess.Popen:
        cmd = [sys.executable, "-m", "trainer.ft.launch", "--local-nodes", "3", "--nnodes", "2", "--nproc-per-node", "1",
               "--max-restarts", "1", "--monitor-interval", "0.2", "--timeout", "500", "--out", str(out), *launcher,
               "--", *small, "--steps", steps, "--checkpoint.interval", interval]
        env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
        return subprocess.Popen(cmd, env=env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)

    def finish(p: subprocess.Popen, out: Path) -> list[dict]:
        stdout, _ = p.communicate(timeout=600)
        assert p.returncode == 0, stdout[-4000:]
        return read_events(out)

    ref = tmp_path / "ref"
    finish(launch(ref), ref)
    out = tmp_path / "run"
    p = launch(out)
    end = time.time() + 400
    while time.time() < end:  # rank 1 inside step 3 (after the step-2 checkpoint)
        b = fault.read_heartbeats(out).get(1)
        if b and b["phase"] == "start" and b["step"] >= int(interval) + 1:
            break
        time.sleep(0.02)
    else:
        p.kill()
        pytest.fail("rank 1 never reached step 3")
    victim = b["host"]
    (node_pid,) = [e["pid"] for e in read_events(out) if e["event"] == "node_start" and e["node"] == victim]
    killed_at = time.time()
    for pid in [node_pid, *descendants(node_pid)]:  # the whole node: launcher, agent, worker
        os.kill(pid, signal.SIGKILL)
    ev = finish(p, out)
    assert victim not in {e["node"] for e in ev if e["event"] in ("round", "finished") and e["time"] > killed_at}
    assert len({e["node"] for e in ev if e["event"] == "finished"}) == 2
    first_round = min(e["time"] for e in ev if e["event"] == "round" and e["time"] > killed_at)
    print(f"kill -> new rendezvous round {first_round - killed_at:.2f}s")
    want = toy.read_checkpoint(ref / "checkpoints" / "slot-A")
    got = toy.read_checkpoint(out / "checkpoints" / "slot-A")
    assert json.loads((out / "checkpoints" / "slot-A" / "meta.json").read_text())["step"] == int(steps)
    assert got.keys() == want.keys()
    for k in want:
        assert torch.equal(got[k], want[k]), k
