"""patch_olmoe on a tiny transformers OlmoeForCausalLM: same numbers, same checkpoints."""
import pytest
import torch

import fastmoe_xpu
from fastmoe_xpu import FastSparseMoeBlock, patch_olmoe
from tests.tolerances import assert_close

transformers = pytest.importorskip("transformers", reason="transformers is needed for the OLMoE model tests")
from transformers import OlmoeConfig, OlmoeForCausalLM  # noqa: E402


def tiny_config(**kw):
    base = dict(vocab_size=97, hidden_size=32, intermediate_size=24, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=4, num_experts=6, num_experts_per_tok=2, max_position_embeddings=64,
                output_router_logits=True, router_aux_loss_coef=0.01)
    base.update(kw)
    return OlmoeConfig(**base)


def make_pair(seed=0, **kw):
    torch.manual_seed(seed)
    ref = OlmoeForCausalLM(tiny_config(**kw)).eval()
    torch.manual_seed(seed)
    fast = OlmoeForCausalLM(tiny_config(**kw)).eval()
    fast.load_state_dict(ref.state_dict())
    return ref, fast


def test_patch_counts_and_keeps_state_dict():
    ref, fast = make_pair()
    keys_before = {k: v.shape for k, v in fast.state_dict().items()}
    assert patch_olmoe(fast, backend="torch") == 2
    assert all(isinstance(layer.mlp, FastSparseMoeBlock) for layer in fast.model.layers)
    assert {k: v.shape for k, v in fast.state_dict().items()} == keys_before
    assert patch_olmoe(fast) == 0  # nothing left to replace


def test_logits_loss_aux_loss_and_grads_equal():
    ref, fast = make_pair(norm_topk_prob=True)
    patch_olmoe(fast, backend="torch")
    ids = torch.randint(0, 97, (2, 11))
    out_r = ref(input_ids=ids, labels=ids)
    out_f = fast(input_ids=ids, labels=ids)
    assert_close(out_f.logits, out_r.logits, msg="logits")
    assert_close(out_f.loss, out_r.loss, msg="loss")
    assert out_r.aux_loss is not None and out_f.aux_loss is not None
    assert_close(out_f.aux_loss, out_r.aux_loss, msg="aux loss")
    assert len(out_f.router_logits) == 2
    # Our load-balancing loss equals transformers' on the recorded router logits.
    mine = fastmoe_xpu.load_balancing_loss(out_f.router_logits, 6, 2)
    assert_close(mine, out_r.aux_loss, msg="load_balancing_loss")
    out_r.loss.backward()
    out_f.loss.backward()
    gr = dict(ref.named_parameters())
    for name, p in fast.named_parameters():
        assert_close(p.grad, gr[name].grad, msg=f"grad {name}")


def test_patch_after_hooks_installed_still_records_router_logits():
    ref, fast = make_pair()
    ids = torch.randint(0, 97, (1, 7))
    fast(input_ids=ids)  # transformers installs its output-recording hooks on the first call
    patch_olmoe(fast, backend="torch")
    out = fast(input_ids=ids, output_router_logits=True)
    assert out.router_logits is not None and len(out.router_logits) == 2
    assert_close(out.logits, ref(input_ids=ids).logits)


def test_save_and_from_pretrained(tmp_path):
    ref, fast = make_pair()
    patch_olmoe(fast, backend="torch")
    fast.save_pretrained(tmp_path)
    loaded = OlmoeForCausalLM.from_pretrained(tmp_path).eval()
    patch_olmoe(loaded, backend="torch")
    ids = torch.randint(0, 97, (1, 9))
    assert_close(loaded(input_ids=ids).logits, ref(input_ids=ids).logits)


def test_v4_keyed_state_dict_loads_into_patched_model():
    ref, fast = make_pair()
    patch_olmoe(fast, backend="torch")
    v4_sd = {}
    for k, v in ref.state_dict().items():
        if k.endswith("experts.gate_up_proj"):
            base = k[: -len("gate_up_proj")]
            inter = v.shape[1] // 2
            for e in range(v.shape[0]):
                v4_sd[f"{base}{e}.gate_proj.weight"] = v[e, :inter].clone()
                v4_sd[f"{base}{e}.up_proj.weight"] = v[e, inter:].clone()
        elif k.endswith("experts.down_proj"):
            base = k[: -len("down_proj")]
            for e in range(v.shape[0]):
                v4_sd[f"{base}{e}.down_proj.weight"] = v[e].clone()
        else:
            v4_sd[k] = v.clone()
    torch.manual_seed(123)
    fresh = OlmoeForCausalLM(tiny_config()).eval()
    patch_olmoe(fresh, backend="torch")
    result = fresh.load_state_dict(v4_sd, strict=False)
    assert not result.unexpected_keys
    assert all("lm_head" in k for k in result.missing_keys)  # tied to the embeddings, not stored
    ids = torch.randint(0, 97, (1, 9))
    assert_close(fresh(input_ids=ids).logits, ref(input_ids=ids).logits)
