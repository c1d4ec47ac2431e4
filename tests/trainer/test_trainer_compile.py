"""Trainer --compile: the compiled decoder trains to the eager losses, and compile time is reported
apart from step time (compiled once, on the first step)."""
from __future__ import annotations

import json
import os

import pytest
import torch

from trainer.trainer import Trainer
from trainer_util import data_cache, one_thread, small_cfg  # noqa: F401 (fixtures)

pytest.importorskip("transformers", reason="transformers builds the trainer's models")


def test_compiled_training_equals_eager_and_reports_compile_time(data_cache, tmp_path) -> None:
    torch._dynamo.reset()
    eager = Trainer(small_cfg(data_cache, str(tmp_path / "eager"), steps=3)).fit()
    cfg = small_cfg(data_cache, str(tmp_path / "compiled"), steps=3, model__compile=True,
                    model__compile_backend="aot_eager")
    trainer = Trainer(cfg)
    compiled = trainer.fit()
    for e, c in zip(eager, compiled):
        assert c["loss"] == pytest.approx(e["loss"], rel=1e-5)
    assert [r["compile_s"] for r in eager] == [0.0, 0.0, 0.0]
    assert compiled[0]["compile_s"] > 0  # the decoder compiles on the first step...
    assert compiled[1]["compile_s"] == 0.0 and compiled[2]["compile_s"] == 0.0  # ...and never again
    assert compiled[0]["step_time_s"] > 0
    summary = json.load(open(os.path.join(cfg.logging.out, "summary.json"), encoding="utf-8"))
    assert summary["compile_s"] == pytest.approx(compiled[0]["compile_s"])
