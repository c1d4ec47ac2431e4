"""Compiled static-cache generation with a patched OLMoE model compiles its forward once: no
recompile per generated token or per call (what made compiled generation cost more than the stock
model's), and no graph break (fullgraph)."""
import pytest
import torch
import torch._dynamo

from fastmoe_xpu import patch_olmoe

transformers = pytest.importorskip("transformers", reason="transformers is needed for the OLMoE model tests")
from transformers import OlmoeConfig, OlmoeForCausalLM  # noqa: E402
from compile_util import generate_compiled_and_eager  # noqa: E402

TINY = dict(vocab_size=97, hidden_size=32, intermediate_size=24, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=4, num_experts=6, num_experts_per_tok=2, max_position_embeddings=64,
            eos_token_id=None, pad_token_id=0)


def test_compiled_generation_compiles_the_patched_forward_once():
    torch._dynamo.reset()
    torch.manual_seed(4)
    model = OlmoeForCausalLM(OlmoeConfig(**TINY)).eval()
    with torch.no_grad():
        for p in model.parameters():  # larger weights than the init's, so routing differs per token
            p.normal_(0, 0.2)
    assert patch_olmoe(model, backend="torch") == TINY["num_hidden_layers"]
    graphs, outs = generate_compiled_and_eager(model, low=1, high=97, new_tokens=10)
    assert len(graphs) == 1, f"{len(graphs)} graphs compiled for 2 x 10 decoding steps"
    assert any("fastmoe.mlp_combine" in str(n.target) for n in graphs[0].graph.nodes)
    for compiled, eager in outs:
        assert torch.equal(compiled, eager)
