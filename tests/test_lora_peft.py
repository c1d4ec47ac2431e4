"""PEFT's LoRA on the fused 3-D expert weights, as users call it (``LoraConfig(target_parameters=
["mlp.experts.gate_up_proj", "mlp.experts.down_proj"])``), with ``experts_implementation="fastmoe"``
against the same PEFT model on transformers' ``grouped_mm``: loss and every adapter gradient at fp32
1e-5, with the adapters inside our grouped GEMMs (PEFT's ``W + delta`` is never formed); adapters
trained here save and load back in stock PEFT, and ``merge_and_unload`` gives the same model."""
from __future__ import annotations

import copy

import pytest
import torch

peft = pytest.importorskip("peft")
pytest.importorskip("transformers.integrations.moe")

import fastmoe_xpu  # noqa: E402,F401  (registers "fastmoe")
from fastmoe_xpu import patch_olmoe  # noqa: E402
from fastmoe_xpu.integrations.families import build_model, tiny_config  # noqa: E402
from peft.tuners.lora.layer import _LoraFactorsProxy  # noqa: E402
from tolerances import assert_close  # noqa: E402
from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS  # noqa: E402

TARGETS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
FAMILIES = ["qwen3_moe", "mixtral", "olmoe", "gpt_oss"]


def _config(**kw):
    # init_lora_weights=False: B is random too, so the adapters change the output from the first step
    return peft.LoraConfig(r=4, lora_alpha=8, target_parameters=TARGETS, init_lora_weights=False, **kw)


def _pair(family: str, **kw):
    torch.manual_seed(0)
    model, _ = build_model(tiny_config(family), "grouped_mm")
    ref = peft.get_peft_model(model, _config(**kw))
    ours = copy.deepcopy(ref)
    ours.base_model.model.set_experts_implementation("fastmoe")
    return ref, ours


def _step(model, ids):
    model.zero_grad(set_to_none=True)
    out = model(input_ids=ids, labels=ids, use_cache=False)
    out.loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters() if p.requires_grad}
    frozen_grads = [n for n, p in model.named_parameters() if not p.requires_grad and p.grad is not None]
    return out.loss.detach(), grads, frozen_grads


@pytest.fixture
def adapters_in_gemms(monkeypatch):
    """Counts fastmoe experts calls and fails any use of PEFT's folded ``W + scaling * lhs @ rhs``
    inside one."""
    calls, inside = [0], [False]
    real_experts, real_fold = ALL_EXPERTS_FUNCTIONS["fastmoe"], _LoraFactorsProxy.forward

    def counting(*args, **kwargs):
        calls[0] += 1
        inside[0] = True
        try:
            return real_experts(*args, **kwargs)
        finally:
            inside[0] = False

    def fold(self, W):
        if inside[0]:
            raise AssertionError("the fastmoe path formed W + delta")
        return real_fold(self, W)

    monkeypatch.setitem(ALL_EXPERTS_FUNCTIONS, "fastmoe", counting)
    monkeypatch.setattr(_LoraFactorsProxy, "forward", fold)
    return calls


@pytest.mark.parametrize("family", FAMILIES)
def test_peft_lora_matches_grouped_mm(family, adapters_in_gemms) -> None:
    ref, ours = _pair(family)
    ids = torch.randint(3, 96, (2, 9), generator=torch.Generator().manual_seed(1))
    loss_ref, grads_ref, _ = _step(ref, ids)
    loss, grads, frozen = _step(ours, ids)
    assert adapters_in_gemms[0] == 2  # both layers ran through fastmoe
    assert not frozen
    assert_close(loss, loss_ref, msg="loss")
    assert set(grads) == set(grads_ref) and len(grads) == 8  # A and B of two weights in two layers
    for name, g in grads_ref.items():
        assert "lora_" in name
        assert_close(grads[name], g, msg=name)


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])
def test_adapters_trained_here_load_in_stock_peft(family, tmp_path) -> None:
    """One optimiser step through fastmoe, then ``save_pretrained``: stock PEFT on grouped_mm loads the
    adapter and gives the same logits, and so does ``merge_and_unload``'s plain model."""
    ref, ours = _pair(family)
    ids = torch.randint(3, 96, (2, 9), generator=torch.Generator().manual_seed(2))
    _step(ours, ids)
    opt = torch.optim.SGD([p for p in ours.parameters() if p.requires_grad], lr=0.5)
    opt.step()
    ours.save_pretrained(tmp_path)
    with torch.no_grad():
        logits = ours(input_ids=ids, use_cache=False).logits
        torch.manual_seed(0)
        base, _ = build_model(tiny_config(family), "grouped_mm")
        loaded = peft.PeftModel.from_pretrained(base, tmp_path)
        assert_close(loaded(input_ids=ids, use_cache=False).logits, logits, msg="loaded adapter")
        assert not torch.equal(ref(input_ids=ids, use_cache=False).logits, logits)  # the step changed it
        merged = ours.merge_and_unload()
        assert not any("lora" in n for n, _ in merged.named_parameters())
        assert_close(merged(input_ids=ids, use_cache=False).logits, logits, msg="merged")


def test_fast_sparse_moe_block_runs_peft_adapters() -> None:
    """``FastSparseMoeBlock`` reads its experts' weights itself: PEFT's wrappers around them are
    unwrapped and the adapters run in the block's grouped GEMMs."""
    from transformers import OlmoeConfig, OlmoeForCausalLM

    torch.manual_seed(0)
    cfg = OlmoeConfig(num_hidden_layers=2, hidden_size=32, intermediate_size=24, num_experts=5,
                      num_experts_per_tok=2, vocab_size=64, eos_token_id=2, pad_token_id=0)
    model = OlmoeForCausalLM(cfg)
    model.set_experts_implementation("grouped_mm")
    patched = copy.deepcopy(model)
    assert patch_olmoe(patched) == 2
    torch.manual_seed(1)
    ref = peft.get_peft_model(model, _config())
    torch.manual_seed(1)
    ours = peft.get_peft_model(patched, _config())
    ids = torch.randint(3, 64, (2, 7), generator=torch.Generator().manual_seed(3))
    loss_ref, grads_ref, _ = _step(ref, ids)
    loss, grads, frozen = _step(ours, ids)
    assert not frozen and len(grads) == 8
    assert_close(loss, loss_ref, msg="loss")
    for name, g in grads_ref.items():
        assert_close(grads[name], g, msg=name)
    with ours.disable_adapter(), torch.no_grad():  # adapters off: the base model again
        assert_close(ours(input_ids=ids).logits, _base_logits(ref, ids), msg="disabled")


def _base_logits(peft_model, ids):
    with peft_model.disable_adapter(), torch.no_grad():
        return peft_model(input_ids=ids).logits


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])
def test_fullgraph_compile_with_adapters_in_experts(family, monkeypatch) -> None:
    """PEFT's wrapper registers a parametrization on every forward, which torch.compile cannot trace
    (fullgraph fails); ``run_adapters_in_experts`` hands the adapters to the fastmoe experts function
    instead: one graph (aot_eager: forward and backward traced through the ops' fake and autograd
    rules), PEFT on grouped_mm's loss and adapter gradients, and PEFT's fold never runs at all."""
    import torch._dynamo.testing

    from fastmoe_xpu.integrations.experts import run_adapters_in_experts

    ref, ours = _pair(family)
    ids = torch.randint(3, 96, (2, 9), generator=torch.Generator().manual_seed(4))
    loss_ref, grads_ref, _ = _step(ref, ids)
    torch._dynamo.reset()
    with pytest.raises(Exception, match="(?i)graph break|unsupported"):
        torch.compile(copy.deepcopy(ours), fullgraph=True, backend="eager")(input_ids=ids, use_cache=False)
    assert run_adapters_in_experts(ours) == 2

    def no_fold(self, W):
        raise AssertionError("PEFT's W + delta was formed")

    monkeypatch.setattr(_LoraFactorsProxy, "forward", no_fold)
    torch._dynamo.reset()
    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    loss, grads, frozen = _step(torch.compile(ours, fullgraph=True, backend=counter), ids)
    assert counter.frame_count == 1 and not frozen
    assert_close(loss, loss_ref, msg="loss")
    grads = {n.replace("_orig_mod.", ""): g for n, g in grads.items()}
    assert set(grads) == set(grads_ref) and len(grads) == 8
    for name, g in grads_ref.items():
        assert_close(grads[name], g, msg=name)
    ours.base_model.model.set_experts_implementation("grouped_mm")  # another implementation: PEFT's own forward
    monkeypatch.undo()
    with torch.no_grad():
        assert_close(ours(input_ids=ids, use_cache=False).logits, ref(input_ids=ids, use_cache=False).logits,
                     msg="grouped_mm after the switch")


def test_adapters_on_quantized_experts_are_refused_when_attached() -> None:
    """LoRA with an int8 expert precision is refused where the adapters are handed to the experts
    (run_adapters_in_experts, which the trainer calls after attaching them), naming the way out,
    rather than at the first forward; without the precision the same call sets them up."""
    from fastmoe_xpu.integrations.experts import run_adapters_in_experts

    _, ours = _pair("qwen3_moe")
    experts = [m for m in ours.modules() if type(m).__name__.endswith("Experts") and hasattr(m, "has_gate")]
    assert experts
    ours.base_model.model.config.fastmoe_expert_precision = "int8"
    with pytest.raises(ValueError, match="expert precision 'int8' are not supported.*fastmoe_expert_precision='none'"):
        run_adapters_in_experts(ours)
    ours.base_model.model.config.fastmoe_expert_precision = None
    assert run_adapters_in_experts(ours) == len(experts)
