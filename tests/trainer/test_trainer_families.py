"""The trainer on transformers MoE families (``--model.arch hf``): the tiny-qwen3-moe and
tiny-deepseek-v3 presets train, equal transformers' eager experts at the first step, DeepSeek-V3's
score-correction bias moves towards balance, ``--model.hf_config`` loads a config.json, and what
is not supported is refused with a clear error."""
from __future__ import annotations

import json

import pytest
import torch

from fastmoe_xpu.integrations.families import tiny_config
from trainer.cli import config_from_args
from trainer.config import ConfigError, validate
from trainer.trainer import Trainer

from trainer_util import data_cache, one_thread, small_cfg  # noqa: F401 (fixtures)

FAMILY_PRESETS = ["tiny-qwen3-moe", "tiny-deepseek-v3"]


def fit(cfg) -> tuple[Trainer, list[dict]]:
    trainer = Trainer(validate(cfg, 1))
    return trainer, trainer.fit()


def _small(data_cache: str, out: str, preset: str, steps: int, **over):
    cfg = small_cfg(data_cache, out, preset=preset, steps=steps, **over)
    cfg.eval.enabled = False  # no validation pass: these tests time the training steps only
    return cfg


@pytest.mark.parametrize("preset", FAMILY_PRESETS)
def test_family_preset_loss_falls(data_cache, tmp_path, preset) -> None:
    trainer, hist = fit(_small(data_cache, str(tmp_path), preset, 20))
    assert trainer.cfg.model.is_hf and trainer.hf is not None
    first, last = hist[0]["loss"], sum(r["loss"] for r in hist[-3:]) / 3
    assert last < first - 0.5, (first, last)
    for r in hist:
        # every routed slot counted once per MoE layer: 8 instances x 16 tokens x top-2
        assert [sum(row) for row in r["moe_tokens_per_expert"]] == [8 * 16 * 2] * 2
    recs = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert len(recs) == 20 and "moe_load_cv" in recs[-1] and "expert_load_max_over_mean" in recs[-1]


def test_family_losses_are_the_familys_own(data_cache, tmp_path) -> None:
    """Qwen3-MoE adds its load-balancing aux loss with its own coefficient; DeepSeek-V3 none (bias instead)."""
    q = validate(_small(data_cache, str(tmp_path / "q"), "tiny-qwen3-moe", 1), 1)
    assert q.model.load_balancing_coef == pytest.approx(0.001) and q.model.z_loss_coef == 0.0
    d = validate(_small(data_cache, str(tmp_path / "d"), "tiny-deepseek-v3", 1), 1)
    assert d.model.load_balancing_coef == 0.0
    _, hist = fit(q)
    r = hist[0]
    assert r["lb_loss"] > 0 and r["loss"] == pytest.approx(r["lm_loss"] + 0.001 * r["lb_loss"], rel=1e-6)
    assert "router_bias_absmax" not in r  # no score-correction bias: nothing to update


@pytest.mark.parametrize("preset", FAMILY_PRESETS)
def test_first_step_equals_eager(data_cache, tmp_path, preset) -> None:
    """fp32: experts_implementation="fastmoe" and transformers' "eager" give the same first step:
    loss parts, expert loads, every gradient (1e-5) and the gradient norm. (Weights after Adam's first
    step are no measure: it moves an element by ~lr * sign(grad), so a ~0 gradient's rounding flips it.)"""
    runs = {}
    for impl in ("fastmoe", "hf"):
        trainer = Trainer(validate(_small(data_cache, str(tmp_path / impl), preset, 1, model__moe_impl=impl), 1))
        assert trainer.model.config._experts_implementation == {"fastmoe": "fastmoe", "hf": "eager"}[impl]
        parts = trainer.forward_backward(trainer.loader.next_batch())
        grads = [b.flat_grad.detach().clone() for b in trainer.optimizer.buckets]
        loads = trainer.hf.end_step(None)["moe_tokens_per_expert"]
        runs[impl] = (parts, grads, loads, trainer.optimizer_step()["grad_norm"])
    (pa, ga, la, na), (pb, gb, lb, nb) = runs["fastmoe"], runs["hf"]
    for key in ("lm", "lb", "z"):
        torch.testing.assert_close(getattr(pa, key), getattr(pb, key), rtol=1e-5, atol=1e-7, msg=key)
    assert la == lb
    assert len(ga) == len(gb) and sum(g.numel() for g in ga) > 0
    for a, b in zip(ga, gb):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
        assert float((a - b).norm() / b.norm()) <= 1e-5
    assert na == pytest.approx(nb, rel=1e-5)


def test_deepseek_bias_moves_towards_balance(data_cache, tmp_path) -> None:
    """Frozen weights (lr 0), so only the bias changes routing: after step 1 each bias is
    ``rate * sign(mean_load - load)`` of step 1's loads, and over 15 steps the load spread falls
    well below the same run without the update (measured: CV ~0.2 against ~0.45)."""
    rate = 0.003
    cv = {}
    for r_ in (0.0, rate):
        cfg = _small(data_cache, str(tmp_path / str(r_)), "tiny-deepseek-v3", 15, optim__lr=0.0,
                     model__router_bias_update_rate=r_)
        cfg.schedule.min_lr = 0.0
        trainer = Trainer(validate(cfg, 1))
        rec1 = trainer.train_step()
        if r_ > 0:
            for layer, router in sorted(trainer.hf.routers.items()):
                load = torch.tensor(rec1["moe_tokens_per_expert"][trainer.hf.layers.index(layer)], dtype=torch.float64)
                want = (rate * torch.sign(load.mean() - load)).float()
                torch.testing.assert_close(router.e_score_correction_bias.detach().cpu(), want, rtol=0, atol=0)
                assert bool((want != 0).any())
        hist = [rec1] + [trainer.train_step() for _ in range(14)]
        cv[r_] = sum(sum(r["moe_load_cv"]) for r in hist[-5:]) / 10
    assert cv[rate] < 0.7 * cv[0.0], cv


def test_bias_survives_resume(data_cache, tmp_path) -> None:
    cfg = _small(data_cache, str(tmp_path), "tiny-deepseek-v3", 2, checkpoint__interval=2)
    trainer, _ = fit(cfg)
    saved = trainer.hf.state()
    assert any(any(v != 0 for v in b) for b in saved.values())
    again = Trainer(validate(_small(data_cache, str(tmp_path), "tiny-deepseek-v3", 2, checkpoint__interval=2), 1))
    assert again.resume() and again.hf.state() == saved


def test_hf_config_file(data_cache, tmp_path) -> None:
    """``--model.hf_config`` on the command line: a config.json written here (or its directory) is the
    model; its sizes replace the preset's."""
    hf = tiny_config("qwen3_moe", vocab_size=300, hidden_size=48, num_experts=6, num_local_experts=6, num_experts_per_tok=3,
                     moe_intermediate_size=40)
    hf.to_json_file(str(tmp_path / "config.json"))
    for path in (tmp_path / "config.json", tmp_path):
        cfg, _ = config_from_args(["--preset", "tiny-moe", "--model.hf_config", str(path)])
        validate(cfg, 1)
        m = cfg.model
        assert (m.arch, m.hidden_size, m.num_experts, m.top_k, m.intermediate_size, m.vocab_size) == \
            ("hf", 48, 6, 3, 40, 300)
    run = _small(data_cache, str(tmp_path / "out"), "tiny-moe", 2, model__hf_config=str(tmp_path / "config.json"))
    trainer, hist = fit(run)
    assert trainer.model.config.model_type == "qwen3_moe" and trainer.model.config.num_experts == 6
    assert trainer.model.config._experts_implementation == "fastmoe"
    assert len(hist[-1]["moe_tokens_per_expert"][0]) == 6


def _bad(tmp_path, text: str) -> str:
    p = tmp_path / "bad.json"
    p.write_text(text)
    return str(p)


@pytest.mark.parametrize("case,match", [
    ("missing", "no such config.json"),
    ("not_json", "not a JSON file"),
    ("no_model_type", "no 'model_type'"),
    ("unknown_type", "knows no model_type"),
    ("dense", "not a mixture of experts"),
])
def test_bad_hf_config(tmp_path, case, match) -> None:
    texts = {"not_json": "{not json", "no_model_type": '{"hidden_size": 8}',
             "unknown_type": '{"model_type": "no_such_family"}'}
    if case == "missing":
        path = str(tmp_path / "nope.json")
    elif case == "dense":
        tiny_config("llama").to_json_file(str(tmp_path / "llama.json"))
        path = str(tmp_path / "llama.json")
    else:
        path = _bad(tmp_path, texts[case])
    cfg, _ = config_from_args(["--preset", "tiny-moe", "--model.hf_config", path])
    with pytest.raises(ConfigError, match=match):
        validate(cfg, 1)


@pytest.mark.parametrize("flags,match", [
    (["--ep", "2", "--model.moe_impl", "hf"], "needs --model.moe_impl fastmoe"),
    (["--ep", "3"], "not divisible by EP=3"),
    (["--tp", "2"], "TP is implemented for the dense model"),
    (["--pp", "2", "--parallel.pp_meta_init"], "pp_meta_init"),
    (["--parallel.dp_shard", "fsdp", "--optim.moments_dtype", "bf16"], "fsdp does not combine with --optim.moments_dtype"),
    (["--model.hf_family", "no_such_family"], "hf_family"),
    (["--model.router_bias_update_rate", "-1"], "router_bias_update_rate"),
    (["--model.hf_config", "x.json"], "exactly one of"),
    (["--model.hf_family", ""], "exactly one of"),
])
def test_bad_hf_inputs(flags, match) -> None:
    cfg, _ = config_from_args(["--preset", "tiny-deepseek-v3", *flags])
    with pytest.raises(ConfigError, match=match):
        validate(cfg, int(flags[1]) if flags[0] in ("--ep", "--pp", "--tp") else 1)


@pytest.mark.parametrize("preset", ["tiny-moe", "tiny-dense", "tiny-qwen3-moe"])
def test_fsdp_takes_every_arch_with_checkpoints_and_export(preset) -> None:
    cfg, _ = config_from_args(["--preset", preset, "--parallel.dp_shard", "fsdp", "--checkpoint.interval", "5",
                               "--checkpoint.model_interval", "5", "--eval.export_hf", "x"])
    validate(cfg, 2)


def test_family_needs_arch_hf() -> None:
    cfg, _ = config_from_args(["--preset", "tiny-dense", "--model.hf_family", "qwen3_moe"])
    with pytest.raises(ConfigError, match="need --model.arch hf"):
        validate(cfg, 1)


def test_vocab_smaller_than_data_refused(data_cache, tmp_path) -> None:
    tiny_config("qwen3_moe", vocab_size=100).to_json_file(str(tmp_path / "config.json"))
    cfg = _small(data_cache, str(tmp_path / "out"), "tiny-moe", 1, model__hf_config=str(tmp_path / "config.json"))
    with pytest.raises(ConfigError, match="smaller than the tokenizer"):
        Trainer(validate(cfg, 1))
