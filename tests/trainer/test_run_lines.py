"""Lines as they happen: validation losses, checkpoints and schedule phases are printed (and
flushed) at their step, also when stdout is a file; a warning when asynchronous checkpoints cannot
keep up; summary.json says what each of its times measures, and its wall time is the run's."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from trainer_util import data_cache, one_thread, small_cfg  # noqa: F401 (fixtures)
from trainer.trainer import Trainer

REPO = Path(__file__).resolve().parents[2]


def test_validation_checkpoint_and_phase_lines_come_at_their_step(data_cache, tmp_path, capsys):  # noqa: F811
    cfg = small_cfg(data_cache, str(tmp_path / "run"), steps=6, eval__interval=2, eval__instances=16,
                    checkpoint__interval=3, schedule__kind="wsd", schedule__decay_steps=2)
    Trainer(cfg).fit()
    out = capsys.readouterr().out.splitlines()
    for step in (2, 4, 6):
        assert any(re.fullmatch(rf"step {step}: validation loss \d\.\d{{4}} \(perplexity .*, \d+ tokens, .* s\)", ln)
                   for ln in out), out
    ck = [ln for ln in out if re.match(r"step \d: checkpoint ", ln)]
    assert ck[0].startswith(f"step 3: checkpoint {tmp_path / 'run' / 'checkpoints' / 'slot-A'} (") and "stall" in ck[0]
    assert "step 3: warmup over; stable at 3.00e-03 steps 3-4" in out and "step 5: linear decay to 3.00e-04 steps 5-6" \
        in out, out
    # the end-of-run account follows the lines of the steps
    assert out.index(next(ln for ln in out if ln.startswith("step 6: validation loss"))) < \
        out.index(next(ln for ln in out if ln.startswith("validation loss ")))


def test_a_background_write_slower_than_the_interval_warns_once(data_cache, tmp_path, capsys, monkeypatch):  # noqa: F811
    import trainer.checkpoint.save as save

    real = save.FullWrite.write

    def slow(self, group=None):
        time.sleep(1.0)  # the steps of the interval take far less
        return real(self, group)

    monkeypatch.setattr(save.FullWrite, "write", slow)
    cfg = small_cfg(data_cache, str(tmp_path / "run"), steps=4, eval__enabled=False, checkpoint__interval=1,
                    checkpoint__async_save=True)
    Trainer(cfg).fit()
    out = capsys.readouterr().out.splitlines()
    warn = [ln for ln in out if ln.startswith("warning: asynchronous checkpoints cannot keep up")]
    assert len(warn) == 1 and "--checkpoint.interval" in warn[0], out
    assert any(re.match(r"step 2: checkpoint of step 1 written in the background in 1\.\d\d s", ln) for ln in out), out
    assert any(re.match(r"step 1: checkpoint .*slot-A staged \(.* s stall\), written in the background", ln)
               for ln in out), out


def test_summary_names_its_times_and_wall_time_covers_the_stalls(data_cache, tmp_path, monkeypatch):  # noqa: F811
    import trainer.checkpoint.save as save

    real = save.FullWrite.write

    def slow(self, group=None):
        time.sleep(0.3)
        return real(self, group)

    monkeypatch.setattr(save.FullWrite, "write", slow)
    t = Trainer(small_cfg(data_cache, str(tmp_path / "run"), steps=3, checkpoint__interval=1, eval__instances=16))
    t.fit()
    sm = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert set(sm["times"]) >= {"wall_s", "step_time_s", "eval_s", "checkpoint_stall_s", "checkpoint_write_s"}
    assert sm["eval_s"] > 0 and sm["checkpoint_stall_s"] >= 0.9
    assert sm["wall_s"] >= sm["step_time_s"] + sm["checkpoint_stall_s"] + sm["eval_s"]


@pytest.mark.slow
def test_with_stdout_in_a_file_each_validation_line_precedes_the_next_step(tmp_path):
    """A real process whose stdout and stderr go to one file: every validation line is in the file
    before the progress line of the next step."""
    log = tmp_path / "log.txt"
    cmd = [sys.executable, "-m", "trainer", "--preset", "tiny-moe", "--steps", "6", "--context", "16",
           "--global-batch", "4", "--micro-batch", "2", "--data.cache_dir", str(tmp_path / "cache"), "--out",
           str(tmp_path / "run"), "--no-logging.tensorboard", "--no-logging.plot", "--logging.peak_tflops", "1",
           "--eval.interval", "2", "--eval.instances", "8", "--no-eval.samples"]
    with open(log, "w") as f:
        subprocess.run(cmd, cwd=REPO, env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)},
                       stdout=f, stderr=f, timeout=300, check=True)
    lines = log.read_text().splitlines()
    where = {int(m.group(1)): i for i, ln in enumerate(lines) if (m := re.match(r"tiny-moe: step (\d+)/6", ln))}
    for step in (2, 4):
        val = next(i for i, ln in enumerate(lines) if ln.startswith(f"step {step}: validation loss"))
        assert where[step] < val < where[step + 1], lines


def test_help_and_docs_agree_on_asynchronous_checkpoints():
    """--help and docs/fault.md say the same: every layout (FSDP2 and PP included, which the tests
    run), and which last checkpoint is written synchronously."""
    from trainer.cli import build_parser

    text = " ".join(build_parser().format_help().split())
    start = text.index("--no-checkpoint.async ")  # the option's help follows its names
    option = text[start:text.index("--checkpoint.", start + 25)]
    docs = " ".join((REPO / "docs" / "fault.md").read_text().split())
    section = docs[docs.index("**Asynchronous checkpoints.**"):]
    section = section[:section.index("Measured with")]
    assert "not yet" not in option and "FSDP2" in option and "PP" in option, option
    assert "FSDP2" in section and "PP=2" in section, section
    for said in (option, section):
        assert "a last checkpoint no periodic one covers is written synchronously" in said, said
