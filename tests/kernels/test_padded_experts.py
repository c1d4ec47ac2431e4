"""The ``padded`` experts implementation (stages 2-5 in one piece for small layers,
``fastmoe_xpu/kernels/torch/padded.py``) against the mask-based reference, and the registry's choice
of it.

Awkward shapes: T=1, K=1, K=E, empty experts, a token naming the same expert twice, an
expert-parallel slice with ids on both sides of the local range, a slice no token chose, bf16.
Gradients of the input, both weights and the routing weights through ``fastmoe::experts`` and its
backward op, against autograd through the reference.
"""
import pytest
import torch

from fastmoe_xpu import settings
from fastmoe_xpu.autograd import ops
from fastmoe_xpu.autograd.moe_experts import moe_experts_forward
from fastmoe_xpu.kernels import registry
from fastmoe_xpu.kernels.torch import padded
from fastmoe_xpu.reference import reference_experts_forward
from tolerances import assert_close


def _routing(T, E, K, seed, duplicate=False):
    g = torch.Generator().manual_seed(seed)
    if T == 0:
        return torch.zeros(0, K, dtype=torch.int64)
    idx = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
    if duplicate:  # the first token names its first expert twice
        idx[0, -1] = idx[0, 0]
    return idx


# (T, H, I, E, K, expert_start, num_local, duplicate)
CASES = {
    "T1": (1, 12, 6, 4, 2, 0, 4, False),
    "K1": (9, 16, 8, 5, 1, 0, 5, False),
    "K=E": (7, 8, 4, 3, 3, 0, 3, False),
    "empty-experts": (3, 12, 6, 16, 2, 0, 16, False),
    "odd": (13, 20, 10, 6, 3, 0, 6, False),
    "duplicate-choice": (6, 12, 6, 4, 2, 0, 4, True),
    "ep-slice": (11, 12, 6, 8, 3, 2, 3, False),  # ids on both sides of the local range
    "ep-slice-unchosen": (2, 12, 6, 8, 1, 6, 2, False),
}


def _inputs(T, H, I, E, K, start, nl, dup, dtype=torch.float32, seed=0):
    torch.manual_seed(seed)
    idx = _routing(T, E, K, seed, dup)
    if start + nl == E and start > 0:  # a slice at the top that no token chose: every choice below it
        idx = idx % start
    x = torch.randn(T, H, dtype=dtype, requires_grad=True)
    w_gu = (0.3 * torch.randn(nl, 2 * I, H)).to(dtype).requires_grad_()
    w_d = (0.3 * torch.randn(nl, H, I)).to(dtype).requires_grad_()
    weights = torch.rand(T, K, requires_grad=True)
    return x, w_gu, w_d, weights, idx


def _grads(out, tensors, seed=1):
    if out.grad_fn is None:  # the reference of a slice no token chose: zero, and no graph
        return (None,) * len(tensors)
    g = torch.Generator().manual_seed(seed)
    dout = torch.randn(out.shape, generator=g).to(out.dtype)
    return torch.autograd.grad(out, tensors, dout, allow_unused=True)


@pytest.mark.parametrize("case", list(CASES))
def test_padded_equals_reference(case):
    T, H, I, E, K, start, nl, dup = CASES[case]
    x, w_gu, w_d, weights, idx = _inputs(T, H, I, E, K, start, nl, dup)
    out, gate_up, plan = ops.experts(x, w_gu, w_d, weights, idx, start, nl, "padded")
    assert gate_up.shape == (T * K, 2 * I) and plan.shape == (T * K + 1,) and plan.dtype == torch.int64
    want = reference_experts_forward(x, weights, idx, w_gu, w_d, expert_start=start)
    assert_close(out, want, msg=f"{case} output")
    for name, got, ref in zip(("dx", "dw_gate_up", "dw_down", "dweights"),
                              _grads(out, (x, w_gu, w_d, weights)), _grads(want, (x, w_gu, w_d, weights))):
        ref = torch.zeros_like(got) if ref is None else ref
        assert_close(got, ref, msg=f"{case} {name}")


def test_padded_bf16_matches_fp32_reference():
    T, H, I, E, K, start, nl, dup = CASES["odd"]
    x, w_gu, w_d, weights, idx = _inputs(T, H, I, E, K, start, nl, dup, dtype=torch.bfloat16)
    out, _, _ = ops.experts(x, w_gu, w_d, weights, idx, start, nl, "padded")
    assert out.dtype == torch.bfloat16
    f = lambda t: t.detach().float().requires_grad_()  # noqa: E731
    x32, gu32, d32, w32 = f(x), f(w_gu), f(w_d), f(weights)
    want = reference_experts_forward(x32, w32, idx, gu32, d32)
    assert_close(out, want, torch.bfloat16, msg="bf16 output")
    for name, got, ref in zip(("dx", "dw_gate_up", "dw_down", "dweights"), _grads(out, (x, w_gu, w_d, weights)),
                              _grads(want, (x32, gu32, d32, w32))):
        assert got.dtype == (torch.float32 if name == "dweights" else torch.bfloat16), name
        assert_close(got, ref, torch.bfloat16, msg=f"bf16 {name}")


def test_layout_places_each_slot_in_its_experts_block():
    idx = torch.tensor([[2, 0], [2, 1], [0, 2], [3, 1]])
    lay = padded.layout(idx, 0, 4)
    assert lay.cap == 3 and lay.padded == 12
    # Expert e's slots take rows e*cap, e*cap+1, ... in token order.
    assert lay.rows.tolist() == [6, 0, 7, 3, 1, 8, 9, 4]
    ep = padded.layout(idx, 1, 2)  # local experts 1 and 2; the rest go to the dump row 2*cap
    assert ep.cap == 3 and ep.padded == 7
    assert ep.rows.tolist() == [3, 6, 4, 0, 6, 5, 6, 1]
    # The plan the forward hands its backward gives the same layout back, dump row or not.
    for each, nl in ((lay, 4), (ep, 2), (padded.layout(idx, 3, 1), 1)):
        back = padded.Layout.of_plan(each.plan, nl)
        assert (back.rows.tolist(), back.cap, back.padded, back.dump) == (each.rows.tolist(), each.cap, each.padded,
                                                                           each.dump), nl
    assert (ep.dump, lay.dump) == (1, 0)


def test_bad_shapes_are_refused():
    x, w_gu, w_d, weights, idx = _inputs(*CASES["odd"])
    with pytest.raises(ValueError, match="shapes do not match"):
        padded.experts_forward(x.detach()[:, :-1], w_gu.detach(), w_d.detach(), weights.detach(), idx, 0, 6)
    with pytest.raises(ValueError, match=r"must both be \[T, K\]"):
        padded.experts_forward(x.detach(), w_gu.detach(), w_d.detach(), weights.detach()[:, :1], idx, 0, 6)


# ---------------------------------------------------------------- the registry's choice
def test_whole_layer_only_for_small_auto_layers_on_the_torch_base():
    small, large = (48, 2, 64, 32, 8), (2048, 8, 2048, 1024, 64)
    with settings.override(gemm_engine="auto"):  # the tests' conftest pins "native"
        assert registry.whole_layer("torch", "auto", "cpu", torch.float32, small) == "padded"
        assert registry.whole_layer("torch", "auto", "cpu", torch.float32, large) is None
        assert registry.whole_layer("torch", "loop", "cpu", torch.float32, small) is None  # a named engine: staged
        assert registry.whole_layer("triton", "auto", "cpu", torch.float32, small) is None
        # Decoding over many wide experts: one row per expert block would read every expert's weights;
        # the decode op takes it (tests/kernels/test_decode_experts.py).
        assert registry.whole_layer("torch", "auto", "cpu", torch.float32, (1, 8, 2048, 1024, 64)) == "decode"
    with settings.override(gemm_engine="native"):
        assert registry.whole_layer("torch", "auto", "cpu", torch.float32, small) is None


def _ops_run(fn):
    with torch.profiler.profile() as prof:
        fn()
    return {e.key for e in prof.key_averages() if e.key.startswith("fastmoe::")}


def check_auto_layer_runs(implementation, case):
    """With ``auto``, the layer at ``case`` runs the experts op on ``implementation`` forward and backward,
    a named engine runs the staged chain, and the two give the same output."""
    T, H, I, E, K, *_ = case
    x, w_gu, w_d, weights, idx = _inputs(*case)
    run = lambda **kw: moe_experts_forward(x, weights, idx, w_gu, w_d, **kw)  # noqa: E731
    with settings.override(gemm_engine="auto"):
        assert registry.whole_layer("torch", "auto", x.device, x.dtype, (T, K, H, I, E)) == implementation
        assert _ops_run(lambda: run(gemm_engine="auto").sum().backward()) == {
            "fastmoe::experts", "fastmoe::experts_backward"}
        got = run(gemm_engine="auto")
    assert {"fastmoe::route", "fastmoe::mlp_combine"} <= _ops_run(lambda: run(gemm_engine="loop"))
    assert_close(got, run(gemm_engine="loop"), msg=f"{implementation} vs staged")


def test_layer_takes_the_padded_op_when_small_and_the_staged_chain_otherwise():
    check_auto_layer_runs("padded", CASES["odd"])


def test_compiled_layer_runs_the_staged_chain():
    """A traced graph serves any T without a guard on the layer's size: the staged chain, eager's numbers."""
    x, w_gu, w_d, weights, idx = _inputs(*CASES["odd"])
    d = lambda t: t.detach()  # noqa: E731

    def layer(x, weights, idx):
        return moe_experts_forward(x, weights, idx, d(w_gu), d(w_d), gemm_engine="auto")

    seen = []

    def backend(gm, example_inputs):
        seen.append({str(n.target) for n in gm.graph.nodes if str(n.target).startswith("fastmoe.")})
        return gm

    with settings.override(gemm_engine="auto"):
        want = layer(d(x), d(weights), idx)
        for dynamic in (False, True):
            torch._dynamo.reset()
            seen.clear()
            got = torch.compile(layer, fullgraph=True, dynamic=dynamic, backend=backend)(d(x), d(weights), idx)
            assert_close(got, want, msg=f"compiled, dynamic={dynamic}")
            assert seen == [{"fastmoe.route.default", "fastmoe.mlp_combine.default"}], (dynamic, seen)
