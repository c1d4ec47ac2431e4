"""Learning-rate schedules: cosine (unchanged), linear and warmup-stable-decay (WSD) at chosen steps
computed by hand; bad options refused in one line before any work; which resumes on another
schedule need --checkpoint.reschedule; a decay branch from another run's stable-phase checkpoint
that leaves that run's directory byte-identical; the learning rate on the loss chart; the header."""
from __future__ import annotations

import json
import math

import pytest

from trainer.checkpoint.slots import latest_valid
from trainer.cli import config_from_args, main
from trainer.config import ConfigError, validate
from trainer.config.presets import get_preset
from trainer.optim.schedule import Schedule, check_resume, lr_at
from trainer.records.metrics import loss_figure, read_metrics
from trainer.trainer import Trainer
from trainer_util import data_cache, one_thread, small_cfg  # noqa: F401 (fixtures)
from tree_util import snapshot


def schedule(kind: str, steps: int = 10, warmup: int = 2, peak: float = 1.0, minimum: float = 0.1, **wsd) -> Schedule:
    """The validated schedule of ``tiny-moe`` with these values (``wsd``: the decay_* fields)."""
    cfg = get_preset("tiny-moe")
    s = cfg.schedule
    s.kind, s.steps, s.warmup_steps, s.min_lr = kind, steps, warmup, minimum
    cfg.optim.lr = peak
    for name, value in wsd.items():
        setattr(s, name, value)
    validate(cfg)
    return Schedule(s, peak)


# ------------------------------------------------------------------------------ the rates
def test_cosine_is_the_default_and_unchanged():
    assert get_preset("tiny-moe").schedule.kind == "cosine"
    sch = schedule("cosine", steps=300, warmup=30, peak=4e-4, minimum=4e-5)
    assert all(sch.lr(k) == lr_at(k, peak=4e-4, minimum=4e-5, warmup=30, total=300) for k in range(320))


def test_linear_by_hand():
    sch = schedule("linear", steps=12)  # 9 steps from the warmup's end (step 2) to the last (11)
    assert [sch.lr(k) for k in (0, 1, 2)] == [0.5, 1.0, 1.0]
    assert sch.lr(5) == pytest.approx(1.0 - 0.9 * 3 / 9) and sch.lr(5) == pytest.approx(0.7)
    assert sch.lr(11) == pytest.approx(0.1) and sch.lr(15) == pytest.approx(0.1)


@pytest.mark.parametrize("shape, decaying", [
    ("linear", [0.775, 0.55, 0.325, 0.1]),
    ("cosine", [0.1 + 0.9 * (1 + math.cos(math.pi / 4)) / 2, 0.55, 0.1 + 0.9 * (1 + math.cos(3 * math.pi / 4)) / 2,
                0.1]),
    ("1-sqrt", [0.55, 0.1 + 0.9 * (1 - math.sqrt(0.5)), 0.1 + 0.9 * (1 - math.sqrt(0.75)), 0.1]),
])
def test_wsd_by_hand(shape, decaying):
    """10 steps, warmup 2, decay 4: warmup 0.5, 1.0; stable (steps 2-5) at the peak; the decay's
    first step already below it, its last at the minimum."""
    sch = schedule("wsd", decay_steps=4, decay_shape=shape)
    assert (sch.decay_start, sch.decay_steps) == (6, 4)
    assert [sch.lr(k) for k in range(6)] == [0.5, 1.0, 1.0, 1.0, 1.0, 1.0]
    assert [sch.lr(k) for k in range(6, 10)] == pytest.approx(decaying)
    assert decaying[1] == pytest.approx({"linear": 0.55, "cosine": 0.55, "1-sqrt": 0.363604}[shape], abs=1e-6)


def test_wsd_decay_length_from_a_fraction_and_a_branch_total():
    default = schedule("wsd")  # a fifth of 10 steps
    assert (default.decay_start, default.decay_steps) == (8, 2)
    assert [default.lr(k) for k in (7, 8, 9)] == pytest.approx([1.0, 0.55, 0.1])
    half = schedule("wsd", decay_fraction=0.5)
    assert (half.decay_start, half.decay_steps) == (5, 5) and half.lr(5) == pytest.approx(0.82)
    # a decay branch: --steps 0 (the CLI's "not given") is decay_from plus the decay
    branch = schedule("wsd", steps=0, decay_from=40, decay_steps=10)
    assert (branch.total, branch.decay_start, branch.decay_steps) == (50, 40, 10)
    assert branch.lr(39) == 1.0 and branch.lr(40) == pytest.approx(0.91) and branch.lr(49) == pytest.approx(0.1)
    by_fraction = schedule("wsd", steps=0, decay_from=40)  # the decay is 0.2 of the branch's 50 steps
    assert (by_fraction.total, by_fraction.decay_steps) == (50, 10)
    longer = schedule("wsd", steps=60, decay_from=40, decay_steps=10)  # then the minimum to the end
    assert longer.lr(49) == pytest.approx(0.1) and longer.lr(59) == pytest.approx(0.1)


def test_the_cli_derives_a_branchs_steps_unless_given():
    assert config_from_args(["--schedule.kind", "wsd", "--schedule.decay_from", "40"])[0].schedule.steps == 0
    assert config_from_args(["--schedule.kind", "wsd", "--schedule.decay_from", "40", "--steps", "70"])[
        0].schedule.steps == 70


# ------------------------------------------------------------------------------ refusals
@pytest.mark.parametrize("argv, message", [
    (["--schedule.kind", "step"], "--schedule.kind must be one of ['cosine', 'linear', 'wsd'], got 'step'"),
    (["--schedule.kind", "wsd", "--schedule.decay_shape", "exp"],
     "--schedule.decay_shape must be one of ['linear', 'cosine', '1-sqrt'], got 'exp'"),
    (["--schedule.kind", "wsd", "--schedule.decay_steps", "5", "--schedule.decay_fraction", "0.1"],
     "give the decay's length once: --schedule.decay_steps 5 or --schedule.decay_fraction 0.1, not both"),
    (["--schedule.kind", "wsd", "--schedule.decay_fraction", "1.5"], "--schedule.decay_fraction must lie in (0, 1)"),
    (["--schedule.kind", "wsd", "--schedule.decay_steps", "0"], "--schedule.decay_steps must be >= 1, got 0"),
    (["--schedule.decay_from", "100"], "--schedule.decay_from is for --schedule.kind wsd, the kind is 'cosine'"),
    (["--schedule.kind", "wsd", "--schedule.decay_steps", "290"],
     "the WSD decay starts at step 11, inside the warmup (30 steps)"),
    (["--schedule.kind", "wsd", "--schedule.decay_steps", "400"], "the decay (400 steps) is longer than the run"),
    (["--schedule.kind", "wsd", "--schedule.decay_from", "100", "--steps", "100"],
     "--schedule.decay_from 100 leaves no step of --steps 100 to decay"),
    (["--schedule.kind", "wsd", "--schedule.decay_from", "100", "--steps", "120", "--schedule.decay_steps", "30"],
     "the decay (steps 101-130) must end within --steps 120"),
    (["--resume-from", "/nonexistent/slot-A"], "--checkpoint.resume_from /nonexistent/slot-A does not exist"),
])
def test_bad_schedules_are_refused_in_one_line(argv, message, capsys, tmp_path):
    assert main([*argv, "--out", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and message in err, err
    assert not (tmp_path / "run").exists()  # before any work


def test_a_branch_needs_an_out_of_its_own(tmp_path, capsys):
    (tmp_path / "main" / "checkpoints" / "slot-A").mkdir(parents=True)
    argv = ["--schedule.kind", "wsd", "--schedule.decay_from", "100", "--resume-from",
            str(tmp_path / "main" / "checkpoints" / "slot-A"), "--out", str(tmp_path / "main")]
    assert main(argv) == 2
    assert "overlap: a run started from another run's checkpoint writes in an --out of its own" in \
        capsys.readouterr().err


# ------------------------------------------------------------------------------ resumes
def _cfg(kind: str = "wsd", steps: int = 10, **over):
    cfg = get_preset("tiny-moe")
    cfg.schedule.kind, cfg.schedule.steps, cfg.schedule.warmup_steps = kind, steps, 2
    for key, value in over.items():
        setattr(cfg.schedule if hasattr(cfg.schedule, key) else cfg.checkpoint, key, value)
    return validate(cfg)


def test_extending_wsd_in_its_stable_phase_needs_no_reschedule():
    saved = _cfg(steps=10).to_dict()  # decay: steps 9-10 (0-based 8, 9)
    line = check_resume(_cfg(steps=20), saved, 8, "ckpt")  # 8 steps taken, all before the decay
    assert line.startswith("schedule: the checkpoint ckpt (step 8) was trained on another schedule "
                           "(--steps 10 -> 20)") and "steps 1-8 had the same rates on both" in line
    assert check_resume(_cfg(steps=10), saved, 8, "ckpt") is None  # the same schedule: nothing to say


def test_extending_wsd_in_its_decay_or_changing_the_cosine_needs_reschedule():
    with pytest.raises(ConfigError, match=r"--steps 10 -> 20.*in its decay \(from step 9\).*--checkpoint.reschedule"):
        check_resume(_cfg(steps=20), _cfg(steps=10).to_dict(), 9, "ckpt")
    with pytest.raises(ConfigError, match=r"--steps 10 -> 20.*--checkpoint.reschedule"):
        check_resume(_cfg("cosine", steps=20), _cfg("cosine", steps=10).to_dict(), 5, "ckpt")
    line = check_resume(_cfg("cosine", steps=20, reschedule=True), _cfg("cosine", steps=10).to_dict(), 5, "ckpt")
    assert line.startswith("warning: ")


def test_a_branch_starts_from_a_stable_phase_checkpoint_only():
    saved = _cfg(steps=100).to_dict()  # decay from step 81
    assert "steps 1-40 had the same rates" in check_resume(_cfg(steps=0, decay_from=40, decay_steps=10), saved, 40, "c")
    with pytest.raises(ConfigError, match="--schedule.decay_from None -> 30"):
        check_resume(_cfg(steps=0, decay_from=30, decay_steps=10), saved, 40, "c")  # decays steps it took at the peak
    with pytest.raises(ConfigError, match="in its decay"):
        check_resume(_cfg(steps=0, decay_from=90, decay_steps=10), saved, 90, "c")


def test_a_checkpoint_from_before_the_schedule_kinds_reads_as_cosine():
    saved = _cfg("cosine").to_dict()
    for name in ("kind", "decay_steps", "decay_fraction", "decay_shape", "decay_from"):
        del saved["schedule"][name]
    assert check_resume(_cfg("cosine"), saved, 5, "c") is None
    with pytest.raises(ConfigError, match="--schedule.kind cosine -> wsd"):
        check_resume(_cfg("wsd"), saved, 5, "c")


# ------------------------------------------------------------------------------ a decay branch
def test_a_decay_branch_from_a_stable_checkpoint(tmp_path, data_cache, capsys):  # noqa: F811
    """A WSD run of 8 steps (warmup 2, decay 7-8) with checkpoints at 3 and 6 and the one every run
    keeps at its end (8; the two slots then hold 6 and 8); a branch from the stable step 6 decays over
    3 steps into its own --out; the main run's files stay byte-identical."""
    main_out = tmp_path / "main"
    peak, low = 1e-3, 1e-4
    t = Trainer(small_cfg(data_cache, str(main_out), steps=8, checkpoint__interval=3, schedule__kind="wsd",
                          optim__lr=peak, schedule__min_lr=low, eval__enabled=False))
    trunk = t.fit()
    header = capsys.readouterr().out
    assert "schedule: wsd, warmup steps 1-2, stable at 1.00e-03 steps 3-6, linear decay to 1.00e-04 steps 7-8" \
        in header
    assert [r["lr"] for r in trunk] == pytest.approx([5e-4, 1e-3, 1e-3, 1e-3, 1e-3, 1e-3, 5.5e-4, 1e-4])
    slot = next(p for p in (main_out / "checkpoints").glob("slot-*") if json.loads(
        (p / "meta.json").read_text())["step"] == 6)
    before = snapshot(main_out, dirs=True)

    branch_out = tmp_path / "decay3"
    argv = ["--preset", "tiny-moe", "--context", "16", "--global-batch", "8", "--micro-batch", "2", "--warmup", "2",
            "--optim.grad_clip", "0.5", "--lr", str(peak), "--min-lr", str(low), "--data.cache_dir", data_cache,
            "--schedule.kind", "wsd", "--schedule.decay_from", "6", "--schedule.decay_steps", "3",
            "--resume-from", str(slot), "--out", str(branch_out), "--checkpoint.interval", "1",
            "--no-logging.tensorboard", "--no-logging.progress", "--no-eval.enabled", "--logging.peak_tflops", "1"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert f"resumed from {slot} at step 6" in out
    assert "steps 1-6 had the same rates on both, continuing on the new schedule" in out
    assert "schedule: wsd, warmup steps 1-2, stable at 1.00e-03 steps 3-6, linear decay to 1.00e-04 steps 7-9" in out
    assert snapshot(main_out, dirs=True) == before  # read, never written to

    branch = read_metrics(str(branch_out / "metrics.jsonl"))
    assert [r["step"] for r in branch] == [7, 8, 9]
    assert [r["lr"] for r in branch] == pytest.approx([7e-4, 4e-4, 1e-4])
    # the restored state is the trunk's: step 7's loss (before its update) is the same number
    assert branch[0]["loss"] == pytest.approx(trunk[6]["loss"], rel=1e-6)
    assert branch[1]["loss"] != trunk[7]["loss"]  # the updates since differ in their rate
    assert json.loads((branch_out / "summary.json").read_text())["steps"] == 9
    assert (branch_out / "loss.png").is_file()
    assert latest_valid(branch_out / "checkpoints").step == 9

    # the same command again resumes from the branch's own checkpoint, not from the trunk's
    assert main(argv) == 0
    assert f"resumed from {branch_out / 'checkpoints'}" in capsys.readouterr().out
    assert snapshot(main_out, dirs=True) == before


# ------------------------------------------------------------------------------ the chart
def test_the_loss_chart_carries_the_learning_rate():
    sch = schedule("wsd", decay_steps=4)
    records = [{"step": k + 1, "loss": 5.0 - 0.1 * k, "lr": sch.lr(k)} for k in range(10)]
    fig = loss_figure(records, "run", sch.phases())
    loss_ax, lr_ax = fig.axes
    assert list(loss_ax.get_lines()[0].get_ydata()) == [r["loss"] for r in records]
    assert list(lr_ax.get_lines()[0].get_ydata()) == [r["lr"] for r in records]
    assert lr_ax.get_ylabel() == "learning rate"
    assert "linear decay to 1.00e-01 steps 7-10" in loss_ax.get_title()
    assert "learning rate (right)" in [t.get_text() for t in loss_ax.get_legend().get_texts()]


def test_a_branch_from_a_step_its_source_kept_no_checkpoint_of_says_so(tmp_path):
    """The source run's newest checkpoint is past the branch's step (it kept no checkpoint of it): the
    line says that, not that the schedule changed at the step after the checkpoint."""
    src = tmp_path / "main"
    (src / "checkpoints" / "slot-A").mkdir(parents=True)
    cfg = _cfg(steps=0, decay_from=30, decay_steps=10, resume_from=str(src))
    with pytest.raises(ConfigError) as e:
        check_resume(cfg, _cfg(steps=100).to_dict(), 40, str(src / "checkpoints" / "slot-A"))
    msg = str(e.value)
    assert msg.startswith(f"--schedule.decay_from 30 branches at step 30, and the newest checkpoint {src} holds is "
                          f"{src / 'checkpoints' / 'slot-A'} of step 40") and "--schedule.decay_from 40" in msg, msg
    assert "step 41" not in msg and "reschedule" not in msg, msg
