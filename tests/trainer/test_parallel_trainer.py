"""The trainer with --pp, --tp, --ac, --broadcast/--init-from and --dry-run: real processes on gloo
train exactly like one plain Trainer over the same global batch (fp32)."""
from __future__ import annotations

import os

import pytest
import torch

from parallel_util import run_workers
from trainer_util import RTOL, assert_states_close, data_cache, one_thread  # noqa: F401 (fixtures)
from trainer_util import small_cfg as _small_cfg
from trainer.config import ConfigError, TrainConfig, validate
from trainer.trainer import Trainer


def small_cfg(data_cache: str, out: str, preset: str = "tiny-moe", **over) -> TrainConfig:
    """4 steps of 8 instances x 16 tokens in micro-batches of 2, clipping active from step 2."""
    return _small_cfg(data_cache, out, preset, steps=4, **over)


def _worker(data_cache: str, out: str, preset: str, over: dict) -> dict:
    from trainer.parallelism.tp import gather_tensor_parallel

    t = Trainer(small_cfg(data_cache, out, preset, **over))
    hist = t.fit()
    lay = t.layout
    state = {k: v.detach().clone() for k, v in t.model.state_dict().items()}
    if getattr(lay, "tp", 1) > 1:
        state = gather_tensor_parallel(t.model, lay.tp_group)
    ids = {n.rpartition(".")[0]: b.clone() for n, b in t.model.named_buffers() if n.endswith("expert_ids")}
    return {"losses": [r["loss"] for r in hist], "lm": [r["lm_loss"] for r in hist], "state": state,
            "expert_ids": ids, "describe": lay.describe(), "grad_norms": [r["grad_norm"] for r in hist],
            "loads": [r.get("moe_tokens_per_expert") for r in hist]}


def _reference(data_cache: str, out: str, preset: str = "tiny-moe", **over) -> tuple[list[dict], dict]:
    t = Trainer(small_cfg(data_cache, out, preset, **over))
    hist = t.fit()
    return hist, {k: v.detach().clone() for k, v in t.model.state_dict().items()}


def _check(results: list[dict], hist: list[dict], state: dict) -> None:
    losses = [r["loss"] for r in hist]
    names = set()
    for r in results:
        assert r["losses"] == pytest.approx(losses, rel=RTOL), r["describe"]
        assert r["grad_norms"] == pytest.approx([h["grad_norm"] for h in hist], rel=RTOL), r["describe"]
        # the MoE health's expert loads: every token counted once, whatever the layout (a pipeline's
        # shape-inference forward and activation checkpointing's recompute not counted)
        assert r["loads"] == [h.get("moe_tokens_per_expert") for h in hist], r["describe"]
        mine = {}
        for k, v in r["state"].items():
            if k.endswith("expert_ids"):
                continue
            ref = state[k]
            ids = r["expert_ids"].get(k.rpartition(".")[0])
            mine[k] = (v, ref[ids] if ids is not None else ref)
            names.add(k)
        assert_states_close({k: a for k, (a, _) in mine.items()}, {k: b for k, (_, b) in mine.items()})
    assert names == {k for k in state if not k.endswith("expert_ids")}, "some weights are on no rank"


@pytest.mark.parametrize("preset,world,over", [
    ("tiny-moe", 2, {"parallel__pp": 2}),                                       # PP=2, 1F1B, EPSO
    ("tiny-moe", 4, {"parallel__pp": 2, "parallel__ep": 2, "parallel__ac": "moe"}),  # PP=2 x EP=2, checkpointed experts
    # TP=2 on the dense model, all checkpointed; lr 1e-3 because TP's split sums round differently and
    # Adam turns that into an O(lr) error on elements with ~0 gradient (1.5e-5 at the preset's 3e-3)
    ("tiny-dense", 2, {"parallel__tp": 2, "parallel__ac": "norm,attn,moe", "optim__lr": 1e-3}),
    ("tiny-moe", 2, {"parallel__pp": 2, "parallel__pp_schedule": "gpipe", "optim__name": "sharded"}),  # GPipe, ZeRO-1
    ("tiny-dense", 4, {"parallel__pp": 2, "parallel__tp": 2, "optim__lr": 1e-3}),  # PP=2 x TP=2 on one mesh
])
def test_parallel_trainer_equals_one_process(data_cache, tmp_path, preset, world, over):
    same = {k: v for k, v in over.items() if not k.startswith("parallel__")}  # the recipe, not the layout
    hist, state = _reference(data_cache, str(tmp_path / "single"), preset, **same)
    results = run_workers(_worker, world, data_cache, str(tmp_path / "par"), preset, over)
    _check(results, hist, state)
    assert os.path.exists(tmp_path / "par" / "metrics.jsonl")


def _init_worker(data_cache: str, out: str, path: str, method: str) -> dict:
    t = Trainer(small_cfg(data_cache, out, "tiny-moe", model__init_from=path, parallel__broadcast=method,
                          parallel__ep=2))
    return {k: v.detach().clone() for k, v in t.model.state_dict().items()}


def test_init_from_file_reaches_every_rank(data_cache, tmp_path):
    """--init-from with EP=2: each rank ends with the file's weights (its own experts)."""
    cfg = small_cfg(data_cache, str(tmp_path / "src"), "tiny-moe")
    cfg.seed = 123
    src = Trainer(cfg)
    sd = {k: v.detach().clone() for k, v in src.model.state_dict().items()}
    path = str(tmp_path / "init.pt")
    torch.save(sd, path)
    results = run_workers(_init_worker, 2, data_cache, str(tmp_path / "dst"), path, "all_reduce")
    for r in results:
        for k, v in r.items():
            if k.endswith("expert_ids"):
                continue
            ids = r.get(k.rpartition(".")[0] + ".expert_ids")
            assert torch.equal(v, sd[k][ids] if ids is not None else sd[k]), k


@pytest.mark.parametrize("over,message", [
    ({"parallel__pp": 8}, "cannot fill PP=8"),                               # tiny-moe has 2 layers
    ({"parallel__pp": 2, "schedule__global_batch": 2}, "1F1B needs at least PP=2 micro-batches"),
    ({"parallel__tp": 2}, "tensor parallelism (TP=2) covers the dense model"),  # tiny-moe is MoE
    ({"parallel__ac": "norm,mlp2"}, "unknown --ac choice"),
])
def test_bad_parallel_configs_fail_in_one_line(data_cache, tmp_path, over, message):
    cfg = small_cfg(data_cache, str(tmp_path), "tiny-moe", **over)
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        validate(cfg, cfg.parallel.pp * cfg.parallel.tp)


def test_dry_run_cli(capsys):
    from trainer.cli import main

    assert main(["--preset", "mula-220b-a10b", "--dry-run", "--world", "12288", "--pp", "8", "--ep", "12"]) == 0
    out = capsys.readouterr().out
    assert "world 12288 = PP 8 x DP 128 x EP 12" in out and "total 220.21B  active 10.02B" in out
    assert main(["--preset", "mula-100b-a7b", "--dry-run", "--world", "384", "--pp", "4", "--ep", "12",
                 "--ac", "moe", "--micro-batch", "1"]) == 0
    out = capsys.readouterr().out
    assert "world 384 = PP 4 x DP 8 x EP 12" in out and "--ac moe" in out
    assert main(["--preset", "mula-220b-a10b", "--dry-run", "--world", "100", "--pp", "8", "--ep", "12"]) == 2
