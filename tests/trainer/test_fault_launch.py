"""End to end under ``python -m trainer.launch`` with the stand-in trainer (world 2 on gloo, one
rank per host): a NaN on one host and a hung rank are each survived by replacing the host with a
spare and resuming, and the run ends with an uninterrupted run's exact state. (kill -9 is tested
with the real trainer in test_fault_trainer.py.)"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import _ft_toy as toy
from trainer import fault
from trainer import launch as launch_module  # run by module name, whichever the package has

REPO = Path(__file__).resolve().parents[2]
STEPS, INTERVAL = 8, 2


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict[str, torch.Tensor]:
    out = tmp_path_factory.mktemp("reference")
    codes = toy.spawn(2, ["--out", str(out), "--steps", str(STEPS), "--interval", "0", "--dump", str(out / "dump")])
    assert codes == [0, 0], (out / "spawn-rank-0.log").read_text()[-2000:]
    return toy.assemble(toy.load_dumps(out / "dump"))


def _launch(out: Path, *extra_trainer: str, env: dict[str, str] | None = None,
            launcher: tuple[str, ...] = ()) -> subprocess.Popen:
    cmd = [sys.executable, "-m", launch_module.__name__, "--hosts", "h0,h1", "--spares", "h2", "--nproc-per-node", "1",
           "--max-restarts", "2", "--kill-grace", "2", "--entry", str(REPO / "tests" / "_ft_toy.py"),
           "--out", str(out), *launcher, "--", "--steps", str(STEPS), "--interval", str(INTERVAL),
           "--dump", str(out / "dump"), *extra_trainer]
    e = dict(os.environ, PYTHONPATH=str(REPO), **(env or {}))
    return subprocess.Popen(cmd, env=e, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _finish(p: subprocess.Popen, out: Path, timeout: float = 400.0) -> list[dict]:
    stdout, _ = p.communicate(timeout=timeout)
    assert p.returncode == 0, stdout[-4000:]
    return [json.loads(line) for line in (out / "launcher.jsonl").read_text().splitlines()]


def _assert_same(out: Path, reference: dict[str, torch.Tensor]) -> None:
    got = toy.assemble(toy.load_dumps(out / "dump"))
    assert got.keys() == reference.keys()
    for k, v in reference.items():
        assert torch.equal(got[k], v), k


def test_nan_on_one_host_is_caught_and_the_host_replaced(tmp_path: Path, reference) -> None:
    out = tmp_path / "run"
    p = _launch(out, env={fault.NAN_ENV: "step=5,host=h1"})
    ev = _finish(p, out)
    fail = [e for e in ev if e["event"] == "failure"]
    assert len(fail) == 1 and (fail[0]["kind"], fail[0]["hosts"], fail[0]["rank"]) == ("soft", ["h1"], 1)
    (rec,) = fault.read_failures(out)
    assert (rec["host"], rec["rank"], rec["step"]) == ("h1", 1, 5)
    assert [e["hosts"] for e in ev if e["event"] == "start"] == [["h0", "h1"], ["h0", "h2"]]
    _assert_same(out, reference)


def test_hung_rank_is_detected_by_heartbeat_and_replaced(tmp_path: Path, reference) -> None:
    out = tmp_path / "run"
    p = _launch(out, env={fault.HANG_ENV: "step=3,host=h0"}, launcher=("--heartbeat-timeout", "4"))
    ev = _finish(p, out)
    fail = [e for e in ev if e["event"] == "failure"]
    assert len(fail) == 1 and (fail[0]["kind"], fail[0]["hosts"], fail[0]["rank"]) == ("hang", ["h0"], 0)
    assert [e["hosts"] for e in ev if e["event"] == "start"] == [["h0", "h1"], ["h2", "h1"]]
    _assert_same(out, reference)
