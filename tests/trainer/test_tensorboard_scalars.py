"""TensorBoard scalars of a training run: the event file under OUT/tensorboard holds the training
loss, learning rate, gradient norm, validation loss and perplexity, and the MoE health per layer,
with the values of metrics.jsonl; without a writer library the run says so in one line.

The event file is read back here without the writer library: TFRecord framing (length, masked
CRC-32C of the length, the record, masked CRC-32C of the record) around ``Event`` protos, decoded
from the protobuf wire format, so a file the writer got wrong cannot pass by being read with the
same code that wrote it."""
from __future__ import annotations

import json
import struct
import sys

import numpy as np
import pytest

from trainer_util import data_cache, one_thread  # noqa: F401 (fixtures)
from trainer_util import small_cfg
from trainer.records.metrics import MetricsWriter
from trainer.records.tb_writer import NO_WRITER_MESSAGE, _load_writer_class, record_scalars


# ----------------------------------------------------------------------------- an independent reader
def _crc32c(data: bytes) -> int:
    crc = 0xFFFFFFFF
    for b in data:
        crc ^= b
        for _ in range(8):
            crc = (crc >> 1) ^ (0x82F63B78 if crc & 1 else 0)
    return crc ^ 0xFFFFFFFF


def _masked(data: bytes) -> int:
    c = _crc32c(data)
    return (((c >> 15) | (c << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def _varint(buf: bytes, i: int) -> tuple[int, int]:
    shift = value = 0
    while True:
        b = buf[i]
        i += 1
        value |= (b & 0x7F) << shift
        shift += 7
        if not b & 0x80:
            return value, i


def _fields(buf: bytes) -> list[tuple[int, int, object]]:
    """(field number, wire type, value) of a protobuf message: ints, bytes, or raw fixed-width bytes."""
    out, i = [], 0
    while i < len(buf):
        key, i = _varint(buf, i)
        num, wt = key >> 3, key & 7
        if wt == 0:
            v, i = _varint(buf, i)
        elif wt == 1:
            v, i = buf[i:i + 8], i + 8
        elif wt == 2:
            n, i = _varint(buf, i)
            v, i = buf[i:i + n], i + n
        elif wt == 5:
            v, i = buf[i:i + 4], i + 4
        else:
            raise AssertionError(f"unexpected wire type {wt}")
        out.append((num, wt, v))
    return out


def read_scalars(path) -> tuple[dict[str, dict[int, float]], list[str], list[int]]:
    """{tag: {step: value}} of an event file, its file_version strings, and the steps of its
    SessionLog START events (from there on TensorBoard drops older events: a resumed run)."""
    raw = path.read_bytes()
    scalars: dict[str, dict[int, float]] = {}
    versions, starts, i = [], [], 0
    while i < len(raw):
        head = raw[i:i + 8]
        (n,) = struct.unpack("<Q", head)
        (crc_len,) = struct.unpack("<I", raw[i + 8:i + 12])
        assert crc_len == _masked(head), "length CRC"
        rec = raw[i + 12:i + 12 + n]
        (crc_rec,) = struct.unpack("<I", raw[i + 12 + n:i + 16 + n])
        assert crc_rec == _masked(rec), "record CRC"
        i += 16 + n
        ev = _fields(rec)
        step = next((v for f, _, v in ev if f == 2), 0)  # Event.step
        versions += [v.decode() for f, _, v in ev if f == 3]  # Event.file_version
        for log in (v for f, _, v in ev if f == 7):  # Event.session_log; status 1 is START
            starts += [step for f, _, v in _fields(log) if f == 1 and v == 1]
        for summary in (v for f, _, v in ev if f == 5):  # Event.summary
            for value in (v for f, _, v in _fields(summary) if f == 1):  # Summary.value
                vf = _fields(value)
                tag = next(v.decode() for f, _, v in vf if f == 1)  # Value.tag
                simple = [v for f, wt, v in vf if f == 2 and wt == 5]  # Value.simple_value (float)
                assert simple, f"{tag}: no simple_value"
                scalars.setdefault(tag, {})[step] = struct.unpack("<f", simple[0])[0]
    assert i == len(raw), "trailing bytes"
    return scalars, versions, starts


def _event_files(d):
    return sorted(p for p in d.rglob("*") if p.is_file() and "tfevents" in p.name)


# ----------------------------------------------------------------------------- tests
def test_record_scalars_names_per_layer_moe_lists_and_skips_the_rest():
    rec = {"step": 4, "loss": 2.5, "lr": 1e-3, "grad_spike": False, "val_loss": float("nan"),
           "moe_load_cv": [0.1, 0.2], "moe_tokens_per_expert": [[1, 2], [3, 4]], "tokens_per_expert": [2.0, 3.0],
           "peak_source": "configured"}
    got = dict(record_scalars(rec))
    assert set(got) == {"loss", "lr", "val_loss", "moe_load_cv/layer_0", "moe_load_cv/layer_1"}
    assert got["moe_load_cv/layer_1"] == 0.2 and np.isnan(got["val_loss"])


def test_training_run_writes_the_scalars_to_tensorboard(data_cache, tmp_path):
    if _load_writer_class()[0] is None:
        pytest.skip("no TensorBoard writer library (the trainer extra installs tensorboardX)")
    from trainer.trainer import Trainer

    out = tmp_path / "run"
    cfg = small_cfg(data_cache, str(out), "tiny-moe", steps=4, eval__instances=16, eval__micro_batch=4,
                    eval__interval=2, eval__samples=False)
    cfg.logging.tensorboard = True
    t = Trainer(cfg)
    hist = t.fit()
    assert json.loads((out / "run.json").read_text())["tensorboard"] is True
    files = _event_files(out / "tensorboard")
    assert len(files) == 1, files
    scalars, versions, starts = read_scalars(files[0])
    assert versions == ["brain.Event:2"] and starts == []
    L = cfg.model.num_layers
    want = ["loss", "lm_loss", "lr", "grad_norm", "lb_loss", "z_loss", "val_loss", "val_ppl", "val_tokens"]
    for name in ("moe_load_min", "moe_load_max", "moe_load_cv", "moe_router_entropy", "moe_lb_loss",
                 "moe_z_loss", "moe_dropped_frac"):
        want += [f"{name}/layer_{layer}" for layer in range(L)]
    assert not set(want) - set(scalars), sorted(set(want) - set(scalars))
    assert not any(tag.startswith("moe_tokens_per_expert") for tag in scalars)
    # every tag at every step it was recorded, with metrics.jsonl's value (stored as float32)
    jsonl = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in jsonl] == [r["step"] for r in hist] == [1, 2, 3, 4]
    for tag in want:
        key, _, layer = tag.partition("/layer_")
        expect = {r["step"]: (r[key][int(layer)] if layer else r[key]) for r in jsonl if key in r}
        assert set(scalars[tag]) == set(expect), tag
        for step, v in expect.items():
            assert scalars[tag][step] == pytest.approx(v, rel=1e-6, abs=1e-12), (tag, step)
    assert set(scalars["val_loss"]) == {2, 4}  # the interval and the last step
    assert scalars["moe_dropped_frac/layer_0"] == {s: 0.0 for s in (1, 2, 3, 4)}


def test_a_resumed_run_tells_tensorboard_to_drop_the_steps_it_redoes(tmp_path):
    from trainer.records.tb_writer import TensorBoardScalars

    if _load_writer_class()[0] is None:
        pytest.skip("no TensorBoard writer library (the trainer extra installs tensorboardX)")
    with pytest.raises(ValueError, match="start_step"):
        TensorBoardScalars(str(tmp_path / "bad"), start_step=-1)
    w = TensorBoardScalars(str(tmp_path / "tb"), start_step=4)  # resumed from the step-4 checkpoint
    assert w.write({"step": 5, "loss": 1.5, "moe_z_loss": [0.25]}) == 2
    w.close()
    scalars, _, starts = read_scalars(_event_files(tmp_path / "tb")[0])
    assert starts == [5] and scalars == {"loss": {5: 1.5}, "moe_z_loss/layer_0": {5: 0.25}}


def test_without_a_writer_library_the_run_says_so_in_one_line(tmp_path, monkeypatch, capsys):
    # None in sys.modules makes `import` raise ImportError: as if neither package were installed
    for mod in ("tensorboardX", "torch.utils.tensorboard"):
        monkeypatch.setitem(sys.modules, mod, None)
    w = MetricsWriter(str(tmp_path), tensorboard=True)
    w.write({"step": 1, "loss": 2.0})
    w.close()
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [NO_WRITER_MESSAGE]
    assert not w.tensorboard_enabled and not (tmp_path / "tensorboard").exists()
    assert json.loads((tmp_path / "metrics.jsonl").read_text()) == {"step": 1, "loss": 2.0}
    # turned off: not a word
    MetricsWriter(str(tmp_path / "off"), tensorboard=False).close()
    assert capsys.readouterr().err == ""
