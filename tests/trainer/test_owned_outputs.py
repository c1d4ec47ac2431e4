"""``--overwrite`` replaces only an output this package wrote there; runs never share an ``--out``;
every run keeps its model; the export says which damaged checkpoint it passed over."""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from trainer_util import data_cache, one_thread  # noqa: F401 (fixtures)
from trainer_util import small_cfg
from trainer.config import ConfigError
from trainer.data.preprocess import main as preprocess_main
from trainer.outputs.export import main as export_main
from trainer.owned import MARKER
from trainer.trainer import Trainer
from tree_util import snapshot


def _export(capsys, *args: str) -> tuple[int, str]:
    capsys.readouterr()
    code = export_main([*args, "--no-progress"])
    return code, capsys.readouterr().err.strip()


def _refused(capsys, root: Path, *args: str) -> str:
    """Runs the export, which must refuse in one line (exit 2) and leave every file under ``root`` as it was."""
    before = snapshot(root, dirs=True)
    code, err = _export(capsys, *args)
    assert code == 2 and len(err.splitlines()) == 1 and err.startswith("error: ") and "Traceback" not in err, err
    assert snapshot(root, dirs=True) == before
    return err


def test_export_replaces_only_an_earlier_export(data_cache, tmp_path, capsys):
    run = tmp_path / "run"
    t = Trainer(small_cfg(data_cache, str(run), steps=2, eval__enabled=False))
    t.fit()
    ckpt = run / "checkpoints"
    # no periodic checkpoint asked for: the end of the run kept one all the same
    assert (ckpt / "slot-A" / "MANIFEST.json").is_file() and t.artefacts["checkpoint"] == str(ckpt / "slot-A")
    # the run's own directory, the checkpoint root being read, a directory of someone else's files
    err = _refused(capsys, tmp_path, "--checkpoint", str(ckpt), "--out", str(run), "--overwrite")
    assert err.startswith(f"error: --out {run} holds a training run (") and "give a new or empty directory" in err
    err = _refused(capsys, tmp_path, "--checkpoint", str(ckpt), "--out", str(ckpt), "--overwrite")
    assert f"--out {ckpt} holds a checkpoint (slot-A/" in err
    project = tmp_path / "project"
    project.mkdir()
    (project / "main.py").write_text("print('mine')\n")
    err = _refused(capsys, tmp_path, "--checkpoint", str(ckpt), "--out", str(project), "--overwrite")
    assert "holds 1 file(s) that are not of a transformers export this package wrote (main.py)" in err
    # a file: said once, with or without --overwrite
    afile = tmp_path / "afile"
    afile.write_text("x")
    for extra in ((), ("--overwrite",)):
        err = _refused(capsys, tmp_path, "--checkpoint", str(ckpt), "--out", str(afile), *extra)
        assert err == f"error: --out {afile} is a file, not a directory; give a directory path"
    # an earlier export is replaced with --overwrite (the run's directory as --checkpoint finds its checkpoints)
    hf = tmp_path / "hf"
    assert _export(capsys, "--checkpoint", str(run), "--out", str(hf))[0] == 0
    marker = json.loads((hf / MARKER).read_text())
    assert marker["kind"] == "transformers export" and "model.safetensors" in marker["files"]
    err = _refused(capsys, tmp_path, "--checkpoint", str(run), "--out", str(hf))
    assert err == f"error: output directory {hf} exists; pass --overwrite to replace it"
    assert _export(capsys, "--checkpoint", str(run), "--out", str(hf), "--overwrite")[0] == 0
    # ... but not once something else lies in it
    (hf / "notes.txt").write_text("keep me")
    err = _refused(capsys, tmp_path, "--checkpoint", str(run), "--out", str(hf), "--overwrite")
    assert "holds 1 file(s) that are not of a transformers export this package wrote (notes.txt)" in err


def test_export_names_the_damaged_slot_it_skipped_and_what_an_empty_run_lacks(data_cache, tmp_path, capsys):
    run = tmp_path / "run"
    Trainer(small_cfg(data_cache, str(run), steps=2, checkpoint__interval=1, eval__enabled=False)).fit()
    root = run / "checkpoints"
    (root / "slot-B" / "MANIFEST.json").unlink()  # the newest (step 2)
    code, err = _export(capsys, "--checkpoint", str(root), "--out", str(tmp_path / "hf"))
    assert code == 0
    assert err == (f"checkpoint: skipped damaged {root / 'slot-B'}: {root / 'slot-B' / 'MANIFEST.json'} is missing "
                   f"(the write did not finish); exporting slot-A (step 1)"), err
    # a run directory without any checkpoint: what was looked for, and how to get one
    empty = tmp_path / "empty"
    (empty / "checkpoints").mkdir(parents=True)
    err = _refused(capsys, tmp_path, "--checkpoint", str(empty), "--out", str(tmp_path / "hf2"))
    assert err.startswith(f"error: no checkpoint under {empty / 'checkpoints'} (looked for slot-A, slot-B and "
                          "model-step-* directories there)") and "--checkpoint.interval N" in err
    err = _refused(capsys, tmp_path, "--checkpoint", str(tmp_path / "nothing"), "--out", str(tmp_path / "hf2"))
    assert err.startswith(f"error: checkpoint {tmp_path / 'nothing'} does not exist; give a run's directory")


def test_an_export_over_the_run_is_refused_before_any_work(data_cache, tmp_path):
    run = tmp_path / "run"
    Trainer(small_cfg(data_cache, str(run), steps=1, eval__enabled=False)).fit()
    before = snapshot(tmp_path, dirs=True)
    for target in (run, tmp_path, run / "checkpoints"):
        with pytest.raises(ConfigError, match=f"--eval.export_hf {target} is or holds the run's "):
            Trainer(small_cfg(data_cache, str(run), steps=1, eval__enabled=False, eval__export_hf=str(target),
                              eval__overwrite=True))
    assert snapshot(tmp_path, dirs=True) == before


def test_another_run_is_refused_and_the_same_run_resumes_its_records(data_cache, tmp_path, capsys):
    run = tmp_path / "run"
    Trainer(small_cfg(data_cache, str(run), steps=2, eval__enabled=False)).fit()
    metrics = run / "metrics.jsonl"
    assert [json.loads(line)["step"] for line in metrics.read_text().splitlines()] == [1, 2]
    before = snapshot(tmp_path, dirs=True)
    with pytest.raises(ConfigError, match=r"--out .* holds another run \(.*run\.json: --seed 0 -> 1\); give this "
                                          r"run a fresh --out, or that run's configuration to resume it"):
        Trainer(dataclasses.replace(small_cfg(data_cache, str(run), steps=2, eval__enabled=False), seed=1))
    with pytest.raises(ConfigError, match="--model.num_layers"):
        Trainer(small_cfg(data_cache, str(run), "small-moe", steps=2, eval__enabled=False))
    assert snapshot(tmp_path, dirs=True) == before
    # the same configuration again: complete already, its records kept
    capsys.readouterr()
    Trainer(small_cfg(data_cache, str(run), steps=2, eval__enabled=False)).fit()
    assert f"{run}: already complete at step 2; nothing to train" in capsys.readouterr().out
    assert [json.loads(line)["step"] for line in metrics.read_text().splitlines()] == [1, 2]
    # a longer schedule on the same run continues it (and its records)
    Trainer(small_cfg(data_cache, str(run), steps=3, eval__enabled=False, checkpoint__reschedule=True)).fit()
    assert [json.loads(line)["step"] for line in metrics.read_text().splitlines()] == [1, 2, 3]


def test_preprocess_overwrite_replaces_only_its_own_data_set(tmp_path, capsys):
    (tmp_path / "a.txt").write_text("first corpus text. " * 60)
    out = tmp_path / "data"

    def prep(*extra: str) -> int:
        return preprocess_main(["--input", str(tmp_path / "a.txt"), "--context", "16", "--out", str(out), "--quiet",
                                *extra])

    assert prep() == 0
    marker = json.loads((out / MARKER).read_text())
    assert marker["kind"] == "data set" and "manifest.json" in marker["files"]
    assert prep("--overwrite") == 0
    (out / "run.json").write_text("{}")
    before = snapshot(tmp_path, dirs=True)
    capsys.readouterr()
    assert prep("--overwrite") == 2
    err = capsys.readouterr().err.strip()
    assert err == (f"fastmoe-preprocess: error: --out {out} holds a training run (run.json); --overwrite replaces "
                   "only a data set written there and nothing else: give a new or empty directory"), err
    assert snapshot(tmp_path, dirs=True) == before


def test_make_run_twice_and_what_the_command_line_refuses(tmp_path, capsys):
    from trainer.cli import main

    (tmp_path / "a.txt").write_text("first corpus text. " * 60)
    data = str(tmp_path / "data")
    assert preprocess_main(["--input", str(tmp_path / "a.txt"), "--context", "16", "--out", data, "--quiet",
                            "--valid", "2"]) == 0
    run, hf = tmp_path / "run", tmp_path / "run" / "hf"
    argv = ["--data", data, "--out", str(run), "--steps", "2", "--global-batch", "2", "--micro-batch", "1",
            "--no-logging.progress", "--no-logging.plot", "--peak-tflops", "1", "--no-eval.samples"]
    capsys.readouterr()
    assert main([*argv, "--export-hf", str(hf), "--eval.overwrite"]) == 0
    out = capsys.readouterr().out
    assert f"checkpoints: {run / 'checkpoints'} (full at the end of the run)" in out
    assert f"checkpoint: {run / 'checkpoints' / 'slot-A'}" in out and f"export: {hf}" in out
    first = (hf / "model.safetensors").read_bytes()
    # the same command again: said complete, the export made again in place, the records kept
    assert main([*argv, "--export-hf", str(hf), "--eval.overwrite"]) == 0
    assert f"{run}: already complete at step 2; nothing to train" in capsys.readouterr().out
    assert (hf / "model.safetensors").read_bytes() == first
    assert [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()] == [1, 2]
    # an export over the run, and another run in its --out: one line, exit 2, nothing touched
    before = snapshot(tmp_path, dirs=True)
    for extra, says in ((["--export-hf", str(run), "--eval.overwrite"], f"--eval.export_hf {run} is or holds the "
                         f"run's --out"), (["--preset", "small-moe"], f"--out {run} holds another run (")):
        assert main([*argv, *extra]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and err.startswith(f"error: {says}"), err
        assert snapshot(tmp_path, dirs=True) == before


def test_an_export_folder_taken_during_training_loses_nothing(data_cache, tmp_path, capsys):
    """The export folder passes the start's check, then someone fills it while the run trains: the run
    still ends its records, keeps the trained model in a model-only checkpoint, and says in one line
    where it is and the command that exports it; fastmoe-train then exits 2 (the output folder: a
    restart would meet it again); the files put there are untouched."""
    from trainer.cli import main as train_main

    run, hf = tmp_path / "run", tmp_path / "hf"
    t = Trainer(small_cfg(data_cache, str(run), steps=2, eval__enabled=False, eval__export_hf=str(hf)))
    hf.mkdir()
    (hf / "notes.txt").write_text("keep me")
    capsys.readouterr()
    t.fit()  # no exception: the export's failure is reported, not raised
    err = capsys.readouterr().err
    msg = t.artefacts["export_error"]
    assert f"error: {msg}" in err and "Traceback" not in err
    assert msg.startswith(f"export to {hf} failed: ") and "notes.txt" in msg
    saved = msg.split("the trained model is saved in ", 1)[1].split(": fastmoe-export", 1)[0]
    assert (Path(saved) / "MANIFEST.json").is_file() and f"fastmoe-export --checkpoint {saved} --out DIR" in msg
    assert (hf / "notes.txt").read_text() == "keep me" and sorted(p.name for p in hf.iterdir()) == ["notes.txt"]
    assert (run / "artefacts.json").is_file() and json.loads((run / "artefacts.json").read_text())["export_error"] == msg
    # what the message says works: the saved model exports elsewhere
    assert _export(capsys, "--checkpoint", saved, "--out", str(tmp_path / "hf2"))[0] == 0
    assert (tmp_path / "hf2" / "config.json").is_file()
    # the command line: a run on a small data set, with the folder taken once training has started
    (tmp_path / "a.txt").write_text("first corpus text. " * 60)
    data = str(tmp_path / "data")
    assert preprocess_main(["--input", str(tmp_path / "a.txt"), "--context", "16", "--out", data, "--quiet",
                            "--valid", "2"]) == 0
    run2, hf3 = tmp_path / "run2", tmp_path / "hf3"
    args = ["--data", data, "--out", str(run2), "--steps", "2", "--global-batch", "2", "--micro-batch", "1",
            "--no-logging.progress", "--no-logging.plot", "--peak-tflops", "1", "--no-eval.samples",
            "--export-hf", str(hf3)]
    import trainer.trainer as trainer_mod

    real_fit = trainer_mod.Trainer.fit

    def fit_then_take_folder(self):
        hf3.mkdir(exist_ok=True)
        (hf3 / "notes.txt").write_text("mine")
        return real_fit(self)

    trainer_mod.Trainer.fit = fit_then_take_folder
    try:
        capsys.readouterr()
        code = train_main(args)
    finally:
        trainer_mod.Trainer.fit = real_fit
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and err[-1].startswith(f"error: export to {hf3} failed: "), err
    assert sum("error: export to" in line for line in err) == 1, err  # said once
    assert (hf3 / "notes.txt").read_text() == "mine"
