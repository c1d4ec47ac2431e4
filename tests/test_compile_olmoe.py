"""A patched tiny OLMoE model under torch.compile (fullgraph), torch.export and compiled generation:
the eager numbers and the eager tokens."""
import pytest
import torch
import torch._dynamo.testing

from fastmoe_xpu import patch_olmoe
from tests.tolerances import assert_close

transformers = pytest.importorskip("transformers", reason="transformers is needed for the OLMoE model tests")
from transformers import OlmoeConfig, OlmoeForCausalLM  # noqa: E402
from compile_util import graph_keeping_config  # noqa: E402

TINY = dict(vocab_size=97, hidden_size=32, intermediate_size=24, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=4, num_experts=6, num_experts_per_tok=2, max_position_embeddings=64,
            eos_token_id=None, pad_token_id=0)


def patched_model(seed=0, **kw):
    torch.manual_seed(seed)
    model = OlmoeForCausalLM(OlmoeConfig(**{**TINY, **kw}))
    with torch.no_grad():
        for p in model.parameters():  # larger weights than the init's, so routing differs per token
            p.normal_(0, 0.2)
    assert patch_olmoe(model, backend="torch") == TINY["num_hidden_layers"]
    return model


def loss_and_grads(model, ids):
    model.zero_grad(set_to_none=True)
    out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    return out.logits.detach(), out.loss.detach(), {
        n.removeprefix("_orig_mod."): p.grad.clone() for n, p in model.named_parameters() if p.grad is not None
    }


def test_compiled_patched_model_equals_eager_with_gradients():
    torch._dynamo.reset()
    model = patched_model(norm_topk_prob=True).train()
    ids = torch.randint(1, 97, (2, 9))
    logits, loss, grads = loss_and_grads(model, ids)
    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(model, fullgraph=True, backend=counter)
    c_logits, c_loss, c_grads = loss_and_grads(compiled, ids)
    assert counter.frame_count == 1
    assert_close(c_logits, logits, msg="logits")
    assert_close(c_loss, loss, msg="loss")
    assert set(c_grads) == set(grads) and any("experts.gate_up_proj" in n for n in grads)
    for name, g in grads.items():
        assert_close(c_grads[name], g, msg=f"gradient of {name}")


def test_export_patched_model_gives_eager_logits():
    model = patched_model(seed=1).eval()
    ids = torch.randint(1, 97, (2, 8))
    seq = torch.export.Dim("seq", min=2, max=32)
    exported = torch.export.export(model, (), {"input_ids": ids, "use_cache": False},
                                   dynamic_shapes={"input_ids": {1: seq}, "use_cache": None})
    assert any("fastmoe.mlp_combine" in str(n.target) for n in exported.graph.nodes)
    with torch.no_grad():
        for length in (8, 13):
            ids = torch.randint(1, 97, (2, length))
            got = exported.module()(input_ids=ids, use_cache=False).logits
            assert_close(got, model(input_ids=ids, use_cache=False).logits, msg=f"exported logits, S={length}")


def test_generate_with_compiled_forward_matches_eager_tokens():
    """transformers' static-cache + compile path, fullgraph: the tokens of eager generation."""
    torch._dynamo.reset()
    model = patched_model(seed=2).eval()
    assert model._can_compile_fullgraph
    ids = torch.randint(1, 97, (2, 6))
    kw = dict(max_new_tokens=6, do_sample=False, cache_implementation="static")
    eager = model.generate(ids, disable_compile=True, **kw)
    config, graphs = graph_keeping_config()
    compiled = model.generate(ids, compile_config=config, **kw)
    assert graphs, "generation did not run the compiled forward"
    ops_in_graphs = {str(n.target) for gm in graphs for n in gm.graph.nodes if n.op == "call_function"}
    assert any("fastmoe.mlp_combine" in t for t in ops_in_graphs)
    assert torch.equal(compiled, eager)
    assert compiled.shape[1] == ids.shape[1] + kw["max_new_tokens"]


def test_compiled_model_with_fastmoe_experts_implementation_equals_eager():
    """transformers' own OLMoE with experts_implementation="fastmoe" (no patching): fullgraph, with gradients."""
    torch._dynamo.reset()
    torch.manual_seed(3)
    model = OlmoeForCausalLM(OlmoeConfig(**TINY)).train()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.2)
    model.set_experts_implementation("fastmoe")
    ids = torch.randint(1, 97, (2, 9))
    logits, loss, grads = loss_and_grads(model, ids)
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return torch._dynamo.lookup_backend("aot_eager")(gm, example_inputs)

    compiled = torch.compile(model, fullgraph=True, backend=backend)
    c_logits, c_loss, c_grads = loss_and_grads(compiled, ids)
    assert len(graphs) == 1
    assert any("fastmoe.mlp_combine" in str(n.target) for n in graphs[0].graph.nodes)
    assert_close(c_logits, logits, msg="logits")
    assert_close(c_loss, loss, msg="loss")
    assert set(c_grads) == set(grads) and any("experts.gate_up_proj" in n for n in grads)
    for name, g in grads.items():
        assert_close(c_grads[name], g, msg=f"gradient of {name}")
