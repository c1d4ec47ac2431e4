"""torch.compile and torch.export of FastSparseMoeBlock: no graph breaks, eager numbers, one
compile for every sequence length under dynamic=True, and opcheck for every fastmoe op."""
import pytest
import torch
import torch._dynamo.testing

from fastmoe_xpu import FastSparseMoeBlock
from fastmoe_xpu.autograd import ops
from fastmoe_xpu.kernels import kernels
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
    for name in ("route", "mlp_combine"):
        assert f"fastmoe.{name}" in text
    # The fused op, as eager trains, not the stage-alone ops that keep h and the expert outputs.
    assert "fastmoe.grouped_linear" not in text and "fastmoe.combine" not in text


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
    assert {"fastmoe.route.default", "fastmoe.mlp_combine.default"} <= targets
    with torch.no_grad():
        for shape in ((2, 6), (3, 11)):
            x = torch.randn(*shape, 16)
            assert_close(exported.module()(x), block(x), msg=f"exported block at {shape}")


# ---------------------------------------------------------------- opcheck
def _routing(T, K, E, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])


def _stage_alone(x, w_gu, w_d, weights, rows, kernels_name="torch"):
    """Stages 4-5 through the stage-alone ops (grouped_linear, SiLU*up in torch, combine)."""
    ii, oi, sel, ctok, cexp = rows
    inter = w_gu.shape[1] // 2
    gate_up = ops.grouped_linear(x.index_select(0, ii.long()), w_gu, ctok, kernels_name, False)
    h = torch.nn.functional.silu(gate_up[:, :inter]) * gate_up[:, inter:]
    y = ops.grouped_linear(h.contiguous(), w_d, ctok, kernels_name, False)
    return ops.combine(y, weights, oi, sel, cexp, kernels_name)


@pytest.mark.parametrize("expert_start, num_local", [(0, 5), (2, 2)], ids=["all_local", "ep_slice"])
def test_opcheck_every_op(expert_start, num_local):
    T, K, E, H, I = 9, 2, 5, 12, 6
    idx = _routing(T, K, E, seed=expert_start)
    rows = ops.route(idx, expert_start, num_local, "torch", False)
    assert rows[0].shape == (T * K,)
    torch.manual_seed(0)
    x = torch.randn(T, H, requires_grad=True)
    w_gu = (0.3 * torch.randn(num_local, 2 * I, H)).requires_grad_()
    w_d = (0.3 * torch.randn(num_local, H, I)).requires_grad_()
    weights = torch.rand(T, K, requires_grad=True)
    out, gate_up = ops.mlp_combine(x, w_gu, w_d, weights, *rows, "torch", "")
    a_RH = x.detach().index_select(0, rows[0].long()).requires_grad_()
    y = ops.grouped_linear(a_RH, w_gu.detach().transpose(1, 2).contiguous().requires_grad_(), rows[3], "torch", True)
    d = lambda t: t.detach()  # noqa: E731
    cases = {
        "route": (idx, expert_start, num_local, "torch", False),
        "mlp_combine": (x, w_gu, w_d, weights, *rows, "torch+loop", ""),
        "mlp_combine_backward": (torch.randn(T, H), d(x), d(w_gu), d(w_d), d(weights), d(gate_up), *rows, "torch", ""),
        "grouped_linear": (a_RH, w_gu.detach().transpose(1, 2).contiguous().requires_grad_(), rows[3], "torch", True),
        "grouped_linear_backward": (torch.randn_like(y), d(a_RH), w_gu.detach().transpose(1, 2).contiguous(), rows[3],
                                    "torch", True),
        "combine": (y.detach()[:, :H].contiguous().requires_grad_(), weights, rows[1], rows[2], rows[4], "torch"),
        "combine_backward": (torch.randn(T, H), y.detach()[:, :H].contiguous(), d(weights), rows[1], rows[2], rows[4],
                             "torch"),
        "experts": (x, w_gu, w_d, weights, idx, expert_start, num_local, "padded"),
        "experts_backward": (torch.randn(T, H), d(x), d(w_gu), d(w_d), d(weights),
                             *ops.experts(d(x), d(w_gu), d(w_d), d(weights), idx, expert_start, num_local, "padded")[1:],
                             expert_start, num_local, "padded"),
    }
    assert set(cases) == set(ops.OP_NAMES)
    for name, args in cases.items():
        torch.library.opcheck(getattr(torch.ops.fastmoe, name).default, args)


def test_ops_equal_the_launchers_on_an_ep_slice():
    """The ops' worst-case buffers hold the launchers' rows first; the rest is zero and unread. Eager
    (exact_rows) rows are the launchers' own."""
    T, K, E, H, I = 10, 3, 6, 8, 4
    idx = _routing(T, K, E, seed=7)
    launchers = kernels("torch")
    c = launchers.count_tokens(idx, 2, 3, 8)
    r = launchers.build_indices(idx, c.partial_cum_token_counts, c.cum_expert_counts, 2, 3, 8)
    rt = int(c.cum_token_counts[-1])
    rows = ops.route(idx, 2, 3, "torch", False)
    exact = ops.route(idx, 2, 3, "torch", True)
    assert torch.equal(rows[3], c.cum_token_counts) and torch.equal(rows[4], c.cum_expert_counts)
    for got, got_exact, want in zip(rows[:3], exact[:3], r):
        assert got.shape == (T * K,) and torch.equal(got[:rt], want) and torch.equal(got_exact, want)
    x, w_gu, w_d = torch.randn(T, H), torch.randn(3, 2 * I, H), torch.randn(3, H, I)
    weights = torch.rand(T, K)
    out, gate_up = ops.mlp_combine(x, w_gu, w_d, weights, *rows, "torch", "")
    g, h = launchers.gate_up_fwd(x, r.input_indices, c.cum_token_counts, w_gu)
    assert rt < T * K and gate_up.shape == (T * K, 2 * I) and torch.equal(gate_up[rt:], torch.zeros_like(gate_up[rt:]))
    assert_close(gate_up[:rt], g, msg="gate/up rows")
    y = launchers.down_fwd(h, c.cum_token_counts, w_d)
    want = launchers.combine_fwd(y, weights, r.output_indices, r.selected_expert_indices, c.cum_expert_counts)
    assert_close(out, want, msg="output")


@pytest.mark.parametrize("exact_rows", [True, False], ids=["exact", "worst-case"])
def test_fused_op_equals_the_stage_alone_ops_on_an_ep_slice(exact_rows):
    """mlp_combine (what the layer runs) gives the numbers of grouped_linear + SiLU*up + grouped_linear +
    combine, gradients of x, both weights and the router weights included, with exact and with
    worst-case row buffers (whose rows past RT are never read)."""
    T, K, E, H, I = 10, 3, 6, 8, 4
    idx = _routing(T, K, E, seed=8)
    rows = ops.route(idx, 2, 3, "torch", exact_rows)
    rt = int(rows[3][-1])
    assert rt < T * K
    torch.manual_seed(1)
    leaves = [torch.randn(T, H), 0.3 * torch.randn(3, 2 * I, H), 0.3 * torch.randn(3, H, I), torch.rand(T, K)]
    dout = torch.randn(T, H)

    def run(fused):
        x, w_gu, w_d, weights = (t.clone().requires_grad_() for t in leaves)
        if fused:
            out, g = ops.mlp_combine(x, w_gu, w_d, weights, *rows, "torch", "")
            assert g.shape == (rows[0].shape[0], 2 * I) and not g.requires_grad
        else:
            out = _stage_alone(x, w_gu, w_d, weights, rows)
        out.backward(dout)
        return out.detach(), [t.grad for t in (x, w_gu, w_d, weights)]

    (out_f, grads_f), (out_s, grads_s) = run(True), run(False)
    assert_close(out_f, out_s, msg="output")
    for name, gf, gs in zip(("x", "w_gate_up", "w_down", "weights"), grads_f, grads_s):
        assert_close(gf, gs, msg=f"gradient of {name}")
    # Non-local choices get no router-weight gradient.
    local = (idx >= 2) & (idx < 5)
    assert torch.equal(grads_f[3][~local], torch.zeros_like(grads_f[3][~local]))


def test_constant_result_marks_a_function_as_torch_does(monkeypatch):
    """The package marks its compile-time constants without importing torch._dynamo (a second at
    every process start): the mark must be exactly what torch.compiler.assume_constant_result sets,
    on this torch, and importing the package must leave torch._dynamo unloaded."""
    import subprocess
    import sys

    from fastmoe_xpu.autograd.moe_experts import constant_result

    def a():
        return 0

    def b():
        return 0

    monkeypatch.delitem(sys.modules, "torch._dynamo")
    constant_result(a)
    monkeypatch.undo()
    torch.compiler.assume_constant_result(b)
    assert vars(a) == vars(b) and vars(a)
    code = "import sys, fastmoe_xpu; print('torch._dynamo' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.stdout.strip() == "False", out.stderr[-2000:]
