"""The training loop: convergence of tiny-moe, equality with torch.optim.AdamW, exact resume, metrics
files, and real data-parallel processes on gloo matching one process over the same global batch."""
from __future__ import annotations

import copy
import json
import math
import os

import pytest
import torch

from fastmoe_xpu.dist import shard_state_dict
from fastmoe_xpu.dist.testing import run_distributed
from trainer.config import TrainConfig, validate
from trainer.records.metrics import SpikeDetector, read_metrics
from trainer.model.build import build_model, param_counts
from trainer.config.presets import get_preset
from trainer.optim.schedule import clipping_active, lr_at
from trainer.data import ShardedLoader, ensure_default_dataset, load_manifest
from trainer.model.loss import micro_batch_loss
from trainer.trainer import Trainer

from trainer_util import RTOL, assert_states_close, data_cache, one_thread, small_cfg  # noqa: F401 (fixtures)

def model_state(trainer: Trainer) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}


# ------------------------------------------------------------------------------------------ one process
def test_tiny_moe_loss_falls(data_cache, tmp_path) -> None:
    """A few hundred steps on the embedded corpus: the loss ends well below its start."""
    cfg = get_preset("tiny-moe")
    cfg.data.cache_dir = data_cache
    cfg.data.context = 32
    cfg.schedule.steps, cfg.schedule.micro_batch, cfg.schedule.warmup_steps = 200, 16, 20
    cfg.logging.out = str(tmp_path)
    cfg.logging.progress = False
    cfg.logging.peak_tflops = 1.0
    hist = Trainer(cfg).fit()
    first = hist[0]["loss"]
    assert abs(first - math.log(258)) < 0.3  # starts at chance over the byte vocabulary
    last = sum(r["loss"] for r in hist[-10:]) / 10
    assert last < 0.5 * first, (first, last)
    # files of the main job
    recs = read_metrics(str(tmp_path / "metrics.jsonl"))
    assert [r["step"] for r in recs] == list(range(1, 201))
    for key in ("loss", "lm_loss", "lb_loss", "z_loss", "lr", "grad_norm", "param_norm", "tokens_per_s", "mfu",
                "tokens_per_expert", "grad_spike", "grad_spikes"):
        assert key in recs[-1], key
    # every routed slot is counted: tokens x K per layer on average
    assert sum(recs[-1]["tokens_per_expert"]) == pytest.approx(16 * 32 * 2)
    assert recs[0]["lr"] == pytest.approx(3e-3 / 20) and recs[-1]["lr"] == pytest.approx(3e-4)
    with open(tmp_path / "loss.png", "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["steps"] == 200 and summary["loss_last"] == pytest.approx(hist[-1]["loss"])
    run = json.loads((tmp_path / "run.json").read_text())
    assert run["optimizer_state_bytes_rank0"] == run["optimizer_state_bytes_formula"]


def torch_reference(cfg: TrainConfig, steps: int) -> tuple[list[float], dict[str, torch.Tensor]]:
    """The same model, data and loss trained by torch.optim.AdamW + clip_grad_norm_, one process,
    through transformers' own ``forward`` (logits and router logits of the full model)."""
    cfg = copy.deepcopy(cfg)
    validate(cfg, 1)
    d, s, o, m = cfg.data, cfg.schedule, cfg.optim, cfg.model
    manifest = ensure_default_dataset(d.cache_dir, d.context, d.seed, progress=False)
    m.vocab_size = m.vocab_size or int(load_manifest(manifest)["tokenizer"]["vocab_size"])
    model = build_model(m, d.context, seed=cfg.seed)
    loader = ShardedLoader(manifest, s.global_batch, s.micro_batch)
    opt = torch.optim.AdamW(model.parameters(), lr=0.0, betas=(o.beta1, o.beta2), eps=o.eps,
                            weight_decay=o.weight_decay)
    losses = []
    for step in range(steps):
        micro = loader.next_batch()
        targets = float(sum(mb[1].numel() for mb in micro))
        total = 0.0
        for mb in micro:
            out = model(input_ids=mb[0], output_router_logits=m.is_moe) if m.is_moe else model(input_ids=mb[0])
            loss, _ = micro_batch_loss(m, out.logits, mb[1], out.router_logits if m.is_moe else None,
                                       global_targets=targets, micro_batches_global=s.global_batch // s.micro_batch)
            loss.backward()
            total += float(loss.detach())
        if clipping_active(step, s.warmup_steps):
            torch.nn.utils.clip_grad_norm_(model.parameters(), o.grad_clip)
        for g in opt.param_groups:
            g["lr"] = lr_at(step, peak=o.lr, minimum=s.min_lr, warmup=s.warmup_steps, total=s.steps)
        opt.step()
        opt.zero_grad()
        losses.append(total)
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("preset,moe_impl,optim", [
    ("tiny-moe", "fastmoe", "epso"),  # FastSparseMoeBlock patched in
    ("tiny-moe", "hf", "sharded"),  # transformers' own block: same trainer, other MoE implementation
    ("tiny-dense", "fastmoe", "adamw"),  # dense OLMo: no router, no expert bucket
])
def test_trainer_equals_torch_adamw(data_cache, tmp_path, preset, moe_impl, optim) -> None:
    cfg = small_cfg(data_cache, str(tmp_path), preset, model__moe_impl=moe_impl, optim__name=optim)
    trainer = Trainer(cfg)
    hist = trainer.fit()
    ref_losses, ref_state = torch_reference(cfg, cfg.schedule.steps)
    assert [r["loss"] for r in hist] == pytest.approx(ref_losses, rel=RTOL)
    assert any(r["grad_clipped"] for r in hist)  # the clipping path ran
    assert_states_close(model_state(trainer), ref_state)


@pytest.mark.parametrize("over", [
    {"model__autocast": "bf16"},  # bf16 autocast (the GPU default) on fp32 weights
    {"model__param_dtype": "bf16"},  # bf16 weights and gradients, fp32 master weights in the optimizer
    {"model__expert_precision": "int8"},  # every expert GEMM quantized to int8, forward and backward
])
def test_bf16_runs_track_fp32(data_cache, tmp_path, over) -> None:
    fp32 = [r["loss"] for r in Trainer(small_cfg(data_cache, str(tmp_path / "fp32"))).fit()]
    t = Trainer(small_cfg(data_cache, str(tmp_path / "bf16"), **over))
    if "model__expert_precision" in over:
        blocks = [m for m in t.model.modules() if hasattr(m, "expert_precision")]
        assert blocks and all(m.expert_precision == "int8" for m in blocks)
    bf16 = [r["loss"] for r in t.fit()]
    assert bf16 == pytest.approx(fp32, rel=2e-2)
    assert bf16[-1] < bf16[0]
    assert t.optimizer.state_bytes() == t.state_bytes_formula()  # master weights stay fp32
    assert all(b.master.dtype == torch.float32 for b in t.optimizer.buckets)


@pytest.mark.parametrize("over", [{}, {"model__param_dtype": "bf16"}], ids=["fp32", "bf16-params"])
def test_int8_steps_quantize_each_expert_weight_once_per_step(data_cache, tmp_path, monkeypatch, over) -> None:
    """With int8 experts, a step's first micro-batch quantizes each expert weight and the others (and
    every backward) take its codes back: one quantization per weight and step, where each of the 4
    micro-batches quantized again before; the losses and final weights are exactly those of
    quantizing in every forward, and each step quantizes the updated weights (bf16 params are
    written from fp32 masters: their new values are seen too)."""
    import contextlib

    import fastmoe_xpu
    from quantized_util import count_weight_codes

    made = count_weight_codes(monkeypatch)

    def run(name: str) -> tuple[list[float], list[int], dict]:
        t = Trainer(small_cfg(data_cache, str(tmp_path / name), steps=3, model__expert_precision="int8", **over))
        per_step, losses = [], []
        for _ in range(3):
            made.clear()
            losses.append(t.train_step()["loss"])
            per_step.append(len(made))
        n = len([p for p_name, p in t.model.named_parameters() if ".experts." in p_name])
        return losses, per_step, model_state(t), n

    once = run("once")
    with monkeypatch.context() as m:
        m.setattr(fastmoe_xpu, "frozen_expert_weights", contextlib.nullcontext)
        every = run("every")
    n_weights, micro = once[3], 4
    assert n_weights >= 4 and once[1] == [n_weights] * 3 and every[1] == [n_weights * micro] * 3, (once[1], every[1])
    assert once[0] == every[0]
    for k, v in once[2].items():
        assert torch.equal(v, every[2][k]), k


def test_resume_from_checkpoint_is_exact(data_cache, tmp_path) -> None:
    """3 steps, checkpoint, a fresh process-like Trainer resumes to step 6: bitwise the same as 6 steps."""
    full = Trainer(small_cfg(data_cache, str(tmp_path / "full")))
    full_hist = full.fit()
    part_cfg = small_cfg(data_cache, str(tmp_path / "part"), checkpoint__interval=3)
    Trainer(part_cfg).fit(steps=3)
    resumed = Trainer(part_cfg)
    hist = resumed.fit()
    assert resumed.step == 6 and [r["step"] for r in hist] == [4, 5, 6]
    assert [r["loss"] for r in hist] == [r["loss"] for r in full_hist[3:]]
    for k, v in model_state(full).items():
        assert torch.equal(v, model_state(resumed)[k]), k
    assert resumed.loader.state_dict() == full.loader.state_dict()
    lines = read_metrics(str(tmp_path / "part" / "metrics.jsonl"))
    assert [r["step"] for r in lines] == [1, 2, 3, 4, 5, 6]


def test_pure_bf16_stochastic_rounding_resumes_exactly(data_cache, tmp_path) -> None:
    """bf16 weights with no fp32 master, updates rounded stochastically: it tracks fp32, its state is
    8 bytes per parameter, and a checkpoint (which holds the rounding generator) resumes bitwise."""
    over = dict(model__param_dtype="bf16", optim__stochastic_rounding=True)
    fp32 = [r["loss"] for r in Trainer(small_cfg(data_cache, str(tmp_path / "fp32"))).fit()]
    full = Trainer(small_cfg(data_cache, str(tmp_path / "full"), **over))
    full_hist = full.fit()
    assert [r["loss"] for r in full_hist] == pytest.approx(fp32, rel=2e-2)
    assert all(b.master is None for b in full.optimizer.buckets)
    assert full.optimizer.state_bytes() == full.state_bytes_formula() == 8 * sum(
        p.numel() for p in full.model.parameters())
    part_cfg = small_cfg(data_cache, str(tmp_path / "part"), checkpoint__interval=3, **over)
    Trainer(part_cfg).fit(steps=3)
    resumed = Trainer(part_cfg)
    hist = resumed.fit()
    assert [r["loss"] for r in hist] == [r["loss"] for r in full_hist[3:]]
    for k, v in model_state(full).items():
        assert torch.equal(v, model_state(resumed)[k]), k


def test_state_dict_refuses_other_layout(data_cache, tmp_path) -> None:
    t = Trainer(small_cfg(data_cache, str(tmp_path)))
    state = t.state_dict()
    state["layout"]["dp"] = 2
    with pytest.raises(ValueError, match="saved by layout"):
        t.load_state_dict(state)


def test_param_counts_match_models_and_paper() -> None:
    for name in ("tiny-moe", "small-moe", "tiny-dense"):
        m = get_preset(name).model
        m.vocab_size = 258
        model = build_model(m, 16, seed=0)
        assert param_counts(m).total == sum(p.numel() for p in model.parameters()), name
    # the published totals / active counts (billions, rounded as in the paper's table)
    paper = {"mula-1b": (1.3, 1.3), "mula-7b-a1b": (6.9, 1.3), "mula-20b-a2b": (20, 2.4),
             "mula-100b-a7b": (100, 7.6), "mula-220b-a10b": (220, 10)}
    for name, (total, active) in paper.items():
        c = param_counts(get_preset(name).model)
        assert c.total / 1e9 == pytest.approx(total, rel=0.06), name
        assert c.active / 1e9 == pytest.approx(active, rel=0.06), name


def test_lr_schedule_and_spike_detector() -> None:
    kw = dict(peak=4e-4, minimum=4e-5, warmup=10, total=111)
    assert lr_at(0, **kw) == pytest.approx(4e-5) and lr_at(9, **kw) == pytest.approx(4e-4)
    assert lr_at(10, **kw) == pytest.approx(4e-4) and lr_at(110, **kw) == pytest.approx(4e-5)
    assert lr_at(60, **kw) == pytest.approx((4e-4 + 4e-5) / 2)  # cosine midpoint
    assert not clipping_active(9, 10) and clipping_active(10, 10)
    det = SpikeDetector(window=4, factor=2.0)
    flags = [det.update(x)[0] for x in [1.0, 1.1, 0.9, 1.0, 1.9, 2.5, 1.0, float("nan")]]
    # 1.9 < 2 x 1.0; 2.5 > 2 x mean(1.1, 0.9, 1.0, 1.9) = 2.45; NaN always counts
    assert flags == [False, False, False, False, False, True, False, True]
    assert det.count == 2


# ------------------------------------------------------------------------------------------ 2 and 4 processes
DP_RUNS = {
    "sharded_fp32": {"optim__name": "sharded"},
    "epso_bf16_reduce": {"optim__name": "epso", "optim__grad_reduce_dtype": "bf16"},
}


def _layout_worker(data_cache: str, out_dir: str, runs: dict[str, dict]) -> dict:
    import torch.distributed as dist

    out = {}
    for name, over in runs.items():
        cfg = small_cfg(data_cache, os.path.join(out_dir, name), **over)
        t = Trainer(cfg)
        hist = t.fit()
        out[name] = {"losses": [r["loss"] for r in hist], "state": model_state(t), "ep_rank": t.layout.ep_rank,
                     "layout": (t.layout.dp, t.layout.ep), "state_bytes": t.optimizer.state_bytes(),
                     "formula": t.state_bytes_formula(), "local_params": t.local_param_counts()}
        dist.barrier()
    return out


def single_process(data_cache: str, out: str) -> tuple[Trainer, list[float], dict[str, torch.Tensor]]:
    t = Trainer(small_cfg(data_cache, out))
    losses = [r["loss"] for r in t.fit()]
    return t, losses, model_state(t)


def test_dp2_equals_one_process(data_cache, tmp_path) -> None:
    results = run_distributed(_layout_worker, 2, data_cache, str(tmp_path), DP_RUNS, timeout_s=600)
    single, single_losses, single_state = single_process(data_cache, str(tmp_path / "single"))
    for rank, res in enumerate(results):
        r = res["sharded_fp32"]
        assert r["layout"] == (2, 1)
        assert r["losses"] == pytest.approx(single_losses, rel=RTOL), rank
        assert_states_close(r["state"], single_state)
        assert r["state_bytes"] == r["formula"]
        b = res["epso_bf16_reduce"]  # bf16 gradient reduction: bf16 tolerance
        assert b["losses"] == pytest.approx(single_losses, rel=1e-2)
        assert_states_close(b["state"], single_state, rtol=1e-2, atol=1e-2)
    # ZeRO-1 halves the optimizer state (up to padding); both replicas publish identical weights
    expert = param_counts(single.cfg.model).expert
    dense = sum(v.numel() for v in single_state.values()) - expert
    assert results[0]["sharded_fp32"]["state_bytes"] == 12 * (math.ceil(dense / 2) + math.ceil(expert / 2))
    for k, v in results[0]["sharded_fp32"]["state"].items():
        assert torch.equal(v, results[1]["sharded_fp32"]["state"][k]), k


EP_RUNS = {"epso_dp2_ep2": {"optim__name": "epso", "parallel__ep": 2},
           "sharded_dp2_ep2": {"optim__name": "sharded", "parallel__ep": 2}}


def test_dp2_ep2_epso_equals_one_process(data_cache, tmp_path) -> None:
    """4 processes: DP=2 x EP=2, each EP rank holding 4 of the 8 experts."""
    results = run_distributed(_layout_worker, 4, data_cache, str(tmp_path), EP_RUNS, timeout_s=600)
    single, single_losses, single_state = single_process(data_cache, str(tmp_path / "single"))
    dense_full = sum(v.numel() for k, v in single_state.items() if not k.endswith("_proj") or ".experts." not in k)
    for rank, res in enumerate(results):
        for name, r in res.items():
            assert r["layout"] == (2, 2)
            assert r["losses"] == pytest.approx(single_losses, rel=RTOL), (name, rank)
            want = shard_state_dict(single_state, r["ep_rank"], 2)
            assert_states_close({k: v for k, v in r["state"].items() if k in want}, want)
            assert r["state_bytes"] == r["formula"], (name, rank)
            dense, expert = r["local_params"]
            assert dense == dense_full and expert == param_counts(single.cfg.model).expert // 2
    epso, sharded = results[0]["epso_dp2_ep2"], results[0]["sharded_dp2_ep2"]
    dense, expert = epso["local_params"]
    # EPSO splits the non-expert states over all 4 ranks, ZeRO-1 over the 2 DP replicas only
    assert epso["state_bytes"] == 12 * (math.ceil(dense / 4) + math.ceil(expert / 2))
    assert sharded["state_bytes"] == 12 * (math.ceil(dense / 2) + math.ceil(expert / 2))
