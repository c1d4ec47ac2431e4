"""PEFT's LoRA on FastSparseMoeBlock's experts under expert parallelism (gloo, world 2): the loss, the
outputs, the input and router gradients and every adapter gradient equal the single-process block's
on the concatenated batch, each rank holding its experts' slice of the adapters."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

peft = pytest.importorskip("peft")

from fastmoe_xpu import FastSparseMoeBlock  # noqa: E402
from fastmoe_xpu.dist import expert_range  # noqa: E402
from parallel_util import run_workers  # noqa: E402
from tolerances import assert_close  # noqa: E402

# Odd H and I, K=3, E=8 split 4+4; under alltoall rank 1 brings more tokens than rank 0.
CFG = dict(hidden_size=12, intermediate_size=10, num_experts=8, num_experts_per_tok=3, norm_topk_prob=True,
           hidden_act="silu")
RANK = 3


def _with_adapters(block: FastSparseMoeBlock) -> FastSparseMoeBlock:
    for p in block.experts.parameters():
        p.requires_grad_(False)
    peft.inject_adapter_in_model(peft.LoraConfig(r=RANK, lora_alpha=2 * RANK, init_lora_weights=False,
                                                 target_parameters=["experts.gate_up_proj", "experts.down_proj"]),
                                 block)
    block.gate.requires_grad_(True)  # PEFT froze it; its gradient checks the LoRA op's router-weight gradient
    return block


def _adapters(block: FastSparseMoeBlock) -> dict[str, torch.nn.Parameter]:
    return {n: p for n, p in block.named_parameters() if "lora_" in n}


def _slice(name: str, t: torch.Tensor, ids: range, experts: int) -> torch.Tensor:
    """The local experts' part of a full adapter weight: lora_A ``[E*r, in]`` is expert-major, lora_B
    ``[out, r*E]`` has the expert as its fastest index (PEFT's ``get_delta_factors``)."""
    if "lora_A" in name:
        return t[ids.start * RANK: ids.stop * RANK]
    return t.view(t.shape[0], RANK, experts)[:, :, ids.start:ids.stop].reshape(t.shape[0], -1)


def lora_ep_worker(dispatch: str) -> str:
    cfg = SimpleNamespace(**CFG)
    rank, world = dist.get_rank(), dist.get_world_size()
    sizes = [6] * world if dispatch == "allgather" else [5 + 2 * r for r in range(world)]
    torch.manual_seed(0)
    ref = FastSparseMoeBlock(cfg, backend="torch")
    ref.reset_parameters(0.3)
    state = ref.state_dict()
    torch.manual_seed(1)
    ref = _with_adapters(ref)
    g = torch.Generator().manual_seed(2)
    x_full, dout_full = torch.randn(sum(sizes), cfg.hidden_size, generator=g), torch.randn(sum(sizes), 12, generator=g)
    xr = x_full.clone().requires_grad_()
    loss_ref = (ref(xr) * dout_full).sum()
    loss_ref.backward()

    ep = FastSparseMoeBlock(cfg, backend="torch", ep_group=dist.group.WORLD, dispatch=dispatch)
    ep.load_state_dict(state)  # the block keeps its experts' slice
    ep = _with_adapters(ep)
    ids = expert_range(cfg.num_experts, world, rank)
    full = _adapters(ref)
    with torch.no_grad():
        for name, p in _adapters(ep).items():
            p.copy_(_slice(name, full[name], ids, cfg.num_experts))
    lo = sum(sizes[:rank])
    rows = slice(lo, lo + sizes[rank])
    x = x_full[rows].clone().requires_grad_()
    out = ep(x)
    loss = (out * dout_full[rows]).sum()
    loss.backward()
    total = loss.detach().clone()
    dist.all_reduce(total)
    gate = ep.gate.weight.grad.clone()
    dist.all_reduce(gate)
    assert_close(total, loss_ref.detach(), msg="loss summed over ranks")
    assert_close(x.grad, xr.grad[rows], msg="input gradient rows")
    assert_close(gate, ref.gate.weight.grad, msg="router gradient summed over ranks")
    grads = {n: p.grad for n, p in _adapters(ep).items()}
    assert len(grads) == 4 and all(v is not None for v in grads.values())
    for name, grad in grads.items():
        assert_close(grad, _slice(name, full[name].grad, ids, cfg.num_experts), msg=f"{name} gradient slice")
    assert all(p.grad is None for p in ep.experts.parameters() if not p.requires_grad)
    return "ok"


def lora_ep_cases() -> list[str]:
    return [lora_ep_worker(dispatch) for dispatch in ("alltoall", "allgather")]


def test_lora_under_expert_parallelism() -> None:
    """Both dispatchers in one start of the two processes."""
    assert run_workers(lora_ep_cases, 2) == [["ok", "ok"]] * 2
