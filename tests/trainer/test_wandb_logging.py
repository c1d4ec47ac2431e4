"""Weights & Biases logging (``--logging.wandb``), beside TensorBoard: an optional package that is one
line when absent; rank 0 logs each step's scalars at its step into one W&B run that a resume
continues (offline mode, read back from the run's own file); the calls it makes, with a stand-in."""
from __future__ import annotations

import glob
import importlib.util
import json
import struct
import sys
import time
import types

import pytest

from trainer.cli import EXIT_CONFIG_ERROR, main
from trainer.config import ConfigError
from trainer.records import wandb_writer
from trainer.records.metrics import MetricsWriter, read_metrics
from trainer.records.tb_writer import record_scalars
from trainer_util import data_cache, one_thread, small_cfg  # noqa: F401 (fixtures)


class _FakeRun:
    def __init__(self, **kw):
        self.init, self.id, self.logged, self.finished = kw, kw["id"], [], False

    def log(self, data, step):
        self.logged.append((step, data))

    def finish(self):
        self.finished = True


@pytest.fixture
def fake_wandb(monkeypatch):
    runs = []
    mod = types.SimpleNamespace(init=lambda **kw: runs.append(_FakeRun(**kw)) or runs[-1])
    monkeypatch.setitem(sys.modules, "wandb", mod)
    return runs


def _rec(step: int) -> dict:
    return {"step": step, "loss": 3.0 / step, "lr": 1e-3, "grad_clipped": False, "tokens_per_expert": [[1, 2]],
            "moe_load_max": [1.5, 1.25], "grad_norm_mean": None}


def test_the_calls_it_makes(tmp_path, fake_wandb):
    w = MetricsWriter(str(tmp_path), tensorboard=False, wandb=dict(project="p", config={"seed": 3}))
    for s in (1, 2, 3):
        w.write(_rec(s))
    w.close()
    (run,) = fake_wandb
    assert run.init == dict(project="p", name=tmp_path.name, dir=str(tmp_path), config={"seed": 3}, id=run.id,
                            resume="allow")
    # TensorBoard's scalars, at the record's step: numbers and per-layer MoE lists, nothing else
    assert run.logged == [(s, dict(record_scalars(_rec(s)))) for s in (1, 2, 3)]
    assert run.logged[0][1] == {"loss": 3.0, "lr": 1e-3, "moe_load_max/layer_0": 1.5, "moe_load_max/layer_1": 1.25}
    assert run.finished
    assert json.loads((tmp_path / wandb_writer.RUN_FILE).read_text())["id"] == run.id
    # a resume from the checkpoint of step 1: the same W&B run; steps 2 and 3 were logged, so skipped
    w = MetricsWriter(str(tmp_path), tensorboard=False, append=True, start_step=1,
                      wandb=dict(project="p", config={"seed": 3}))
    for s in (2, 3, 4):
        w.write(_rec(s))
    w.close()
    assert fake_wandb[1].id == run.id and [s for s, _ in fake_wandb[1].logged] == [4]
    assert [r["step"] for r in read_metrics(str(tmp_path / "metrics.jsonl"))] == [1, 2, 3, 4]
    # a fresh start in the same directory is a new W&B run
    MetricsWriter(str(tmp_path), tensorboard=False, wandb=dict(project="p")).close()
    assert fake_wandb[2].id != run.id


def test_a_run_wandb_cannot_start_is_one_line(tmp_path, monkeypatch):
    def refuse(**kw):
        raise RuntimeError("api_key not configured (no-tty).\ncall wandb.login(key=[your_api_key])")

    monkeypatch.setitem(sys.modules, "wandb", types.SimpleNamespace(init=refuse))
    with pytest.raises(ConfigError) as e:
        MetricsWriter(str(tmp_path), tensorboard=False, wandb=dict(project="p"))
    msg = str(e.value)
    assert "\n" not in msg and "api_key not configured" in msg and "WANDB_MODE=offline" in msg
    assert not (tmp_path / "metrics.jsonl").exists()


def test_without_the_package_it_is_one_line_before_any_work(tmp_path, capsys, monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "wandb" else real(name, *a))
    rc = main(["--logging.wandb", "--out", str(tmp_path / "o")])
    err = capsys.readouterr().err
    assert rc == EXIT_CONFIG_ERROR and err.count("\n") == 1, err
    assert err.startswith("error: --logging.wandb needs the wandb package") and "pip install wandb" in err
    assert not (tmp_path / "o").exists()


def _wandb_history(run_dir, timeout: float = 60.0) -> dict[int, dict]:
    """{step: scalars} of an offline run, read from its ``.wandb`` file once its ``exit`` record is
    there (W&B's service process writes the file on its own after ``finish()`` returns)."""
    deadline = time.monotonic() + timeout
    while True:
        records = _wandb_records(run_dir)
        if any(r.WhichOneof("record_type") == "exit" for r in records) or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    out = {}
    for r in records:
        if r.WhichOneof("record_type") == "history":
            items = {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in r.history.item}
            out[int(r.history.step.num)] = {k: v for k, v in items.items() if not k.startswith("_")}
    return out


def _wandb_records(run_dir) -> list:
    """The ``Record`` protos of an offline run's ``.wandb`` file: W&B's LevelDB-style log (a 7-byte
    header, then records of crc32 / length / type in 32 KiB blocks)."""
    from wandb.proto import wandb_internal_pb2 as pb

    (path,) = glob.glob(str(run_dir / "run-*.wandb"))
    data = open(path, "rb").read()
    assert data[:4] == b":W&B"
    pos, block, chunks, pending = 7, 32768, [], b""
    while pos + 7 <= len(data):
        left = block - pos % block
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + 7]) if left >= 7 else (0, 0, 0)
        if kind == 0:  # the zero padding at a block's end
            pos += left
            continue
        if pos + 7 + length > len(data):  # a record still being written
            break
        chunk, pos = data[pos + 7:pos + 7 + length], pos + 7 + length
        if kind == 1:
            chunks.append(chunk)
        elif kind == 2:
            pending = chunk
        elif kind == 3:
            pending += chunk
        else:
            chunks.append(pending + chunk)
    records = []
    for c in chunks:
        r = pb.Record()
        r.ParseFromString(c)
        records.append(r)
    return records


def test_offline_run_holds_every_steps_scalars_and_a_resume_continues_it(tmp_path, data_cache, monkeypatch):  # noqa: F811
    pytest.importorskip("wandb")
    from trainer.trainer import Trainer

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    for var in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR"):  # nothing written to the home directory
        monkeypatch.setenv(var, str(tmp_path / var.lower()))
    out = tmp_path / "run"
    cfg = small_cfg(data_cache, str(out), steps=5, checkpoint__interval=2, eval__enabled=False, logging__wandb=True)
    Trainer(cfg).fit(steps=3)  # stops after step 3; the checkpoint of step 2 is the newest
    first_id = json.loads((out / wandb_writer.RUN_FILE).read_text())["id"]
    (first,) = glob.glob(str(out / "wandb" / "offline-run-*"))
    hist = _wandb_history(type(out)(first))
    recs = {r["step"]: r for r in read_metrics(str(out / "metrics.jsonl"))}
    assert sorted(hist) == [1, 2, 3]
    for step, logged in hist.items():
        assert logged == pytest.approx(dict(record_scalars(recs[step])), rel=1e-12)
        assert "loss" in logged and "mfu" in logged and "moe_load_max/layer_1" in logged
    # the resume redoes step 3 and goes on: into the same W&B run, steps 4 and 5 only
    Trainer(small_cfg(data_cache, str(out), steps=5, checkpoint__interval=2, eval__enabled=False,
                      logging__wandb=True)).fit()
    assert json.loads((out / wandb_writer.RUN_FILE).read_text())["id"] == first_id
    (second,) = [d for d in glob.glob(str(out / "wandb" / "offline-run-*")) if d != first]
    assert second.endswith(first_id)
    hist2 = _wandb_history(type(out)(second))
    recs = {r["step"]: r for r in read_metrics(str(out / "metrics.jsonl"))}
    assert sorted(hist2) == [4, 5] and sorted(recs) == [1, 2, 3, 4, 5]
    for step, logged in hist2.items():
        assert logged == pytest.approx(dict(record_scalars(recs[step])), rel=1e-12)
