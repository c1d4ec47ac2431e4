"""Trainer --compile under expert parallelism (EP=2 on gloo, allgather dispatch): the decoder
compiles whole (fullgraph) and trains to the losses of one eager process over the same batch."""
from __future__ import annotations

import pytest

from parallel_util import run_workers
from trainer_util import RTOL, data_cache, one_thread  # noqa: F401 (fixtures)
from trainer_util import small_cfg
from trainer.trainer import Trainer

pytest.importorskip("transformers", reason="transformers builds the trainer's models")


def _worker(data_cache: str, out: str) -> dict:
    import torch._dynamo

    torch._dynamo.reset()
    hist = Trainer(small_cfg(data_cache, out, "tiny-moe", steps=3, model__compile=True,
                             model__compile_backend="aot_eager", parallel__ep=2)).fit()
    return {"losses": [r["loss"] for r in hist], "compile_s": [r["compile_s"] for r in hist]}


def test_compiled_ep_training_equals_one_eager_process(data_cache, tmp_path):
    eager = Trainer(small_cfg(data_cache, str(tmp_path / "single"), "tiny-moe", steps=3)).fit()
    results = run_workers(_worker, 2, data_cache, str(tmp_path / "ep"), timeout_s=300)
    for r in results:
        assert r["losses"] == pytest.approx([e["loss"] for e in eager], rel=RTOL)
        assert r["compile_s"][0] > 0 and r["compile_s"][1:] == [0.0, 0.0]  # compiled once, whole
