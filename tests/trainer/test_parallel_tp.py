"""Tensor parallelism: TP=2 on a tiny dense OLMo trains exactly like one process (fp32, 1e-5)."""
from __future__ import annotations

import pytest
import torch

from parallel_util import run_workers, tiny_model
from tolerances import assert_close

STEPS = 4


def _train(model: torch.nn.Module, steps: int, opt_name: str, grads_of=None, batch: int = 4, seq: int = 16):
    """``steps`` optimizer steps on one fixed batch; returns the losses and each step's full gradients
    (``grads_of(model)`` gathers them on a TP model)."""
    if opt_name == "adamw":
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.1)
    else:
        opt = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, model.config.vocab_size, (batch, seq), generator=g)  # one batch: the loss must fall
    losses, grads = [], []
    for _ in range(steps):
        loss = model(input_ids=x, labels=x).loss
        loss.backward()
        grads.append(grads_of(model) if grads_of else {n: p.grad.clone() for n, p in model.named_parameters()})
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses, grads


def _tp_worker(ac: str, opt_name: str) -> dict:
    from trainer.parallelism.ac import apply_activation_checkpointing
    from trainer.parallelism.tp import apply_tensor_parallel, gather_tensor_parallel

    def tp_grads(m):
        return gather_tensor_parallel(m, None, grads=True)

    ref = tiny_model("olmo", seed=0)
    model = tiny_model("olmo", seed=0)
    blocks = apply_tensor_parallel(model, None)
    apply_activation_checkpointing(model, ac)
    q_rows = model.model.layers[0].self_attn.q_proj.weight.shape[0]
    mlp_rows = model.model.layers[0].mlp.gate_proj.weight.shape[0]
    ref_losses, ref_grads = _train(ref, STEPS, opt_name)
    losses, grads = _train(model, STEPS, opt_name, tp_grads)
    return {"blocks": blocks, "q_rows": q_rows, "mlp_rows": mlp_rows, "losses": losses, "ref_losses": ref_losses,
            "grads": grads, "ref_grads": ref_grads,
            "full": gather_tensor_parallel(model, None), "ref": {k: v.detach() for k, v in ref.state_dict().items()}}


@pytest.mark.parametrize("ac,opt_name", [
    ("", "adamw"),             # plain TP under the trainer's optimizer
    ("norm,attn,moe", "sgd"),  # TP under activation checkpointing: the recomputation repeats the all-reduces
])
def test_tp2_matches_one_process(ac, opt_name):
    """Losses and every step's gradients match one process at fp32 1e-5; so do the weights after
    SGD. After AdamW only losses and gradients are compared: Adam divides each element's update by
    its own gradient scale, so an element whose gradient is at round-off level gets an O(lr) update
    whose size depends on summation order, and an all-reduce sums in a different order."""
    res = run_workers(_tp_worker, 2, ac, opt_name)
    r0 = res[0]
    model = tiny_model("olmo", seed=0)
    H, I = model.config.hidden_size, model.config.intermediate_size
    assert r0["blocks"] == 2 * model.config.num_hidden_layers
    assert (r0["q_rows"], r0["mlp_rows"]) == (H // 2, I // 2), "the blocks were not split"
    for r in res:
        assert_close(torch.tensor(r["losses"]), torch.tensor(r["ref_losses"]), msg="losses")
        assert r["losses"][-1] < r["losses"][0]
        for step, (g, g_ref) in enumerate(zip(r["grads"], r["ref_grads"])):
            assert set(g) == set(g_ref)
            for k in g_ref:
                assert_close(g[k], g_ref[k], msg=f"step {step} grad {k}")
        if opt_name == "sgd":
            for k, v in r["ref"].items():
                assert_close(r["full"][k], v, msg=k)


def _bad_worker() -> str:
    from trainer.parallelism.tp import apply_tensor_parallel

    try:
        apply_tensor_parallel(tiny_model("olmo", seed=0, num_attention_heads=2, num_key_value_heads=2,
                                         hidden_size=32, intermediate_size=45), None)
    except ValueError as e:
        return str(e)
    return "no error"


def test_tp_rejects_indivisible_sizes():
    msg = run_workers(_bad_worker, 2)[0]
    assert "intermediate size 45" in msg
