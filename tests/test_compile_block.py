"""torch.compile and torch.export of FastSparseMoeBlock: no graph breaks, eager numbers, one
compile for every sequence length under dynamic=True, and opcheck for every fastmoe op."""
import pytest
import torch
import torch._dynamo.testing

from fastmoe_xpu import FastSparseMoeBlock, ops
from fastmoe_xpu.kernels import get_ops
from tests.tolerances import assert_close

transformers = pytest.importorskip("transformers", reason="transformers is needed for the block's router")
from transformers import OlmoeConfig  # noqa: E402


def make_block(seed=0, H=16, I=8, E=4, K=2, norm=False, **kw):
    cfg = OlmoeConfig(hidden_size=H, intermediate_size=I, num_experts=E, num_experts_per_tok=K, norm_topk_prob=norm)
    torch.manual_seed(seed)
    block = FastSparseMoeBlock(cfg, backend="torch", **kw)
    block.reset_parameters(0.3)
    return block


def forward_backward(module, x, dout):
    """Output, input gradient and parameter gradients of one F+B."""
    module.zero_grad(set_to_none=True)
    x = x.detach().clone().requires_grad_()
    y = module(x)
    y.backward(dout)
    # A compiled module names its parameters under "_orig_mod."; compare by the block's own names.
    return y.detach(), x.grad, {n.removeprefix("_orig_mod."): p.grad.clone() for n, p in module.named_parameters()}


def assert_same_fb(actual, expected, what):
    (ya, gxa, gpa), (ye, gxe, gpe) = actual, expected
    assert_close(ya, ye, msg=f"{what}: output")
    assert_close(gxa, gxe, msg=f"{what}: input gradient")
    assert set(gpa) == set(gpe) and gpe
    for name in gpe:
        assert_close(gpa[name], gpe[name], msg=f"{what}: gradient of {name}")


def test_explain_reports_no_graph_break():
    block = make_block()
    x = torch.randn(2, 5, 16)
    explanation = torch._dynamo.explain(block)(x)
    assert explanation.graph_break_count == 0, explanation.break_reasons
    assert explanation.graph_count == 1
    # The graph holds the stages as opaque ops, not their host-reading insides.
    text = "\n".join(str(g.graph) for g in explanation.graphs)
    for name in ("count_tokens", "build_indices", "gate_up", "down_combine"):
        assert f"fastmoe.{name}" in text
    # The fused pair, as eager trains, not the stage-alone ops that keep h and the expert outputs.
    assert "fastmoe.expert_mlp" not in text and "fastmoe.combine" not in text


@pytest.mark.parametrize("norm, forced", [(False, False), (True, True)])
def test_fullgraph_aot_eager_equals_eager_with_gradients(norm, forced):
    """dynamo + AOTAutograd (forward and backward traced through the ops' fake and autograd rules)."""
    torch._dynamo.reset()
    block = make_block(norm=norm, forced_uniform_routing=forced)
    x, dout = torch.randn(2, 7, 16), torch.randn(2, 7, 16)
    expected = forward_backward(block, x, dout)
    compiled = torch.compile(block, fullgraph=True, backend="aot_eager")
    assert_same_fb(forward_backward(compiled, x, dout), expected, "aot_eager")


def test_fullgraph_inductor_equals_eager_with_gradients():
    torch._dynamo.reset()
    block = make_block(seed=1)
    x, dout = torch.randn(3, 4, 16), torch.randn(3, 4, 16)
    expected = forward_backward(block, x, dout)
    compiled = torch.compile(block, fullgraph=True)
    assert_same_fb(forward_backward(compiled, x, dout), expected, "inductor")


def test_dynamic_compiles_once_for_every_sequence_length():
    torch._dynamo.reset()
    block = make_block(seed=2)
    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(block, fullgraph=True, dynamic=True, backend=counter)
    for seq in (3, 5, 8, 13):
        x, dout = torch.randn(2, seq, 16), torch.randn(2, seq, 16)
        assert_same_fb(forward_backward(compiled, x, dout), forward_backward(block, x, dout), f"S={seq}")
    assert counter.frame_count == 1, f"{counter.frame_count} compiles for 4 sequence lengths"


def test_static_shapes_recompile_per_length_only():
    """The counter can fail: without dynamic shapes a second length recompiles (then goes dynamic)."""
    torch._dynamo.reset()
    block = make_block(seed=3)
    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(block, fullgraph=True, dynamic=False, backend=counter)
    for seq in (3, 3, 5):
        compiled(torch.randn(2, seq, 16))
    assert counter.frame_count == 2


def test_export_gives_eager_numbers():
    block = make_block(seed=4, norm=True)
    x = torch.randn(2, 6, 16)
    batch = torch.export.Dim("batch", min=1, max=64)
    seq = torch.export.Dim("seq", min=2, max=256)
    exported = torch.export.export(block, (x,), dynamic_shapes={"hidden_states": {0: batch, 1: seq}})
    targets = {str(n.target) for n in exported.graph.nodes if n.op == "call_function"}
    assert {"fastmoe.count_tokens.default", "fastmoe.gate_up.default", "fastmoe.down_combine.default"} <= targets
    with torch.no_grad():
        for shape in ((2, 6), (3, 11)):
            x = torch.randn(*shape, 16)
            assert_close(exported.module()(x), block(x), msg=f"exported block at {shape}")


# ---------------------------------------------------------------- opcheck
def _routing(T, K, E, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])


@pytest.mark.parametrize("expert_start, num_local", [(0, 5), (2, 2)], ids=["all_local", "ep_slice"])
def test_opcheck_every_op(expert_start, num_local):
    T, K, E, H, I, bs = 9, 2, 5, 12, 6, 4
    idx = _routing(T, K, E, seed=expert_start)
    backend = "torch"
    counts = ops.count_tokens(idx, expert_start, num_local, bs, backend)
    rows = ops.build_indices(idx, counts[1], counts[3], expert_start, num_local, bs, backend)
    assert rows[0].shape == (T * K,)
    torch.manual_seed(0)
    x = torch.randn(T, H, requires_grad=True)
    w_gu = (0.3 * torch.randn(num_local, 2 * I, H)).requires_grad_()
    w_d = (0.3 * torch.randn(num_local, H, I)).requires_grad_()
    weights = torch.rand(T, K, requires_grad=True)
    y, gate_up, h = ops.expert_mlp(x, w_gu, w_d, rows[0], rows[1], counts[4], counts[3], backend)
    mlp_bwd_args = (torch.randn_like(y), x.detach(), w_gu.detach(), w_d.detach(), rows[0], rows[1], counts[4],
                    counts[3], gate_up.detach(), h.detach(), backend)
    comb_bwd_args = (torch.randn(T, H), y.detach(), weights.detach(), rows[1], rows[2], counts[3], backend)
    g_args = (x, w_gu, rows[0], rows[1], counts[4], counts[3], backend)
    gate_up, h = ops.gate_up(*g_args)
    dc_args = (gate_up.detach().requires_grad_(), h.detach(), w_d, weights, rows[1], rows[2], counts[4], counts[3],
               backend)
    dc_bwd_args = (torch.randn(T, H), gate_up.detach(), w_d.detach(), weights.detach(), rows[1], rows[2], counts[4],
                   counts[3], backend)
    cases = {
        "count_tokens": (idx, expert_start, num_local, bs, backend),
        "build_indices": (idx, counts[1], counts[3], expert_start, num_local, bs, backend),
        "expert_mlp": (x, w_gu, w_d, rows[0], rows[1], counts[4], counts[3], backend),
        "expert_mlp_backward": mlp_bwd_args,
        "combine": (y.detach().requires_grad_(), weights, rows[1], rows[2], counts[3], backend),
        "combine_backward": comb_bwd_args,
        "gate_up": g_args,
        "gate_up_backward": (torch.randn_like(gate_up), *[a.detach() if torch.is_tensor(a) else a for a in g_args]),
        "down_combine": dc_args,
        "down_combine_backward": dc_bwd_args,
    }
    assert set(cases) == set(ops.OP_NAMES)
    for name, args in cases.items():
        torch.library.opcheck(getattr(torch.ops.fastmoe, name).default, args)


def test_ops_equal_the_launchers_on_an_ep_slice():
    """The ops' worst-case buffers hold the launchers' rows first; the rest is zero and unread."""
    T, K, E, H, I = 10, 3, 6, 8, 4
    idx = _routing(T, K, E, seed=7)
    launchers = get_ops("torch")
    c = launchers.count_tokens(idx, 2, 3, 8)
    r = launchers.build_indices(idx, c.partial_cum_token_counts, c.cum_expert_counts, 2, 3, 8)
    rt = int(c.cum_token_counts[-1])
    counts = ops.count_tokens(idx, 2, 3, 8, "torch")
    rows = ops.build_indices(idx, counts[1], counts[3], 2, 3, 8, "torch")
    for got, want in zip(counts, c):
        assert torch.equal(got, want)
    for got, want in zip(rows, r):
        assert got.shape == (T * K,) and torch.equal(got[:rt], want)
    x, w_gu, w_d = torch.randn(T, H), torch.randn(3, 2 * I, H), torch.randn(3, H, I)
    y, _, _ = ops.expert_mlp(x, w_gu, w_d, rows[0], rows[1], counts[4], counts[3], "torch")
    g, h = launchers.gate_up_fwd(x, r.input_indices, c.cum_token_counts, w_gu)
    assert rt < T * K and torch.equal(y[rt:], torch.zeros_like(y[rt:]))
    assert_close(y[:rt], launchers.down_fwd(h, c.cum_token_counts, w_d), msg="expert rows")


def test_fused_ops_equal_the_stage_alone_ops_on_an_ep_slice():
    """gate_up + down_combine (what moe_experts traces) give the numbers of expert_mlp + combine,
    gradients of x, both weights and the router weights included, with worst-case row buffers
    whose rows past RT are never read."""
    T, K, E, H, I = 10, 3, 6, 8, 4
    idx = _routing(T, K, E, seed=8)
    counts = ops.count_tokens(idx, 2, 3, 8, "torch")
    rows = ops.build_indices(idx, counts[1], counts[3], 2, 3, 8, "torch")
    rt = int(counts[4][-1])
    assert rt < T * K
    torch.manual_seed(1)
    leaves = [torch.randn(T, H), 0.3 * torch.randn(3, 2 * I, H), 0.3 * torch.randn(3, H, I), torch.rand(T, K)]
    dout = torch.randn(T, H)

    def run(fused):
        x, w_gu, w_d, weights = (t.clone().requires_grad_() for t in leaves)
        if fused:
            g, h = ops.gate_up(x, w_gu, rows[0], rows[1], counts[4], counts[3], "torch")
            assert g.shape == (T * K, 2 * I) and not h.requires_grad
            out = ops.down_combine(g, h, w_d, weights, rows[1], rows[2], counts[4], counts[3], "torch")
        else:
            y, _, _ = ops.expert_mlp(x, w_gu, w_d, rows[0], rows[1], counts[4], counts[3], "torch")
            out = ops.combine(y, weights, rows[1], rows[2], counts[3], "torch")
        out.backward(dout)
        return out.detach(), [t.grad for t in (x, w_gu, w_d, weights)]

    (out_f, grads_f), (out_s, grads_s) = run(True), run(False)
    assert_close(out_f, out_s, msg="output")
    for name, gf, gs in zip(("x", "w_gate_up", "w_down", "weights"), grads_f, grads_s):
        assert_close(gf, gs, msg=f"gradient of {name}")
    # Non-local choices get no router-weight gradient.
    local = (idx >= 2) & (idx < 5)
    assert torch.equal(grads_f[3][~local], torch.zeros_like(grads_f[3][~local]))
