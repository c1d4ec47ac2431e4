"""ReplicatedAdamW, ShardedAdamW and EPSO against torch.optim.AdamW on the whole model.

Single process: every kind degenerates to one shard and must match torch exactly (with and
without clipping). Four real processes on gloo (DP=2 x EP=2): each rank holds the shared weights
and the "experts" of its EP index; the result must equal torch.optim.AdamW on the full set of
weights trained on the summed losses of all ranks, and the measured state bytes the formula.
"""
from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn as nn

from fastmoe_xpu.dist.sharding import is_expert_weight
from fastmoe_xpu.dist.testing import run_distributed
from trainer.optim import EPSO, OPTIMIZERS, ShardedAdamW, state_bytes_formula

BETAS, EPS, WD = (0.9, 0.99), 1e-8, 0.1
RTOL, ATOL = 1e-5, 1e-7  # fp32


class Toy(nn.Module):
    """Shared weights (7x5 odd size, a bias of 7) and one 'expert' tensor [3, 5] of this EP rank."""

    def __init__(self, expert_init: torch.Tensor) -> None:
        super().__init__()
        self.dense = nn.Linear(5, 7)
        self.moe = nn.Module()
        self.moe.experts = nn.Module()
        self.moe.experts.gate_up_proj = nn.Parameter(expert_init.clone())

    def loss(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.dense(x))  # [B, 7]
        e = torch.tanh(x @ self.moe.experts.gate_up_proj.t())  # [B, 3]
        return (h.sum(-1) * e.sum(-1)).square().mean() + h.square().mean()


def make_data(step: int, rank: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(4, 5, generator=g)


def init_weights(ep: int) -> tuple[dict[str, torch.Tensor], list[torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    dense = {"weight": torch.randn(7, 5, generator=g) * 0.5, "bias": torch.randn(7, generator=g) * 0.5}
    experts = [torch.randn(3, 5, generator=g) * 0.5 for _ in range(ep)]
    return dense, experts


def lr_clip(step: int) -> tuple[float, float | None]:
    return 0.05 * (0.9 ** step), (0.3 if step >= 2 else None)  # clipping from step 2, as after warmup


def reference(dp: int, ep: int, steps: int) -> tuple[dict[str, torch.Tensor], list[torch.Tensor]]:
    """torch.optim.AdamW on all weights; loss = sum over the DP x EP ranks of each rank's loss."""
    dense, experts = init_weights(ep)
    models = [Toy(experts[e]) for e in range(ep)]
    for m in models:  # one shared dense layer
        m.dense = models[0].dense
    with torch.no_grad():
        models[0].dense.weight.copy_(dense["weight"])
        models[0].dense.bias.copy_(dense["bias"])
    params = list(models[0].dense.parameters()) + [m.moe.experts.gate_up_proj for m in models]
    opt = torch.optim.AdamW(params, lr=0.0, betas=BETAS, eps=EPS, weight_decay=WD)
    for step in range(steps):
        total = sum(models[r % ep].loss(make_data(step, r)) for r in range(dp * ep))
        total.backward()
        lr, clip = lr_clip(step)
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(params, clip)
        for group in opt.param_groups:
            group["lr"] = lr
        opt.step()
        opt.zero_grad()
    return ({"weight": models[0].dense.weight.detach(), "bias": models[0].dense.bias.detach()},
            [m.moe.experts.gate_up_proj.detach() for m in models])


@pytest.mark.parametrize("kind", list(OPTIMIZERS))
@pytest.mark.parametrize("grad_clip", [False, True])
def test_single_process_equals_torch_adamw(kind: str, grad_clip: bool) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3))
    ref = copy.deepcopy(model)
    opt = OPTIMIZERS[kind](model.named_parameters(), is_expert=lambda n: n.startswith("2."), betas=BETAS,
                           eps=EPS, weight_decay=WD)
    ropt = torch.optim.AdamW(ref.parameters(), lr=1e-2, betas=BETAS, eps=EPS, weight_decay=WD)
    for step in range(12):
        x = make_data(step, 0)
        model(x).square().sum().backward()
        ref(x).square().sum().backward()
        clip = 0.5 if grad_clip and step >= 3 else None
        norms = opt.step(1e-2, clip)
        ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), clip if clip else float("inf"))
        ropt.step()
        ropt.zero_grad()
        assert math.isclose(norms["grad_norm"], float(ref_norm), rel_tol=1e-5)
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=RTOL, atol=ATOL)
    n = sum(p.numel() for p in model.parameters())
    assert opt.state_bytes() == 12 * n


def test_gradients_set_to_none_are_still_reduced() -> None:
    """A caller that zeroes with set_to_none (or swaps p.grad) must not lose gradients."""
    torch.manual_seed(0)
    model = nn.Linear(5, 3)
    ref = copy.deepcopy(model)
    opt = EPSO(model.named_parameters(), is_expert=lambda n: False, betas=BETAS, eps=EPS, weight_decay=WD)
    ropt = torch.optim.AdamW(ref.parameters(), lr=1e-2, betas=BETAS, eps=EPS, weight_decay=WD)
    model.zero_grad(set_to_none=True)
    x = make_data(0, 0)
    model(x).sum().backward()
    ref(x).sum().backward()
    opt.step(1e-2)
    ropt.step()
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=RTOL, atol=ATOL)


def test_bucket_rejects_mixed_dtypes() -> None:
    model = nn.Linear(4, 3)
    model.bias.data = model.bias.data.to(torch.bfloat16)
    with pytest.raises(TypeError, match="mixes dtypes"):
        ShardedAdamW(model.named_parameters(), is_expert=lambda n: False)


def test_state_bytes_formula_values() -> None:
    # odd sizes pad up to the next multiple of the shard count
    assert state_bytes_formula("adamw", 10, 6, dp=2, ep=2) == 12 * 16
    assert state_bytes_formula("sharded", 10, 6, dp=4, ep=2) == 12 * (3 + 2)
    assert state_bytes_formula("epso", 10, 6, dp=4, ep=2) == 12 * (2 + 2)
    # 7B-A1B, DP=64 x EP=8: EPSO shards the 0.4B non-expert weights 8x further than ZeRO-1
    dense, expert = 273_000_000, 6_442_450_944 // 8
    assert state_bytes_formula("epso", dense, expert, 64, 8) < state_bytes_formula("sharded", dense, expert, 64, 8)
    with pytest.raises(ValueError, match="kind must be one of"):
        state_bytes_formula("zero3", 1, 1, 1, 1)


# ------------------------------------------------------------------------------------------ 4 processes
def _dp_ep_worker(dp: int, ep: int, steps: int) -> dict:
    from trainer.layout import build_layout

    lay = build_layout(1, dp, ep, torch.device("cpu"))
    out = {}
    for kind, cls in OPTIMIZERS.items():
        dense, experts = init_weights(ep)
        model = Toy(experts[lay.ep_rank])
        with torch.no_grad():
            model.dense.weight.copy_(dense["weight"])
            model.dense.bias.copy_(dense["bias"])
        opt = cls(model.named_parameters(), is_expert=is_expert_weight, dp_group=lay.dp_group, ep_group=lay.ep_group,
                  dpep_group=lay.dpep_group, norm_group=lay.world_group, betas=BETAS, eps=EPS, weight_decay=WD)
        for step in range(steps):
            model.loss(make_data(step, lay.data_rank)).backward()
            lr, clip = lr_clip(step)
            opt.step(lr, clip)
        n_dense = sum(p.numel() for n, p in model.named_parameters() if not is_expert_weight(n))
        n_expert = sum(p.numel() for n, p in model.named_parameters() if is_expert_weight(n))
        out[kind] = {
            "weight": model.dense.weight.detach().clone(), "bias": model.dense.bias.detach().clone(),
            "expert": model.moe.experts.gate_up_proj.detach().clone(), "ep_rank": lay.ep_rank,
            "state_bytes": opt.state_bytes(),
            "formula": state_bytes_formula(kind, n_dense, n_expert, dp, ep),
        }
    return out


def test_dp2_ep2_all_kinds_equal_torch_adamw() -> None:
    dp, ep, steps = 2, 2, 5
    results = run_distributed(_dp_ep_worker, dp * ep, dp, ep, steps)
    ref_dense, ref_experts = reference(dp, ep, steps)
    for rank, res in enumerate(results):
        for kind, r in res.items():
            torch.testing.assert_close(r["weight"], ref_dense["weight"], rtol=RTOL, atol=ATOL, msg=f"{kind} rank {rank}")
            torch.testing.assert_close(r["bias"], ref_dense["bias"], rtol=RTOL, atol=ATOL, msg=f"{kind} rank {rank}")
            torch.testing.assert_close(r["expert"], ref_experts[r["ep_rank"]], rtol=RTOL, atol=ATOL,
                                       msg=f"{kind} rank {rank}")
            assert r["state_bytes"] == r["formula"], (kind, rank)
    # dense: 7*5 + 7 = 42 elements, expert 15 per EP rank
    got = results[0]
    assert got["adamw"]["state_bytes"] == 12 * (42 + 15)
    assert got["sharded"]["state_bytes"] == 12 * (21 + 8)  # dense over DP=2, expert over DP=2 (15 -> 16)
    assert got["epso"]["state_bytes"] == 12 * (11 + 8)  # dense over DP x EP = 4 (42 -> 44)


# ------------------------------------------------------------------ pure bf16: no master, rounded updates
def test_stochastic_round_is_unbiased_between_neighbours() -> None:
    from trainer.optim import stochastic_round

    g = torch.Generator().manual_seed(0)
    x = torch.tensor([1.0 + 2 ** -10, -3.0 - 2 ** -9, 0.0, 2 ** -130, 1.0], dtype=torch.float32)
    draws = torch.stack([stochastic_round(x, torch.bfloat16, g).float() for _ in range(4000)])
    lo = x.bfloat16().float()  # nearest, here the lower magnitude for the first two
    step = torch.tensor([2 ** -7, 2 ** -6, 0.0, 0.0, 0.0])
    for i in range(len(x)):
        values = set(draws[:, i].tolist())
        assert values <= {lo[i].item(), (lo[i] + torch.sign(x[i]) * step[i]).item()}, (i, values)
    # E[round(x)] = x: 1 + 2^-10 sits 1/8 of the way to the next bf16 value
    torch.testing.assert_close(draws.mean(0)[:2], x[:2], rtol=0, atol=2e-4)
    assert draws[:, 2].eq(0).all() and draws[:, 4].eq(1).all()  # exact values never move
    assert 0.05 < (draws[:, 0] > 1).float().mean() < 0.2


def _bf16_run(master: str, steps: int, moments=torch.float32, state=None, start=0):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3)).bfloat16()
    opt = ShardedAdamW(model.named_parameters(), is_expert=lambda n: n.startswith("2."), betas=BETAS, eps=EPS,
                       weight_decay=WD, master=master, moments_dtype=moments, rounding_seed=7)
    if state is not None:
        model.load_state_dict(state[0])
        opt.load_state_dict(state[1])
    for step in range(start, start + steps):
        model(make_data(step, 0).bfloat16()).float().square().sum().backward()
        opt.step(1e-3)
    return model, opt


@pytest.mark.parametrize("moments", [torch.float32, torch.bfloat16])
def test_stochastic_rounding_resumes_exactly(moments) -> None:
    """6 steps == 3 steps, a state dict (weights, moments, the rounding generator), 3 more steps."""
    whole, _ = _bf16_run("stochastic", 6, moments)
    first, opt = _bf16_run("stochastic", 3, moments)
    saved = (copy.deepcopy(first.state_dict()), copy.deepcopy(opt.state_dict()))
    assert "rounding_rng" in saved[1]
    resumed, _ = _bf16_run("stochastic", 3, moments, state=saved, start=3)
    for p, q in zip(whole.parameters(), resumed.parameters()):
        assert p.dtype == torch.bfloat16 and torch.equal(p, q)
    n = sum(p.numel() for p in whole.parameters())
    assert opt.state_bytes() == n * (8 if moments == torch.float32 else 4)
    assert all(b.master is None for b in opt.buckets)


def test_small_updates_survive_only_with_stochastic_rounding() -> None:
    """An update far below bf16's spacing is lost rounding to nearest, kept on average stochastically,
    and the fp32 master keeps it exactly: the reason pure bf16 needs stochastic rounding."""
    out = {}
    for master in ("none", "stochastic", "fp32"):
        w = nn.Parameter(torch.ones(4096, dtype=torch.bfloat16))
        opt = ShardedAdamW([("w", w)], is_expert=lambda n: False, betas=(0.0, 0.0), eps=1e-30, weight_decay=0.0,
                           master=master, rounding_seed=1)
        for _ in range(20):
            w.grad = torch.ones_like(w)
            opt.step(2 ** -12)  # Adam's step is lr * sign: 1/32 of bf16's spacing at 1.0 per step
        out[master] = (1 - (opt.buckets[0].master if master == "fp32" else w.float())).mean().item()
    want = 20 * 2 ** -12
    assert out["none"] == 0.0
    assert abs(out["stochastic"] - want) < 0.15 * want, out
    assert abs(out["fp32"] - want) < 1e-6, out


def test_state_bytes_per_param_modes() -> None:
    from trainer.optim import state_bytes_per_param

    assert state_bytes_per_param("fp32") == 12
    assert state_bytes_per_param("stochastic") == state_bytes_per_param("none") == 8
    assert state_bytes_per_param("stochastic", torch.bfloat16) == 4
    assert state_bytes_formula("epso", 100, 40, dp=2, ep=2, per_param=8) == 8 * (25 + 20)
    with pytest.raises(ValueError, match="master must be one of"):
        state_bytes_per_param("bf16")
