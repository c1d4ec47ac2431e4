"""Bad output directories and damaged checkpoints: a clear error before any work, or a recorded
skip, never a silent fresh start."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

import _ft_toy as toy
from trainer.checkpoint.manager import CheckpointManager
from trainer.checkpoint.restore import NoValidCheckpoint
from trainer.checkpoint.slots import CheckpointError
from trainer.ft import fault

REPO = Path(__file__).resolve().parents[3]


def test_check_out_dir(tmp_path: Path) -> None:
    fault.check_out_dir(tmp_path / "new" / "dir")
    assert (tmp_path / "new" / "dir").is_dir()
    # a directory that was there keeps its times through the probe (made and removed in it)
    old = tmp_path / "old"
    old.mkdir()
    os.utime(old, ns=(1_000_000_000_000_000_000, 1_000_000_000_000_000_000))
    fault.check_out_dir(old)
    assert old.stat().st_mtime_ns == 1_000_000_000_000_000_000 and list(old.iterdir()) == []
    f = tmp_path / "file"
    f.write_text("")
    with pytest.raises(ValueError, match="regular file"):
        fault.check_out_dir(f / "out")
    if os.geteuid() != 0:  # root writes through a read-only mode
        ro = tmp_path / "ro"
        ro.mkdir(mode=0o555)
        with pytest.raises(ValueError, match="cannot be written"):
            fault.check_out_dir(ro / "out")


def test_trainer_with_an_unwritable_out_fails_first_in_one_line(tmp_path: Path) -> None:
    f = tmp_path / "file"
    f.write_text("")
    p = subprocess.run([sys.executable, "-m", "trainer", "--preset", "tiny-moe", "--steps", "1", "--out",
                        str(f / "out")], cwd=REPO, capture_output=True, text=True, timeout=300,
                       env=dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1"))
    assert p.returncode == 2
    lines = [line for line in p.stderr.splitlines() if line.strip()]
    assert lines == [f"error: output directory {str(f / 'out')!r} cannot be written: a path component is a "
                     "regular file, not a directory"], p.stderr[-3000:]


def _saved(tmp_path: Path) -> tuple[Path, object, object]:
    lay = toy.make_layout(1)
    model, opt = toy.build("sharded", lay)
    root = tmp_path / "out" / "checkpoints"
    mgr = CheckpointManager(root, layout=lay, interval=1)
    mgr.save(1, model, opt)
    mgr.save(2, model, opt)
    return root, model, opt


def _damage(slot: Path) -> None:
    data = next(p for p in sorted(slot.iterdir()) if p.suffix == ".distcp")
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    data.write_bytes(bytes(raw))


def test_every_slot_damaged_stops_with_each_reason(tmp_path: Path) -> None:
    root, model, opt = _saved(tmp_path)
    _damage(root / "slot-A")
    _damage(root / "slot-B")
    with pytest.raises(NoValidCheckpoint) as e:
        CheckpointManager(root).restore(model, opt)
    msg = str(e.value)
    assert "slot-A:" in msg and "slot-B:" in msg and "sha256" in msg and "--allow-fresh-start" in msg
    assert isinstance(e.value, CheckpointError)  # the trainer's exit 76: not retried by the launcher
    # asked for explicitly: a fresh start, with each skipped slot recorded
    assert CheckpointManager(root, allow_fresh_start=True).restore(model, opt) is None
    recs = [r for r in fault.read_failures(root.parent) if r["kind"] == "checkpoint_skipped"]
    assert sorted(Path(r["slot"]).name for r in recs) == ["slot-A", "slot-B"] and all(r["used"] is None for r in recs)


def test_a_damaged_newest_slot_is_skipped_with_a_line_and_a_record(tmp_path: Path, capsys) -> None:
    root, model, opt = _saved(tmp_path)
    _damage(root / "slot-B")  # step 2, the newest
    res = CheckpointManager(root).restore(model, opt)
    assert res.info.step == 1 and res.info.path.name == "slot-A"
    out = capsys.readouterr().out
    assert out.count("skipped damaged") == 1 and "slot-B" in out and "resuming from slot-A (step 1)" in out
    (rec,) = fault.read_failures(root.parent)
    assert (rec["kind"], Path(rec["slot"]).name, Path(rec["used"]).name) == ("checkpoint_skipped", "slot-B", "slot-A")
    assert "sha256" in rec["reason"]
