"""Soft-failure detection, fault-injection hooks and heartbeats. (The launcher's decisions:
test_elastic_rules.py; the multi-node drills: test_elastic_drills.py.)"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

import _ft_toy as toy
from trainer.ft import fault


# ============================================================================ detection (one process)
@pytest.mark.parametrize("loss,grads,expected", [
    (1.0, [torch.ones(3)], None),                                      # all finite
    (float("nan"), [torch.ones(3)], "loss"),                           # NaN loss
    (torch.tensor(2.0), [torch.tensor([1.0, float("inf")])], "gradients"),  # Inf in one gradient
    (float("-inf"), [torch.tensor([float("nan")])], "loss and gradients"),  # both
    (None, [], None),                                                  # nothing to check
    (1.0, [None, torch.zeros(0)], None),                               # missing and empty gradients
    (torch.tensor(1.0, dtype=torch.bfloat16), [torch.full((2,), float("nan"), dtype=torch.bfloat16)], "gradients"),  # bf16
    (1.0, [torch.tensor([3e38, 3e38])], "gradients"),                  # finite, but the sum overflows fp32
    (1.0, [torch.tensor([3e38, -3e38, 1.0])], None),                   # large values that cancel are fine
    (1.0, [torch.full((70000,), 1e-3, dtype=torch.bfloat16)], None),   # bf16 summed in fp32 (no bf16 overflow)
])
def test_local_nonfinite(loss, grads, expected) -> None:
    assert fault.local_nonfinite(loss, grads) == expected


@pytest.mark.parametrize("spec,step,rank,host,hits", [
    ("step=5", 5, 3, "h9", True),               # no filter: every rank at that step
    ("step=5", 4, 0, "h0", False),              # another step
    ("step=5,rank=1", 5, 1, "h0", True),        # rank filter
    ("step=5,rank=1", 5, 0, "h0", False),
    ("step=2,host=h1", 2, 0, "h1", True),       # host filter follows the machine, not the rank
    ("step=2,host=h1", 2, 0, "h2", False),      # ... so the spare that replaces h1 is not hit
    (" step=2 , rank=0 , host=h0 ", 2, 0, "h0", True),  # whitespace
])
def test_injection_spec(monkeypatch, spec: str, step: int, rank: int, host: str, hits: bool) -> None:
    monkeypatch.setenv(fault.HOST_ENV, host)
    assert fault.Injection.parse(spec).hits(step, rank) is hits


def test_injection_armed_from_a_file(tmp_path, monkeypatch) -> None:
    spec = tmp_path / "nan.spec"
    monkeypatch.setenv(fault.NAN_ENV, f"@{spec}")
    assert fault.Injection.from_env(fault.NAN_ENV) is None  # not armed yet
    spec.write_text("step=7,rank=1\n")
    inj = fault.Injection.from_env(fault.NAN_ENV)
    assert inj is not None and inj.hits(7, 1) and not inj.hits(7, 0)


@pytest.mark.parametrize("spec", ["rank=1", "step=x", "step=1,colour=red", "step"])
def test_injection_spec_errors(spec: str) -> None:
    with pytest.raises(ValueError):
        fault.Injection.parse(spec)


def test_poison_is_off_by_default_and_makes_gradients_nan(monkeypatch) -> None:
    monkeypatch.delenv(fault.NAN_ENV, raising=False)
    w = torch.ones(3, requires_grad=True)
    loss = fault.maybe_poison((w * 2).sum(), step=0, rank=0)
    assert torch.isfinite(loss)
    monkeypatch.setenv(fault.NAN_ENV, "step=0")
    loss = fault.maybe_poison((w * 2).sum(), step=0, rank=0)
    loss.backward()
    assert torch.isnan(loss) and torch.isnan(w.grad).all()
    # after backward (any schedule): the gradient buffers are poisoned in place
    g = torch.ones(4)
    assert torch.isnan(fault.maybe_poison(torch.tensor(1.0), 0, 0, [g])) and torch.isnan(g).all()
    assert torch.equal(fault.maybe_poison(torch.tensor(1.0), 1, 0, [g.fill_(1.0)]), torch.tensor(1.0))
    assert torch.equal(g, torch.ones(4))


def test_check_step_single_process_records_and_raises(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv(fault.HOST_ENV, "node7")
    fault.check_step(3, torch.tensor(1.0), [torch.ones(2)], out_dir=tmp_path)
    assert fault.read_failures(tmp_path) == []
    with pytest.raises(fault.SoftFailure, match="step 4 on rank"):
        fault.check_step(4, torch.tensor(float("nan")), [torch.ones(2)], out_dir=tmp_path)
    (rec,) = fault.read_failures(tmp_path)
    assert (rec["step"], rec["rank"], rec["host"], rec["what"], rec["loss"]) == (4, 0, "node7", "loss", "nan")


def test_heartbeat_files(tmp_path: Path) -> None:
    hb = fault.Heartbeat(tmp_path, rank=3)
    hb.beat(0, "startup")
    hb.beat(1, "done", completed=True)
    beats = fault.read_heartbeats(tmp_path)
    assert set(beats) == {3}
    assert (beats[3]["step"], beats[3]["phase"], beats[3]["new_steps"]) == (1, "done", 1)
    assert beats[3]["mtime"] > 0
    # the end point of a recovery: a step done by a process started after the fault
    assert fault.first_new_step(tmp_path, beats[3]["started"] - 1) == beats[3]["mtime"]
    assert fault.first_new_step(tmp_path, beats[3]["started"] + 1) is None


# ============================================================================ two ranks on gloo
def test_nan_on_one_rank_stops_every_rank_before_the_update(tmp_path: Path) -> None:
    """Rank 1's loss turns NaN at step 2 (the third step): both ranks exit with the soft-failure
    code, rank 1 alone is recorded, and the weights and optimizer states at exit equal those the
    step-2 checkpoint holds, i.e. the bad step changed nothing."""
    run = tmp_path / "run"
    codes = toy.spawn(2, ["--out", str(run), "--steps", "4", "--interval", "2", "--dump", str(run / "dump")],
                      env={fault.NAN_ENV: "step=2,rank=1", fault.HOST_ENV: "hostX"})
    assert codes == [fault.EXIT_SOFT_FAILURE] * 2, (run / "spawn-rank-0.log").read_text()[-2000:]
    (rec,) = fault.read_failures(run)
    assert (rec["step"], rec["rank"], rec["host"], rec["what"]) == (2, 1, "hostX", "loss and gradients")
    got = toy.assemble(toy.load_dumps(run / "dump"))
    want = toy.read_checkpoint(run / "checkpoints" / "slot-A")
    assert got.keys() == want.keys()
    for k in want:
        assert torch.equal(got[k], want[k]), k


def test_soak_summary_counts_redone_steps_and_wall_lost() -> None:
    """The fault soak's figures from its records (trainer/ft/soak.py): steps redone = the step
    reached at the fault - the step resumed from; wall lost = fault -> back at that step, and what
    of it is not the redone steps; goodput = (wall under faults - wall lost) / wall under faults."""
    from trainer.ft.soak import summarize

    ref = {"wall_s": 100.0, "timeline": [(20.0, 0), (30.0, 50), (40.0, 100)]}  # 0.2 s a step
    soak = {"wall_s": 125.0, "faults": [
        {"kind": "rank", "t": 1000.0, "t_rel": 30.0, "step": 47, "first_new_t": 1012.0, "back_t": 1013.5,
         "resumed_from": 40},
        {"kind": "hang", "t": 2000.0, "t_rel": 60.0, "step": 80, "first_new_t": None, "back_t": None}]}
    s = summarize(ref, soak)
    assert s["step_s"] == pytest.approx(0.2) and s["reference_over_soak"] == pytest.approx(0.8)
    assert s["goodput"] == pytest.approx((125.0 - 13.5) / 125.0)  # the hang was never recovered: no figure
    rank, hang = s["rows"]
    assert (rank["redone"], rank["first_new_step_s"], rank["lost_s"]) == (7, 12.0, 13.5)
    assert rank["lost_beyond_redone_s"] == pytest.approx(13.5 - 7 * 0.2, abs=0.05) and rank["survived"]
    assert not hang["survived"] and hang["lost_s"] is None and s["survived"] == 1 and s["faults"] == 2
