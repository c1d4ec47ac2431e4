"""Asynchronous checkpoints (trainer/checkpoint/background.py): the state is staged before training
goes on, the slot written in the background equals a synchronous one, a crash in the middle of a
background write leaves the previous slot valid, and ZeRO-1 / EPSO, PP and FSDP2 on 2 gloo processes agree."""
from __future__ import annotations

import json
import signal
import threading
from pathlib import Path

import pytest
import torch

import _ft_toy as toy
from trainer.checkpoint import save as ck_save
from trainer.checkpoint.manager import CheckpointManager
from trainer.checkpoint.slots import CheckpointError, latest_valid, verify
from trainer.config import ConfigError, validate
from trainer.records.metrics import read_metrics
from trainer.trainer import Trainer
from trainer_util import data_cache, small_cfg  # noqa: F401 (fixture)


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_background_write_holds_the_staged_state(tmp_path: Path, monkeypatch) -> None:
    lay = toy.make_layout(1)
    model, opt = toy.build("sharded", lay)
    toy.train_step(model, opt, lay, 0, tmp_path)
    sync = CheckpointManager(tmp_path / "sync").save(1, model, opt, meta={"next_step": 1})
    expected = toy.read_checkpoint(sync.path)

    # hold the background write until training has changed every weight and state
    go, inside = threading.Event(), []
    write = ck_save._write_dir

    def held(*a, **kw):
        inside.append(threading.current_thread() is not threading.main_thread())
        assert go.wait(60)
        return write(*a, **kw)

    monkeypatch.setattr(ck_save, "_write_dir", held)
    mgr = CheckpointManager(tmp_path / "async", async_save=True)
    st = mgr.save(1, model, opt, meta={"next_step": 1})
    assert mgr._pending is not None and not (tmp_path / "async" / "slot-A").exists()
    toy.train_step(model, opt, lay, 1, tmp_path)  # the step loop goes on meanwhile
    go.set()
    mgr.wait()
    assert inside == [True]
    assert st.path.name == "slot-A" and verify(st.path) is None
    assert _same(toy.read_checkpoint(st.path), expected)
    assert latest_valid(tmp_path / "async").step == 1
    [t] = mgr.timings
    assert t["async"] and t["step"] == 1 and t["stall_s"] >= 0 and t["write_s"] > 0

    # the next checkpoint takes the other slot; a synchronous one (the run's last) waits first
    assert mgr.save(2, model, opt).path.name == "slot-B" and mgr._pending is not None
    last = mgr.save(2, model, opt, background=False)
    assert last.path.name == "slot-A" and mgr._pending is None and latest_valid(tmp_path / "async").index == 2
    assert [t["async"] for t in mgr.timings] == [True, True, False]


def test_background_error_is_raised_in_the_step_loop(tmp_path: Path, monkeypatch) -> None:
    lay = toy.make_layout(1)
    model, opt = toy.build("sharded", lay)
    mgr = CheckpointManager(tmp_path, async_save=True)
    mgr.save(1, model, opt)
    mgr.wait()

    def full(*a, **kw):
        raise CheckpointError("disk gone")

    monkeypatch.setattr(ck_save, "_write_dir", full)
    mgr.save(2, model, opt)
    with pytest.raises(CheckpointError, match="disk gone.*previous checkpoint .*slot-A.*untouched"):
        mgr.wait()
    assert latest_valid(tmp_path).step == 1


def test_crash_during_the_background_write_keeps_the_previous_slot(tmp_path: Path) -> None:
    out = tmp_path / "run"
    codes = toy.spawn(1, ["--out", str(out), "--steps", "6", "--interval", "2", "--async", "--die-in-write", "4"])
    assert codes == [9], (out / "spawn-rank-0.log").read_text()[-3000:]
    root = out / "checkpoints"
    assert (root / "slot-B.tmp").exists() and not (root / "slot-B").exists()
    info = latest_valid(root)
    assert info.step == 2 and info.path.name == "slot-A"


@pytest.mark.parametrize("optim,ep", [("sharded", 1), ("epso", 2)])
def test_two_processes_async_equals_sync(tmp_path: Path, optim: str, ep: int) -> None:
    runs = {}
    for mode in ("sync", "async"):
        out = tmp_path / mode
        argv = ["--out", str(out), "--steps", "4", "--interval", "2", "--optim", optim, "--ep", str(ep),
                "--dump", str(out / "dump")]
        codes = toy.spawn(2, argv + (["--async"] if mode == "async" else []))
        assert codes == [0, 0], (out / "spawn-rank-0.log").read_text()[-3000:]
        root = out / "checkpoints"
        assert latest_valid(root).step == 4
        runs[mode] = [toy.read_checkpoint(root / s) for s in ("slot-A", "slot-B")]
        runs[mode].append(toy.assemble(toy.load_dumps(out / "dump")))
    for a, b in zip(runs["sync"][:2], runs["async"][:2]):
        assert _same(a, b)
    assert _same(runs["sync"][2], runs["async"][2])
    # the step-4 checkpoint holds the final state
    final = runs["async"][2]
    ck = runs["async"][1]
    assert all(torch.equal(ck[k], final[k]) for k in ck if k.startswith("w/"))


def test_trainer_async_checkpoints_equal_sync_ones_and_are_recorded(tmp_path, data_cache) -> None:  # noqa: F811
    runs = {}
    for mode in ("sync", "async"):
        out = tmp_path / mode
        t = Trainer(small_cfg(data_cache, str(out), steps=4, checkpoint__interval=2,
                              checkpoint__async_save=mode == "async"))
        t.fit()  # checkpoints at 2 and 4; the run's end waits for the write of step 4
        assert t.checkpoints._pending is None
        info = latest_valid(out / "checkpoints")
        assert info.step == 4 and t.artefacts["checkpoint"] == str(info.path)
        runs[mode] = [toy.read_checkpoint(out / "checkpoints" / s) for s in ("slot-A", "slot-B")]
        records = {r["step"]: r for r in read_metrics(out / "metrics.jsonl")}
        assert [s for s in records if "checkpoint_stall_s" in records[s]] == [2, 4]
        assert all(records[s]["checkpoint_async"] == (mode == "async") for s in (2, 4))
        written = sorted(r["checkpoint_write_step"] for r in records.values() if "checkpoint_write_s" in r)
        summary = json.loads((out / "summary.json").read_text())
        assert [c["step"] for c in summary["checkpoints"]] == [2, 4]
        assert all(c["write_s"] > 0 and c["stall_s"] >= 0 for c in summary["checkpoints"])
        # a synchronous write is on its step's record; an asynchronous one's where it was collected
        # (the write of step 4, collected at the run's end, is in the summary only)
        assert written == ([2, 4] if mode == "sync" else [2])
    for a, b in zip(runs["sync"], runs["async"]):
        assert _same(a, b)


def _layout_worker(data_cache: str, out: str, over: dict, async_save: bool) -> None:
    from trainer_util import small_cfg as cfg_of

    cfg = cfg_of(data_cache, out, over.pop("preset", "tiny-moe"), steps=4, checkpoint__interval=2,
                 checkpoint__async_save=async_save, **over)
    cfg.eval.enabled = False
    t = Trainer(cfg)
    t.fit()
    assert t.checkpoints._pending is None  # the run's end collected the last write


@pytest.mark.parametrize("over", [
    {"parallel__pp": 2},  # two pipeline stages, 1F1B, each rank writing its stage's layers and states
    {"preset": "tiny-qwen3-moe", "model__hf_family": "qwen3_moe", "parallel__dp_shard": "fsdp",
     "model__ep_dispatch": "alltoall", "optim__lr": 1e-3},  # FSDP2: each rank its shard of every weight
], ids=["pp2", "fsdp2"])
def test_async_checkpoints_on_pipeline_and_fsdp_equal_sync_ones(tmp_path, data_cache, over) -> None:  # noqa: F811
    """On two gloo processes with --pp 2 and with FSDP2, the slots written in the background hold the
    same tensors, bit for bit, as those written synchronously, and the newest valid slot is step 4."""
    from parallel_util import run_workers

    runs = {}
    for mode in ("sync", "async"):
        out = tmp_path / mode
        run_workers(_layout_worker, 2, data_cache, str(out), dict(over), mode == "async")
        root = out / "checkpoints"
        assert latest_valid(root).step == 4
        runs[mode] = [toy.read_checkpoint(root / s) for s in ("slot-A", "slot-B")]
        records = {r["step"]: r for r in read_metrics(out / "metrics.jsonl")}
        assert all(records[s]["checkpoint_async"] == (mode == "async") for s in (2, 4))
    for a, b in zip(runs["sync"], runs["async"]):
        assert _same(a, b)


def test_the_dry_run_counts_the_host_staging_memory() -> None:
    from trainer.config.presets import get_preset
    from trainer.parallelism.plan import DTYPE_BYTES, ModelShape, param_totals, plan_from_config

    cfg = get_preset("mula-7b-a1b")
    cfg.parallel.pp = cfg.parallel.ep = 1
    cfg.parallel.dp = 0
    assert "--checkpoint.async" not in plan_from_config(cfg, world=1)
    cfg.checkpoint.async_save = True
    line = plan_from_config(cfg, world=1).splitlines()[-1]
    assert line.startswith("Host memory per rank for --checkpoint.async")
    # one rank holds everything: fp32 master, exp_avg, exp_avg_sq (12 B) and the weights, per parameter
    n = param_totals(ModelShape.of(cfg.model, cfg.model.vocab_size)).total
    want = (12 + DTYPE_BYTES[cfg.model.param_dtype]) * n / 2**30
    assert abs(float(line.split("about ")[1].split()[0]) - want) < 0.01


def test_sigterm_waits_for_the_background_write_and_stops_with_a_valid_checkpoint(tmp_path, data_cache) -> None:  # noqa: F811
    from test_stop_resume import _interrupt, _strict, _train_cmd

    out = tmp_path / "run"
    cmd = _train_cmd(out, data_cache, "--checkpoint.interval", "1", "--checkpoint.async")
    done = _interrupt(cmd, out, 2, signal.SIGTERM)
    assert done.returncode == 143, done.stderr[-3000:]
    assert "Traceback" not in done.stderr + done.stdout, done.stderr[-3000:]
    [line] = [ln for ln in done.stderr.splitlines() if ln.startswith("stopped at step")]
    step = int(line.split()[3])
    newest = latest_valid(out / "checkpoints")
    assert newest is not None and newest.step == step and str(newest.path) == line.split("checkpoint at ")[1].split(";")[0]
    assert not list((out / "checkpoints").glob("*.tmp"))
    records = _strict(out / "metrics.jsonl")
    assert [r["step"] for r in records] == list(range(1, step + 1))
    assert all(r["checkpoint_async"] for r in records)
    summary = json.loads((out / "summary.json").read_text())
    assert [c["step"] for c in summary["checkpoints"]] == list(range(1, step + 1))
    assert all("write_s" in c for c in summary["checkpoints"])  # every write collected before the exit
