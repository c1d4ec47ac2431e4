"""Data and expert parallelism on transformers MoE families (``--model.arch hf``, DP=2 and EP=2 with
both dispatchers): real gloo processes with EPSO train exactly like one process over the same global
batch (fp32, losses and gradient norms to 1e-5, every weight on the rank that holds it); compile,
and resume on another layout.

Families: Qwen3-MoE (softmax top-k, the family's aux loss), Mixtral, DeepSeek-V3 (sigmoid
group-limited router with the score-correction bias update, a shared expert, the first layer dense)
and GPT-OSS (transposed expert weights with biases, the clamped SwiGLU gate)."""
from __future__ import annotations

import json
import os

import pytest
import torch

from fastmoe_xpu.integrations.families import tiny_config
from parallel_util import run_workers
from trainer.config import validate
from trainer.trainer import Trainer
from trainer_util import RTOL, assert_states_close, data_cache, one_thread, small_cfg  # noqa: F401 (fixtures)


def family_cfg(data_cache: str, out: str, family: str, steps: int = 3, **over):
    """3 steps of tiny-qwen3-moe's sizes on ``family`` (DeepSeek-V3: a config.json with a dense first
    layer); EPSO; no validation pass. lr 1e-3: the EP exchange sums partial expert outputs in another
    order, and Adam turns that ~1e-7 rounding into an O(lr) move of elements whose gradient is ~0
    (measured: at 1e-3 one element of 4096 off by 1.3e-5, 1.04e-5 relative in norm of its tensor; losses
    and gradient norms equal to 1e-6)."""
    if family == "deepseek_v3_dense1":
        path = f"{out}.config.json"
        d = tiny_config("deepseek_v3", vocab_size=258, hidden_size=32, num_hidden_layers=2, first_k_dense_replace=1,
                        n_routed_experts=8, num_experts_per_tok=2, n_group=2, topk_group=1, moe_intermediate_size=32,
                        intermediate_size=48, n_shared_experts=1, num_attention_heads=4, num_key_value_heads=4,
                        max_position_embeddings=16).to_dict()
        tmp = f"{path}.{os.getpid()}"  # every rank writes it: atomically, so none reads a partial file
        with open(tmp, "w") as f:
            json.dump(d, f)
        os.replace(tmp, path)
        over = {"model__hf_config": path, "model__hf_family": "", **over}
    else:
        over = {"model__hf_family": family, **over}
    cfg = small_cfg(data_cache, out, "tiny-qwen3-moe", steps=steps, optim__name="epso", optim__lr=1e-3, **over)
    cfg.eval.enabled = False
    cfg.eval.moe_health = False
    return cfg


#: Activation checkpointing on top of EP for two families (recomputation changes no number).
AC = {"gpt_oss": "norm,attn,moe", "deepseek_v3_dense1": "moe"}


def _ep_worker(data_cache: str, out: str, family: str, dispatch: str) -> dict:
    """``dispatch``: EP=2 with that dispatcher (DP = the rest of the world), or ``"dp"``: no EP."""
    ep = {"ep": 1, "dispatch": "allgather"} if dispatch == "dp" else {"ep": 2, "dispatch": dispatch}
    t = Trainer(family_cfg(data_cache, out, family, parallel__ep=ep["ep"], model__ep_dispatch=ep["dispatch"],
                           parallel__ac=AC.get(family, "")))
    if family in AC:
        from trainer.parallelism.ac import checkpointed_modules

        assert checkpointed_modules(t.model)
    hist = t.fit()
    ids = {n.rpartition(".")[0]: b.clone() for n, b in t.model.named_buffers() if n.endswith("expert_ids")}
    state = {k: v.detach().clone() for k, v in t.model.state_dict().items() if not k.endswith("expert_ids")}
    bias = t.hf.state() if t.hf.routers else {}
    return {"losses": [r["loss"] for r in hist], "grad_norms": [r["grad_norm"] for r in hist], "state": state,
            "expert_ids": ids, "loads": [r["moe_tokens_per_expert"] for r in hist], "bias": bias,
            "describe": t.layout.describe()}


FAMILIES = ["qwen3_moe", "mixtral", "deepseek_v3_dense1", "gpt_oss"]


def _check_against(results: list[dict], ref: Trainer, hist: list[dict], label: str) -> None:
    ref_state = {k: v.detach().clone() for k, v in ref.model.state_dict().items()}
    for r in results:
        assert r["losses"] == pytest.approx([h["loss"] for h in hist], rel=RTOL), (label, r["describe"])
        assert r["grad_norms"] == pytest.approx([h["grad_norm"] for h in hist], rel=RTOL), label
        assert r["loads"] == [h["moe_tokens_per_expert"] for h in hist]  # summed over the DP x EP ranks
        assert r["bias"] == (ref.hf.state() if ref.hf.routers else {})
        mine = {}
        for k, v in r["state"].items():
            ids = r["expert_ids"].get(k.rpartition(".")[0])
            mine[k] = (v, ref_state[k][ids] if ids is not None else ref_state[k])
        # weights after Adam to lr / 10, elementwise and relative in norm: a wrong update moves an
        # element by ~lr, while a ~0 gradient's rounding flips it (see family_cfg)
        assert_states_close({k: a for k, (a, _) in mine.items()}, {k: b for k, (_, b) in mine.items()},
                            rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("family", FAMILIES)
def test_family_ep_equals_one_process(data_cache, tmp_path, family) -> None:
    ref = Trainer(validate(family_cfg(data_cache, str(tmp_path / "one"), family), 1))
    hist = ref.fit()
    if family == "deepseek_v3_dense1":  # the first layer is dense: only layer 1 has experts and a bias
        assert list(ref.hf.experts) == [1] and list(ref.hf.routers) == [1]
        assert any(v != 0 for v in ref.hf.state()["1"])
    for dispatch in ("allgather", "alltoall", "dp"):
        results = run_workers(_ep_worker, 2, data_cache, str(tmp_path / dispatch), family, dispatch)
        _check_against(results, ref, hist, dispatch)
        for r in results:
            assert len(r["expert_ids"]) == (0 if dispatch == "dp" else len(ref.hf.experts))
        if dispatch != "dp":
            halves = [sorted(int(i) for ids in r["expert_ids"].values() for i in ids[:1]) for r in results]
            assert halves[0] != halves[1]  # the two ranks hold different experts


def test_family_compile_equals_eager(data_cache, tmp_path) -> None:
    """``--compile`` (aot_eager) on a family through the trainer: DeepSeek-V3 (MLA attention, a dense
    first layer, the load-counting hook and the bias update under compile) trains to the eager losses
    and loads; compiled once, on the first step. (Every family's experts graph, custom gates and
    biases included, is compiled fullgraph by tests/test_compile_families.py.)"""
    family = "deepseek_v3_dense1"
    torch._dynamo.reset()
    eager = Trainer(validate(family_cfg(data_cache, str(tmp_path / "eager"), family, steps=2), 1)).fit()
    compiled = Trainer(validate(family_cfg(data_cache, str(tmp_path / "compiled"), family, steps=2,
                                           model__compile=True, model__compile_backend="aot_eager"), 1)).fit()
    assert [r["loss"] for r in compiled] == pytest.approx([r["loss"] for r in eager], rel=RTOL)
    assert [r["moe_tokens_per_expert"] for r in compiled] == [r["moe_tokens_per_expert"] for r in eager]
    assert [r["router_bias_absmax"] for r in compiled] == [r["router_bias_absmax"] for r in eager]
    assert compiled[0]["compile_s"] > 0 and compiled[1]["compile_s"] == 0.0


def _save_worker(data_cache: str, out: str, family: str) -> None:
    # the 3-step schedule, stopped after step 2 (a resume refuses another schedule)
    Trainer(family_cfg(data_cache, out, family, steps=3, parallel__ep=2, model__ep_dispatch="alltoall",
                       checkpoint__interval=2)).fit(steps=2)


def test_family_resume_on_another_layout(data_cache, tmp_path) -> None:
    """A DeepSeek-V3 checkpoint written at EP=2 (experts keyed by global id, the router bias in its
    metadata) resumes in one process and continues exactly as the uninterrupted one-process run."""
    family = "deepseek_v3_dense1"
    full = Trainer(validate(family_cfg(data_cache, str(tmp_path / "one"), family, steps=3), 1))
    hist = full.fit()
    run_workers(_save_worker, 2, data_cache, str(tmp_path / "ep"), family)
    again = Trainer(validate(family_cfg(data_cache, str(tmp_path / "ep"), family, steps=3, checkpoint__interval=2), 1))
    rest = again.fit()
    assert again.layout.world == 1 and [r["step"] for r in rest] == [3]
    assert rest[0]["loss"] == pytest.approx(hist[2]["loss"], rel=RTOL)
    assert rest[0]["router_bias_absmax"] == pytest.approx(hist[2]["router_bias_absmax"], rel=RTOL)


def _pp_worker(data_cache: str, out: str, family: str) -> dict:
    t = Trainer(family_cfg(data_cache, out, family, parallel__pp=2))
    hist = t.fit()
    state = {k: v.detach().clone() for k, v in t.model.state_dict().items()}
    return {"losses": [r["loss"] for r in hist], "grad_norms": [r["grad_norm"] for r in hist],
            "lb": [r["lb_loss"] for r in hist], "state": state, "stage": t.pipeline.modules[0].stage,
            "loads": [r["moe_tokens_per_expert"] for r in hist]}


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss", "deepseek_v3_dense1", "mixtral"])
def test_family_pp_equals_one_process(data_cache, tmp_path, family) -> None:
    """PP=2 (1F1B over the decoder layers, a layer per stage) on a family: the stages carry the router
    logits forward so the last computes the family's own aux loss; losses, the aux loss, gradient norms,
    expert loads (DeepSeek-V3: its bias update on the second stage) and every weight of each stage equal
    one process."""
    ref = Trainer(validate(family_cfg(data_cache, str(tmp_path / "one"), family), 1))
    hist = ref.fit()
    ref_state = {k: v.detach().clone() for k, v in ref.model.state_dict().items()}
    results = run_workers(_pp_worker, 2, data_cache, str(tmp_path / "pp"), family)
    assert sorted(r["stage"] for r in results) == [0, 1]
    names = set()
    for r in results:
        assert r["losses"] == pytest.approx([h["loss"] for h in hist], rel=RTOL), r["stage"]
        assert r["lb"] == pytest.approx([h["lb_loss"] for h in hist], rel=RTOL, abs=1e-9)
        assert r["grad_norms"] == pytest.approx([h["grad_norm"] for h in hist], rel=RTOL)
        # every stage's layers, gathered over the pipeline (the shape-inference forward not counted)
        assert r["loads"] == [h["moe_tokens_per_expert"] for h in hist]
        assert_states_close(r["state"], {k: ref_state[k] for k in r["state"]}, rtol=1e-4, atol=1e-4)
        names |= set(r["state"])
    assert {k for k in ref_state if k in names} == {k for k, _ in ref.model.named_parameters()} | \
        {k for k in names if k.endswith("e_score_correction_bias")}
    if family != "deepseek_v3_dense1":
        assert all(v > 0 for v in results[0]["lb"])  # the family's aux loss is on


def test_family_dp2_ep2_world4(data_cache, tmp_path) -> None:
    """World 4 = DP 2 x EP 2 (all-to-all) on DeepSeek-V3: the bias update from loads summed over the
    four data ranks, the shared expert replicated, experts split over EP and replicated over DP."""
    family = "deepseek_v3_dense1"
    ref = Trainer(validate(family_cfg(data_cache, str(tmp_path / "one"), family), 1))
    hist = ref.fit()
    results = run_workers(_ep_worker, 4, data_cache, str(tmp_path / "w4"), family, "alltoall")
    _check_against(results, ref, hist, "dp2 x ep2")
    assert [r["describe"].split(";")[0] for r in results] == ["world=4 = PP 1 x DP 2 x EP 2"] * 4


def _fsdp_worker(data_cache: str, out: str, family: str, ep: int) -> dict:
    t = Trainer(family_cfg(data_cache, out, family, parallel__ep=ep, model__ep_dispatch="alltoall",
                           parallel__dp_shard="fsdp"))
    from torch.distributed.tensor import DTensor

    dense = [p for n, p in t.model.named_parameters() if ".experts." not in n]
    assert dense and all(isinstance(p, DTensor) for p in dense)
    hist = t.fit()
    dense_local = sum(p.to_local().numel() for p in dense)
    expert_local = sum(p.numel() for n, p in t.model.named_parameters() if ".experts." in n)
    return {"losses": [r["loss"] for r in hist], "grad_norms": [r["grad_norm"] for r in hist],
            "dense": dense_local, "expert": expert_local, "state_bytes": t.optimizer.state_bytes()}


@pytest.mark.parametrize("family", FAMILIES)
def test_family_fsdp_equals_one_process(data_cache, tmp_path, family) -> None:
    """``--parallel.dp_shard fsdp`` at world 2 on each family: EP=2 (all-to-all) at DP=1, and for
    Qwen3-MoE also DP=2: FSDP2 shards the non-expert weights over the two ranks, experts stay EP;
    losses and gradient norms equal one process."""
    ref = Trainer(validate(family_cfg(data_cache, str(tmp_path / "one"), family), 1))
    hist = ref.fit()
    dense = sum(p.numel() for n, p in ref.model.named_parameters() if ".experts." not in n)
    expert = sum(p.numel() for n, p in ref.model.named_parameters() if ".experts." in n)
    for ep in ((1, 2) if family == "qwen3_moe" else (2,)):
        results = run_workers(_fsdp_worker, 2, data_cache, str(tmp_path / f"ep{ep}"), family, ep)
        for r in results:
            assert r["losses"] == pytest.approx([h["loss"] for h in hist], rel=RTOL), ep
            assert r["grad_norms"] == pytest.approx([h["grad_norm"] for h in hist], rel=RTOL), ep
            assert r["expert"] == expert // ep  # experts stay whole per EP rank, replicated over DP
            # fp32 master + two moments of this rank's dense shard and expert bucket shard
            assert r["state_bytes"] >= 12 * (r["dense"] + expert // ep // (2 // ep))
        # every dense weight lives on exactly one of the two ranks, each holding about half
        assert sum(r["dense"] for r in results) == dense
        assert all(r["dense"] < 0.6 * dense for r in results)
