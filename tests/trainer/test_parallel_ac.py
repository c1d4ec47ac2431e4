"""Selective activation checkpointing: every --ac choice keeps losses and gradients and saves less."""
from __future__ import annotations

import pytest
import torch

from parallel_util import tiny_model
from tolerances import assert_close
from trainer.parallelism.ac import (
    apply_activation_checkpointing,
    checkpointed_modules,
    parse_ac,
    remove_activation_checkpointing,
    saved_bytes_table,
)


def _router_loss(model, x, y):
    """The trainer's kind of loss: LM loss plus both router losses from transformers' recorded
    router logits (so recomputation must not disturb the recording)."""
    from fastmoe_xpu import load_balancing_loss, router_z_loss

    cfg = model.config
    out = model(input_ids=x, labels=y, output_router_logits=True)
    assert len(out.router_logits) == cfg.num_hidden_layers
    lb = load_balancing_loss(out.router_logits, cfg.num_experts, cfg.num_experts_per_tok)
    return out.loss + 0.01 * lb + 0.001 * router_z_loss(out.router_logits)


@pytest.mark.parametrize("arch,with_router_loss", [
    ("olmoe", True),   # FastSparseMoeBlock layers, LM + load-balancing + z loss from recorded router logits
    ("olmo", False),   # dense OLMo: weightless LayerNorms, gate/up/down MLP as "moe"
])
def test_every_choice_keeps_loss_and_grads_and_saves_less(arch, with_router_loss):
    model = tiny_model(arch, seed=0)
    g = torch.Generator().manual_seed(5)
    x = torch.randint(0, model.config.vocab_size, (2, 16), generator=g)
    rows = saved_bytes_table(model, x, x, _router_loss if with_router_loss else None)
    assert len(rows) == 8
    (none, base, loss0, grads0) = rows[0]
    assert none == ()
    for combo, stats, loss, grads in rows[1:]:
        assert_close(loss, loss0, msg=f"{combo} loss")
        for g_ac, g_ref in zip(grads, grads0):
            assert_close(g_ac, g_ref, msg=f"{combo} grad")
        assert stats.bytes < base.bytes, f"--ac {'+'.join(combo)} saved {stats.bytes} >= {base.bytes} without"
    assert rows[-1][1].bytes < min(r[1].bytes for r in rows[1:-1]), "all three together must save the least"
    assert checkpointed_modules(model) == []  # the table leaves the model as it found it


def test_wrapping_targets_and_undo():
    model = tiny_model("olmoe", seed=0)
    L = model.config.num_hidden_layers
    names_before = [n for n, _ in model.named_parameters()]
    assert apply_activation_checkpointing(model, "norm,attn,moe") == 2 * L + 1 + 2 * L
    assert apply_activation_checkpointing(model, "attn") == 0  # already wrapped: not twice
    wrapped = checkpointed_modules(model)
    assert "model.norm" in wrapped and f"model.layers.{L - 1}.mlp" in wrapped
    assert [n for n, _ in model.named_parameters()] == names_before  # state-dict names unchanged
    assert remove_activation_checkpointing(model) == len(wrapped)
    assert checkpointed_modules(model) == []


def test_checkpointed_moe_under_no_grad_runs_plain():
    model = tiny_model("olmoe", seed=0)
    x = torch.randint(0, model.config.vocab_size, (1, 8))
    with torch.no_grad():
        ref = model(input_ids=x).logits
    apply_activation_checkpointing(model, "moe")
    with torch.no_grad():
        assert torch.equal(model(input_ids=x).logits, ref)


@pytest.mark.parametrize("spec,expected", [
    ("norm,attn,moe", ("norm", "attn", "moe")),  # all three, canonical order
    ("moe, norm", ("norm", "moe")),              # spaces and any order
    ("mlp", ("moe",)),                           # dense synonym
    ("all", ("norm", "attn", "moe")),            # shorthand
    ("", ()),                                    # nothing
    ("none", ()),                                # explicit nothing
])
def test_parse_ac(spec, expected):
    assert parse_ac(spec) == expected


def test_parse_ac_rejects_unknown():
    with pytest.raises(ValueError, match="unknown --ac choice 'experts2'"):
        parse_ac("norm,experts2")
