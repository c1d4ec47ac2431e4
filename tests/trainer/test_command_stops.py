"""Every command stops in one line and leaves no partial output: SIGINT at several moments of
``fastmoe-export`` and ``fastmoe-preprocess`` (early, mid-write, at the rename), an ``--overwrite``
target intact; and a full disk under an export, a data set and the metrics said in one line with
"space", the path and the byte counts. In-process: the signal is sent to this process from inside
the command at the chosen moment, as a Ctrl-C landing there would be."""
from __future__ import annotations

import errno
import json
import os
import re
import signal
from pathlib import Path

import pytest

import trainer.owned as owned
from trainer_util import data_cache, one_thread, small_cfg  # noqa: F401 (fixtures)
from trainer.data.preprocess import main as preprocess_main
from trainer.outputs.export import main as export_main
from trainer.trainer import Trainer
from tree_util import snapshot


def _interrupt_in(monkeypatch, obj, name: str, *, after: bool = False, sig: int = signal.SIGINT) -> None:
    """``obj.name`` sends ``sig`` to this process when first called (``after``: once it returned)."""
    real = getattr(obj, name)
    sent = []

    def wrapper(*a, **k):
        if not sent and not after:
            sent.append(1)
            os.kill(os.getpid(), sig)
        out = real(*a, **k)
        if not sent and after:
            sent.append(1)
            os.kill(os.getpid(), sig)
        return out

    monkeypatch.setattr(obj, name, wrapper)


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory, data_cache):  # noqa: F811
    run = tmp_path_factory.mktemp("stops") / "run"
    Trainer(small_cfg(data_cache, str(run), steps=2, eval__enabled=False)).fit()
    return run


def _one_stop_line(capsys, code: int, prog: str) -> str:
    err = capsys.readouterr().err.strip()
    assert code == 130, (code, err)
    lines = err.splitlines()
    assert len(lines) == 1 and "Traceback" not in err and lines[0].startswith(f"{prog}: stopped (SIGINT); "), err
    return lines[0]


@pytest.mark.parametrize("moment", ["early", "mid-write", "at the rename"])
@pytest.mark.parametrize("overwrite", [False, True])
def test_sigint_during_export_is_one_line_and_leaves_no_partial_output(run_dir, tmp_path, monkeypatch, capsys,
                                                                       moment, overwrite):
    import safetensors.torch

    import trainer.outputs.export as export

    out = tmp_path / "hf"
    if overwrite:
        assert export_main(["--checkpoint", str(run_dir), "--out", str(out), "--no-progress"]) == 0
    capsys.readouterr()
    before = snapshot(tmp_path, dirs=True)
    if moment == "early":  # reading the checkpoint's first weight
        _interrupt_in(monkeypatch, export._Reader, "read")
    elif moment == "mid-write":  # a weights file half written
        _interrupt_in(monkeypatch, safetensors.torch, "save_file", after=True)
    else:  # the output complete in its staging directory, about to be moved to --out
        _interrupt_in(monkeypatch, export, "replace_dir")
    args = ["--checkpoint", str(run_dir), "--out", str(out), "--no-progress", *(["--overwrite"] if overwrite else [])]
    line = _one_stop_line(capsys, export_main(args), "fastmoe-export")
    assert "nothing was written to --out" in line, line
    assert snapshot(tmp_path, dirs=True) == before  # no staging folder, no lease; an earlier export intact


def test_a_stop_during_the_rename_waits_for_it_and_says_the_export_finished(run_dir, tmp_path, monkeypatch, capsys):
    """Inside the two renames that swap an earlier export for the new one the signal waits: --out
    holds the old export or the new one, never neither."""
    out = tmp_path / "hf"
    assert export_main(["--checkpoint", str(run_dir), "--out", str(out), "--no-progress"]) == 0
    capsys.readouterr()
    _interrupt_in(monkeypatch, owned, "check_replace")  # inside the renames: the last check of --out
    code = export_main(["--checkpoint", str(run_dir), "--out", str(out), "--no-progress", "--overwrite"])
    line = _one_stop_line(capsys, code, "fastmoe-export")
    assert f"the export had finished: --out {out} holds it" in line
    assert (out / owned.MARKER).is_file() and sorted(p.name for p in tmp_path.iterdir()) == ["hf"]


def test_a_full_disk_during_export_is_one_line_with_the_bytes(run_dir, tmp_path, monkeypatch, capsys):
    import safetensors.torch

    def full(tensors, path, metadata=None):
        Path(path).write_bytes(b"\0" * 10)
        raise OSError(errno.ENOSPC, "No space left on device", path)

    monkeypatch.setattr(safetensors.torch, "save_file", full)
    before = snapshot(tmp_path, dirs=True)
    code = export_main(["--checkpoint", str(run_dir), "--out", str(tmp_path / "hf"), "--no-progress"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1, err
    assert "out of disk space writing" in err and ".hf.exporting" in err and "bytes" in err and "are free" in err, err
    assert snapshot(tmp_path, dirs=True) == before


def _corpus(tmp_path: Path) -> Path:
    src = tmp_path / "corpus.txt"
    src.write_text("a few words of a small corpus, again and again. " * 400)
    return src


@pytest.mark.parametrize("moment", ["early", "mid-write", "at the rename"])
def test_sigint_during_preprocessing_is_one_line_and_leaves_no_partial_output(tmp_path, monkeypatch, capsys, moment):
    import numpy as np

    import trainer.data.build as build

    src = _corpus(tmp_path)
    out = tmp_path / "data"
    assert preprocess_main(["--input", str(src), "--context", "8", "--out", str(out), "--quiet"]) == 0
    capsys.readouterr()
    before = snapshot(tmp_path)  # the files (the staging folder made and removed in --out moves its time)
    if moment == "early":  # tokenizing
        _interrupt_in(monkeypatch, build, "_tokenize")
    elif moment == "mid-write":  # a shard half written
        _interrupt_in(monkeypatch, np.lib.format, "open_memmap", after=True)
    else:  # the new data set complete in staging: the earlier one's files about to be replaced
        _interrupt_in(monkeypatch, build, "_clear_previous")
    code = preprocess_main(["--input", str(src), "--context", "8", "--out", str(out), "--quiet", "--overwrite",
                            "--seed", "3"])
    line = _one_stop_line(capsys, code, "fastmoe-preprocess")
    assert not [p for p in out.iterdir() if p.name.startswith(".staging")]
    if moment == "at the rename":  # the move-in is not cut: the stop waits for it, and says so
        assert f"the data set had finished: --out {out} holds it" in line
        assert json.loads((out / "manifest.json").read_text())["seed"] == 3 and (out / owned.MARKER).is_file()
    else:
        assert "nothing was written to --out" in line
        assert snapshot(tmp_path) == before  # the earlier data set as it was


def test_a_full_disk_during_preprocessing_is_one_line_with_the_bytes(tmp_path, monkeypatch, capsys):
    import numpy as np

    def full(path, *a, **k):
        raise OSError(errno.ENOSPC, "No space left on device", str(path))

    monkeypatch.setattr(np.lib.format, "open_memmap", full)
    src = _corpus(tmp_path)
    code = preprocess_main(["--input", str(src), "--context", "8", "--out", str(tmp_path / "data"), "--quiet"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1, err
    assert "out of disk space writing" in err and "it needs up to" in err and "are free" in err, err
    assert list((tmp_path / "data").iterdir()) == []  # no staging folder left


def test_a_full_disk_under_the_metrics_stops_the_run_in_one_line(data_cache, tmp_path, monkeypatch, capsys):  # noqa: F811
    from trainer.ft.space import OutOfSpace
    from trainer.records import metrics

    real = metrics.MetricsWriter.write
    calls = []

    class Full:
        def write(self, text):
            raise OSError(errno.ENOSPC, "No space left on device")

        def close(self):
            pass

    def write(self, record):
        calls.append(1)
        if len(calls) == 2:  # the disk fills after the first record
            self._f.close()
            self._f = Full()
        real(self, record)

    monkeypatch.setattr(metrics.MetricsWriter, "write", write)
    t = Trainer(small_cfg(data_cache, str(tmp_path / "run"), steps=3, eval__enabled=False))
    with pytest.raises(OutOfSpace) as e:  # fastmoe-train: one line, exit 76 (trainer/cli.py)
        t.fit()
    msg = str(e.value)
    assert "out of disk space writing" in msg and "metrics.jsonl" in msg and "are free" in msg and "\n" not in msg
    assert json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[0])["step"] == 1


@pytest.fixture
def small_disk(tmp_path):
    """A 12 MB tmpfs (one full checkpoint of tiny-moe fits, two do not); skipped where this user
    cannot mount one."""
    import subprocess

    disk = tmp_path / "disk"
    disk.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=12m", "tmpfs", str(disk)], capture_output=True).returncode:
        pytest.skip("cannot mount a tmpfs here (not root, or no mount permission)")
    try:
        yield disk
    finally:
        subprocess.run(["umount", "-l", str(disk)], capture_output=True, timeout=60)


def test_a_checkpoint_into_a_full_file_system_is_one_line_and_the_previous_slot_loads(small_disk, data_cache, tmp_path,
                                                                                      capsys):  # noqa: F811
    from trainer.checkpoint.slots import latest_valid
    from trainer.cli import main

    run = small_disk / "run"
    argv = ["--preset", "tiny-moe", "--steps", "6", "--context", "16", "--global-batch", "4", "--micro-batch", "2",
            "--data.cache_dir", data_cache, "--no-logging.tensorboard", "--no-logging.plot", "--no-logging.progress",
            "--logging.peak_tflops", "1", "--no-eval.enabled", "--checkpoint.interval", "2"]
    code = main([*argv, "--out", str(run)])
    cap = capsys.readouterr()
    assert code == 76, cap.err
    # said at the start, once: two slots do not fit
    assert len([ln for ln in cap.out.splitlines() if "the two full checkpoint slots of this run take" in ln]) == 1
    err = cap.err.strip().splitlines()
    assert len(err) == 1 and "Traceback" not in cap.err, cap.err
    assert "could not write the full checkpoint of step 4" in err[0] and "out of disk space writing" in err[0]
    assert re.search(r"it needs [\d,]+ bytes .*, [\d,]+ bytes .* are free there", err[0]), err[0]
    assert "slot-A (step 2) is untouched" in err[0], err[0]
    assert latest_valid(run / "checkpoints").step == 2  # checksums verified
    # and it loads: another run resumes from it
    other = main([*argv, "--steps", "3", "--reschedule", "--out", str(tmp_path / "other"), "--checkpoint.interval", "0",
                  "--checkpoint.resume_from", str(run)])
    assert other == 0 and f"resumed from {run / 'checkpoints' / 'slot-A'} at step 2" in capsys.readouterr().out


def test_an_export_of_a_slot_the_run_rewrites_meanwhile_is_refused(run_dir, tmp_path, monkeypatch, capsys):
    """A run rewriting the slot being exported (it removes the slot's manifest first) is noticed
    before anything is moved to --out."""
    import shutil

    import trainer.outputs.export as export

    run = tmp_path / "run"
    shutil.copytree(run_dir, run)
    slot = run / "checkpoints" / "slot-A"
    real = export._Reader.read

    def read(self, key):
        (slot / "MANIFEST.json").unlink(missing_ok=True)  # the run starts to rewrite this slot
        return real(self, key)

    monkeypatch.setattr(export._Reader, "read", read)
    code = export_main(["--checkpoint", str(slot), "--out", str(tmp_path / "hf"), "--no-progress"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and err == (f"error: {slot} was rewritten while the export read it (the run that writes it went "
                                 f"on to its next checkpoint): export again, or export a slot the run is done with")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]
