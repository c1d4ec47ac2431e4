"""FastSparseMoeBlock against transformers' OlmoeSparseMoeBlock and the v4-style reference."""
import math
from types import SimpleNamespace

import pytest
import torch

from fastmoe_xpu import FastSparseMoeBlock
from bench.harness.baselines import HFv4SparseMoeBlock
from fastmoe_xpu.reference import reference_moe_forward
from tests.tolerances import assert_close

transformers = pytest.importorskip("transformers", reason="transformers is needed for the HF parity tests")
from transformers import OlmoeConfig  # noqa: E402
from transformers.models.olmoe.modeling_olmoe import OlmoeSparseMoeBlock  # noqa: E402


def make_config(H, I, E, K, norm=False):
    return OlmoeConfig(hidden_size=H, intermediate_size=I, num_experts=E, num_experts_per_tok=K, norm_topk_prob=norm)


def make_blocks(cfg, seed=0, std=0.3, dtype=torch.float32):
    torch.manual_seed(seed)
    hf = OlmoeSparseMoeBlock(cfg)
    with torch.no_grad():
        for p in hf.parameters():
            p.normal_(0, std)
    hf = hf.to(dtype)
    fast = FastSparseMoeBlock(cfg, backend="torch").to(dtype)
    fast.load_state_dict(hf.state_dict())
    v4 = HFv4SparseMoeBlock(cfg).to(dtype).load_merged(hf.gate.weight, hf.experts.gate_up_proj, hf.experts.down_proj)
    return hf, fast, v4


def grads(block, x, dout):
    x = x.detach().clone().requires_grad_()
    block.zero_grad(set_to_none=True)
    y = block(x)
    y.backward(dout)
    return y.detach(), x.grad, {n: p.grad for n, p in block.named_parameters()}


V4_NAMES = {"gate.weight": "gate.weight"}

SHAPES = [
    # (B, S, H, I, E, K, norm, routing)
    (2, 5, 33, 17, 5, 2, False, "router"),  # odd H and I, prime E
    (1, 1, 16, 8, 4, 2, True, "router"),  # T=1, renormalised top-k
    (3, 4, 12, 10, 1, 1, False, "router"),  # E=1 (a dense MLP), K=1
    (2, 6, 10, 6, 7, 7, True, "router"),  # K=E, prime E
    (2, 7, 9, 5, 6, 1, False, "router"),  # K=1
    (2, 8, 16, 8, 8, 2, False, "one_expert"),  # all tokens to one expert, most experts empty
    (1, 64, 24, 16, 8, 2, False, "router"),  # many blocks of the counting stage
]


def _bias_router_to_one_expert(hf):
    with torch.no_grad():
        hf.gate.weight.mul_(0.01)
        hf.gate.weight[3] += 5.0  # with positive inputs, expert 3 wins for every token


@pytest.mark.parametrize("B,S,H,I,E,K,norm,routing", SHAPES)
def test_matches_hf_v5_and_v4_fp32(B, S, H, I, E, K, norm, routing):
    cfg = make_config(H, I, E, K, norm)
    hf, fast, v4 = make_blocks(cfg, seed=H * E)
    torch.manual_seed(1)
    x = torch.randn(B, S, H)
    if routing == "one_expert":
        x = x.abs() + 0.1
        _bias_router_to_one_expert(hf)
        fast.load_state_dict(hf.state_dict())
        v4.load_merged(hf.gate.weight, hf.experts.gate_up_proj, hf.experts.down_proj)
        assert (hf.gate(x)[2][:, 0] == 3).all()
    dout = torch.randn(B, S, H)
    y_hf, dx_hf, g_hf = grads(hf, x, dout)
    y_f, dx_f, g_f = grads(fast, x, dout)
    y_4, dx_4, g_4 = grads(v4, x, dout)
    assert_close(y_f, y_hf, msg="output vs hf_v5")
    assert_close(y_f, y_4, msg="output vs hf_v4")
    assert_close(dx_f, dx_hf, msg="input grad vs hf_v5")
    assert_close(dx_f, dx_4, msg="input grad vs hf_v4")
    for name in ("gate.weight", "experts.gate_up_proj", "experts.down_proj"):
        assert_close(g_f[name], g_hf[name], msg=f"{name} grad vs hf_v5")
    assert_close(g_f["gate.weight"], g_4["gate.weight"], msg="router grad vs hf_v4")
    v4_gu = torch.stack([torch.cat([g_4[f"experts.{e}.gate_proj.weight"], g_4[f"experts.{e}.up_proj.weight"]])
                         if g_4[f"experts.{e}.gate_proj.weight"] is not None else torch.zeros(2 * I, H)
                         for e in range(E)])
    assert_close(g_f["experts.gate_up_proj"], v4_gu, msg="gate_up grad vs hf_v4")
    if routing == "one_expert":  # the experts nobody chose get exactly zero gradient
        chosen = set(hf.gate(x)[2].unique().tolist())
        for e in set(range(E)) - chosen:
            assert torch.count_nonzero(g_f["experts.gate_up_proj"][e]) == 0
            assert torch.count_nonzero(g_f["experts.down_proj"][e]) == 0


def test_functional_reference_agrees():
    cfg = make_config(20, 12, 6, 2)
    hf, fast, _ = make_blocks(cfg)
    x = torch.randn(9, 20)
    want = reference_moe_forward(x, hf.gate.weight, hf.experts.gate_up_proj, hf.experts.down_proj, 2, False)
    assert_close(fast(x.view(1, 9, 20)).view(9, 20), want)


def test_bf16_forward_close_to_fp32_reference():
    cfg = make_config(16, 8, 4, 2)
    hf, fast32, _ = make_blocks(cfg, std=0.2)
    x = torch.randn(2, 5, 16)
    want = fast32(x)
    fast16 = FastSparseMoeBlock(cfg, backend="torch").to(torch.bfloat16)
    fast16.load_state_dict(hf.state_dict())
    got = fast16(x.to(torch.bfloat16))
    assert got.dtype == torch.bfloat16
    assert_close(got, want, torch.bfloat16, "bf16 forward")


def test_from_hf_shares_weights_and_keys():
    cfg = make_config(12, 6, 4, 2)
    hf, _, _ = make_blocks(cfg)
    fast = FastSparseMoeBlock.from_hf(hf, backend="torch")
    assert fast.experts.gate_up_proj is hf.experts.gate_up_proj
    assert fast.gate is hf.gate
    assert list(fast.state_dict()) == list(hf.state_dict())
    for k, v in hf.state_dict().items():
        assert fast.state_dict()[k].shape == v.shape
    x = torch.randn(2, 3, 12)
    assert_close(fast(x), hf(x))


def test_from_hf_v4_block():
    cfg = make_config(12, 6, 4, 2, norm=True)
    hf, fast_ref, v4 = make_blocks(cfg)
    fast = FastSparseMoeBlock.from_hf(v4, backend="torch")
    x = torch.randn(2, 3, 12)
    assert_close(fast(x), fast_ref(x))


def test_loads_v4_per_expert_keys():
    cfg = make_config(12, 6, 4, 2)
    hf, fast_ref, v4 = make_blocks(cfg)
    sd = v4.state_dict()
    assert "experts.0.gate_proj.weight" in sd
    fast = FastSparseMoeBlock(cfg, backend="torch")
    result = fast.load_state_dict(sd)
    assert not result.missing_keys and not result.unexpected_keys
    assert torch.equal(fast.experts.gate_up_proj, hf.experts.gate_up_proj)
    assert torch.equal(fast.experts.down_proj, hf.experts.down_proj)


def test_incomplete_v4_keys_are_reported():
    cfg = make_config(12, 6, 4, 2)
    _, _, v4 = make_blocks(cfg)
    sd = v4.state_dict()
    del sd["experts.2.up_proj.weight"]
    with pytest.raises(RuntimeError, match="experts.2.up_proj.weight"):
        FastSparseMoeBlock(cfg, backend="torch").load_state_dict(sd)


def test_duck_typed_config():
    cfg = SimpleNamespace(hidden_size=8, intermediate_size=4, num_experts=3, num_experts_per_tok=2,
                          norm_topk_prob=False, hidden_act="silu")
    block = FastSparseMoeBlock(cfg, backend="torch")
    assert block(torch.randn(1, 2, 8)).shape == (1, 2, 8)


def test_forced_uniform_routing_balances_experts():
    cfg = make_config(8, 4, 4, 2)
    block = FastSparseMoeBlock(cfg, backend="torch", forced_uniform_routing=True)
    x = torch.randn(1, 6, 8, requires_grad=True)
    _, w, idx = block.route(x.view(-1, 8))
    counts = torch.bincount(idx.flatten(), minlength=4)
    assert counts.tolist() == [3, 3, 3, 3]
    assert all(len(set(r)) == 2 for r in idx.tolist())  # distinct experts per token
    block(x).sum().backward()
    assert block.gate.weight.grad is not None and block.gate.weight.grad.abs().sum() > 0


def test_zero_tokens():
    cfg = make_config(8, 4, 4, 2)
    block = FastSparseMoeBlock(cfg, backend="torch")
    x = torch.randn(2, 0, 8, requires_grad=True)
    y = block(x)
    assert y.shape == (2, 0, 8)
    y.sum().backward()
    assert x.grad.shape == x.shape
    for p in block.experts.parameters():
        assert p.grad is None or torch.count_nonzero(p.grad) == 0


def test_nan_propagates():
    cfg = make_config(8, 4, 4, 2)
    block = FastSparseMoeBlock(cfg, backend="torch")
    x = torch.randn(1, 3, 8)
    x[0, 1, 2] = float("nan")
    y = block(x)
    assert torch.isnan(y[0, 1]).all()
    assert torch.isfinite(y[0, 0]).all() and torch.isfinite(y[0, 2]).all()


@pytest.mark.parametrize("kwargs, err, match", [
    (dict(num_experts_per_tok=5), ValueError, "exceeds num_experts"),  # K > E
    (dict(num_experts_per_tok=0), ValueError, ">= 1"),  # K < 1
    (dict(hidden_act="gelu"), ValueError, "hidden_act"),  # unsupported activation
])
def test_bad_config(kwargs, err, match):
    base = dict(hidden_size=8, intermediate_size=4, num_experts=4, num_experts_per_tok=2, norm_topk_prob=False,
                hidden_act="silu")
    base.update(kwargs)
    with pytest.raises(err, match=match):
        FastSparseMoeBlock(SimpleNamespace(**base))


def test_config_missing_field():
    cfg = SimpleNamespace(hidden_size=8, intermediate_size=4, num_experts=4, num_experts_per_tok=2)
    with pytest.raises(ValueError, match="missing field"):
        FastSparseMoeBlock(cfg)


def test_bad_backend():
    with pytest.raises(ValueError, match="backend"):
        FastSparseMoeBlock(make_config(8, 4, 4, 2), backend="cuda")


@pytest.mark.parametrize("x, err, match", [
    (torch.randn(2, 3, 7), ValueError, "hidden_size"),  # wrong last dimension
    (torch.ones(2, 3, 8, dtype=torch.long), TypeError, "floating"),  # integer input
    (torch.randn(2, 3, 8, dtype=torch.float64), TypeError, "dtype"),  # dtype differs from weights
    (torch.randn(8), ValueError, "hidden_size"),  # 1-D input
])
def test_bad_input(x, err, match):
    block = FastSparseMoeBlock(make_config(8, 4, 4, 2), backend="torch")
    with pytest.raises(err, match=match):
        block(x)


def test_device_mismatch():
    block = FastSparseMoeBlock(make_config(8, 4, 4, 2), backend="torch")
    x = torch.randn(1, 2, 8, device="meta")
    with pytest.raises(ValueError, match="meta"):
        block(x)
