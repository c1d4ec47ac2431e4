"""Pipeline parallelism: PP (x DP x EP) with 1F1B and the other schedules trains exactly like one process.

The reference is independent of the pipeline code: the whole transformers model with
``output_router_logits=True`` and fastmoe_xpu's ``load_balancing_loss`` / ``router_z_loss`` over all
layers, on the same global batch, micro-batch by micro-batch. The pipeline carries the router
statistics between stages instead (see trainer/parallelism/pipeline.py).
"""
from __future__ import annotations

import pytest
import torch

from parallel_util import run_workers, tiny_model
from tolerances import assert_close

STEPS = 3
MB, SEQ = 2, 12  # micro-batch and sequence length
LB_COEF, Z_COEF = 0.01, 0.001


def _batches(vocab: int, n_micro_global: int, steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(3)
    out = []
    for _ in range(steps):
        tokens = torch.randint(0, vocab, (n_micro_global * MB, SEQ + 1), generator=g)
        out.append((tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()))
    return out


def _reference_loss(model, input_ids, labels, n_micro_global: int, global_targets: float) -> torch.Tensor:
    from fastmoe_xpu import load_balancing_loss, router_z_loss

    cfg = model.config
    moe = cfg.model_type == "olmoe"
    out = model.model(input_ids=input_ids, output_router_logits=True) if moe else model.model(input_ids=input_ids)
    logits = model.lm_head(out.last_hidden_state)
    ce = torch.nn.functional.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), labels.reshape(-1),
                                           reduction="sum")
    loss = ce / global_targets
    if moe:
        rl = out.router_logits
        assert len(rl) == cfg.num_hidden_layers
        loss = loss + LB_COEF * load_balancing_loss(rl, cfg.num_experts, cfg.num_experts_per_tok) / n_micro_global
        loss = loss + Z_COEF * router_z_loss(rl) / n_micro_global
    return loss


def _pp_worker(arch: str, pp: int, dp: int, ep: int, schedule: str, virtual: int, n_micro: int, ac: str) -> dict:
    import torch.distributed as dist

    from fastmoe_xpu.dist import ParallelMesh
    from trainer.parallelism.ac import apply_activation_checkpointing
    from trainer.model.loss import MoeLossConfig
    from trainer.parallelism.pipeline import Pipeline

    mesh = ParallelMesh(pp=pp, dp=dp, ep=ep, device_type="cpu")
    n_global = n_micro * dp * ep  # every DP x EP rank reads its own micro-batches
    ref = tiny_model(arch, seed=0)
    cfg = ref.config
    moe = arch == "olmoe"
    batches = _batches(cfg.vocab_size, n_global, STEPS)
    loss_cfg = MoeLossConfig(num_layers=cfg.num_hidden_layers, num_experts=cfg.num_experts if moe else 0,
                             top_k=cfg.num_experts_per_tok if moe else 0, load_balancing_coef=LB_COEF,
                             z_loss_coef=Z_COEF, micro_batches_global=n_global)
    pipe = Pipeline(lambda sid: tiny_model(arch, seed=0, ep_group=mesh.ep_group), pp_rank=mesh.pp_rank, pp=pp,
                    group=mesh.pp_group, device=torch.device("cpu"), n_microbatches=n_micro, schedule=schedule,
                    virtual=virtual, loss_cfg=loss_cfg, prepare=lambda m: apply_activation_checkpointing(m, ac))
    params = dict(pipe.named_parameters())
    experts = {n for n in params if ".experts." in n}
    # which global experts each local expert tensor holds, to compare with the whole model's
    expert_ids = {n: m.get_submodule(n.rpartition(".")[0]).expert_ids.clone()
                  for m in pipe.modules for n, _ in m.named_parameters() if n in experts}

    def as_ref(name: str, t: torch.Tensor) -> torch.Tensor:
        return t[expert_ids[name]] if name in expert_ids else t

    opt = torch.optim.AdamW(params.values(), lr=1e-3, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.1)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.1)
    losses, ref_losses, grad_pairs = [], [], []
    for input_ids, labels in batches:
        global_targets = float(labels.numel())
        # reference: one process, every micro-batch of the global batch
        for i in range(n_global):
            sl = slice(i * MB, (i + 1) * MB)
            _reference_loss(ref, input_ids[sl], labels[sl], n_global, global_targets).backward()
        ref_grads = {n: p.grad.clone() for n, p in ref.named_parameters()}
        with torch.no_grad():
            total = torch.zeros(())
            for i in range(n_global):
                sl = slice(i * MB, (i + 1) * MB)
                total += _reference_loss(ref, input_ids[sl], labels[sl], n_global, global_targets)
        ref_losses.append(float(total))
        ref_opt.step()
        ref_opt.zero_grad(set_to_none=True)
        # pipeline: this DP x EP rank's contiguous slice of the global batch
        loss_cfg.global_targets = global_targets
        mine = slice(mesh.dp_ep_rank * n_micro * MB, (mesh.dp_ep_rank + 1) * n_micro * MB)
        parts = pipe.step(input_ids[mine], labels[mine])
        for n, p in params.items():  # gradients are sums over the replicas of each weight
            group = mesh.dp_group if n in experts else mesh.dp_ep_group
            if group is not None and dist.get_world_size(group) > 1:
                dist.all_reduce(p.grad, group=group)
        step_loss = torch.tensor([sum((float(p.lm + LB_COEF * p.lb + Z_COEF * p.z) for p in parts), 0.0)])
        dist.all_reduce(step_loss)  # only the last stage's ranks contribute
        losses.append(float(step_loss))
        grad_pairs.append({n: (p.grad.clone(), as_ref(n, ref_grads[n])) for n, p in params.items()})
        opt.step()
        opt.zero_grad(set_to_none=True)
    ref_state = dict(ref.named_parameters())
    return {"rank": mesh.rank, "dp_ep_rank": mesh.dp_ep_rank, "losses": losses, "ref_losses": ref_losses,
            "grads": grad_pairs, "experts_split": bool(experts) and ep > 1 and all(
                params[n].shape[0] < ref_state[n].shape[0] for n in experts),
            "weights": {n: (p.detach().clone(), as_ref(n, ref_state[n].detach())) for n, p in params.items()},
            "names": sorted(params), "all_names": sorted(ref_state)}


@pytest.mark.parametrize("arch,pp,dp,ep,schedule,virtual,n_micro,ac", [
    ("olmoe", 2, 1, 1, "1f1b", 1, 4, ""),                  # PP=2, 1F1B, MoE: router statistics cross the stage boundary
    ("olmoe", 2, 1, 2, "1f1b", 1, 2, ""),                  # PP=2 x EP=2: experts split inside each stage
    ("olmoe", 2, 2, 1, "1f1b", 1, 2, "moe"),               # PP=2 x DP=2 on one mesh, checkpointed experts
    ("olmo", 2, 1, 1, "gpipe", 1, 3, ""),                  # dense model, GPipe, micro-batches not a multiple of PP
    ("olmoe", 2, 1, 1, "interleaved1f1b", 2, 4, "norm,attn"),  # 2 stages per rank (4 stages of one layer each)
])
def test_pipeline_matches_one_process(arch, pp, dp, ep, schedule, virtual, n_micro, ac):
    res = run_workers(_pp_worker, pp * dp * ep, arch, pp, dp, ep, schedule, virtual, n_micro, ac)
    # the stages of one pipeline (dp = ep = 0) hold every parameter exactly once
    names = [n for r in res if r["dp_ep_rank"] == 0 for n in r["names"]]
    assert sorted(names) == res[0]["all_names"]
    if ep > 1:
        assert all(r["experts_split"] for r in res), "experts were not split over EP"
    for r in res:
        assert_close(torch.tensor(r["losses"]), torch.tensor(r["ref_losses"]), msg=f"rank {r['rank']} losses")
        for step, g in enumerate(r["grads"]):
            for n, (mine, ref) in g.items():
                assert_close(mine, ref, msg=f"rank {r['rank']} step {step} grad {n}")
        for n, (mine, ref) in r["weights"].items():
            assert_close(mine, ref, msg=f"rank {r['rank']} weight {n}")


def test_1f1b_needs_enough_micro_batches():
    from trainer.parallelism.pipeline import Pipeline

    with pytest.raises(ValueError, match="at least as many micro-batches"):
        Pipeline(lambda sid: None, pp_rank=0, pp=4, group=None, device=torch.device("cpu"), n_microbatches=2)


@pytest.mark.parametrize("arch,stage", [
    ("olmoe", 0),  # first stage: embedding, routers, experts, RMSNorms
    ("olmo", 1),   # last stage of a dense model: weightless LayerNorms, LM head
])
def test_stage_built_on_meta_is_materialized_like_an_eager_one(arch, stage):
    """Only the stage is allocated; its parameters, buffers and initialisation match an eagerly
    built stage's (names, shapes, dtypes, rotary frequencies, norm weights, init scale)."""
    from trainer.parallelism.pipeline import StageModel, materialize

    eager = StageModel(tiny_model(arch, seed=0), stage, 2)
    with torch.device("meta"):
        lazy = StageModel(tiny_model(arch, seed=0), stage, 2)
    assert all(p.is_meta for p in lazy.parameters())
    materialize(lazy, "cpu", seed=1)
    e_state, l_state = eager.state_dict(), lazy.state_dict()
    assert list(e_state) == list(l_state)
    for k in e_state:
        assert (e_state[k].shape, e_state[k].dtype) == (l_state[k].shape, l_state[k].dtype), k
        if "norm" in k:
            assert torch.equal(l_state[k], torch.ones_like(l_state[k])), k
        elif e_state[k].numel() >= 512:
            assert abs(float(l_state[k].std()) - 0.02) < 0.004, k
    for (n, b), (_, b2) in zip(eager.named_buffers(), lazy.named_buffers()):
        assert torch.equal(b, b2), n
    x = torch.randint(0, 61, (1, 8)) if stage == 0 else torch.randn(1, 8, eager.config.hidden_size)
    out = lazy(x)
    assert all(torch.isfinite(t).all() for t in out)
