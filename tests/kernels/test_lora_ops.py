"""Per-expert LoRA inside stages 4-5 (fastmoe_xpu/autograd/lora_ops.py) against the plain-PyTorch
reference (fastmoe_xpu.reference.reference_lora_experts_forward) at awkward shapes, gradients of the
input, the router weights and both adapters included; the frozen base weights get no gradient and no
launcher ever forms one."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from fastmoe_xpu.autograd.lora_ops import ExpertsLora, LoraWeights, lora_grouped_linear
from fastmoe_xpu.autograd.moe_experts import moe_experts_forward
from fastmoe_xpu.autograd.ops import route
from fastmoe_xpu.kernels import registry
from fastmoe_xpu.reference import reference_lora_experts_forward
from tolerances import assert_close

# (T, H, I, E, K, r): odd sizes, T not a multiple of the token block, an expert left empty, rank 1
SHAPES = [(13, 20, 11, 5, 2, 3), (7, 9, 5, 4, 3, 1), (33, 16, 24, 6, 1, 8)]


def _case(T, H, I, E, K, r, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    rnd = lambda *s, scale=1.0: (torch.randn(*s, generator=g) * scale).to(dtype)  # noqa: E731
    x = rnd(T, H).requires_grad_()
    w_gu, w_d = rnd(E, 2 * I, H, scale=H ** -0.5), rnd(E, H, I, scale=I ** -0.5)
    logits = torch.randn(T, E, generator=g)
    logits[:, E - 1] = float("-inf")  # the last expert gets no token
    idx = logits.topk(K).indices
    weights = torch.rand(T, K, generator=g).to(dtype).requires_grad_()
    A1, B1 = rnd(E, r, H, scale=0.3).requires_grad_(), rnd(E, 2 * I, r, scale=0.3).requires_grad_()
    A2, B2 = rnd(E, r, I, scale=0.3).requires_grad_(), rnd(E, H, r, scale=0.3).requires_grad_()
    return x, weights, idx, w_gu, w_d, (A1, B1, 0.75), (A2, B2, 2.0)


def _check_against_reference(out, x, weights, idx, w_gu, w_d, lg, ld) -> None:
    """``out`` and its gradients (input, router weights, every adapter) against the reference."""
    ref = reference_lora_experts_forward(x, weights, idx, w_gu, w_d, lg, ld)
    assert_close(out, ref, msg="forward")
    inputs = [x, weights] + [t for ad in (lg, ld) if ad is not None for t in ad[:2]]
    dout = torch.randn_like(out)
    for i, (a, b) in enumerate(zip(torch.autograd.grad(out, inputs, dout), torch.autograd.grad(ref, inputs, dout))):
        assert_close(a, b, msg=f"gradient {i}")


@pytest.mark.parametrize("which", ["both", "gate_up", "down"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_lora_experts_match_reference(shape, which) -> None:
    x, weights, idx, w_gu, w_d, lg, ld = _case(*shape)
    assert not (idx == shape[3] - 1).any()  # an empty expert is part of every case
    lg = lg if which in ("both", "gate_up") else None
    ld = ld if which in ("both", "down") else None
    lora = ExpertsLora(None if lg is None else LoraWeights(*lg), None if ld is None else LoraWeights(*ld))
    out = moe_experts_forward(x, weights, idx, w_gu, w_d, backend="torch", gemm_engine="native", lora=lora)
    _check_against_reference(out, x, weights, idx, w_gu, w_d, lg, ld)


@pytest.fixture
def padded_spy(monkeypatch):
    """``gemm_engine="auto"`` not pinned by the suite's setting (so that a layer under the budget runs
    as one op, kernels/torch/padded.py), and a list of the padded LoRA kernels' calls."""
    from fastmoe_xpu import settings
    from fastmoe_xpu.kernels.torch import padded

    calls = []
    for name in ("lora_experts_forward", "lora_experts_backward"):
        real = getattr(padded, name)
        monkeypatch.setattr(padded, name, lambda *a, __real=real, __name=name: calls.append(__name) or __real(*a))
    registry.forget_choices()
    with settings.override(gemm_engine=None):
        yield calls
    registry.forget_choices()


@pytest.mark.parametrize("which", ["both", "gate_up", "down"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_small_layer_with_adapters_runs_in_one_op(shape, which, padded_spy) -> None:
    """A layer under the padded budget with gemm_engine='auto' runs its adapters inside the padded
    experts op (stages 2-5 in one piece), with the reference's numbers, gradients included."""
    x, weights, idx, w_gu, w_d, lg, ld = _case(*shape)
    lg = lg if which in ("both", "gate_up") else None
    ld = ld if which in ("both", "down") else None
    lora = ExpertsLora(None if lg is None else LoraWeights(*lg), None if ld is None else LoraWeights(*ld))
    out = moe_experts_forward(x, weights, idx, w_gu, w_d, backend="torch", gemm_engine="auto", lora=lora)
    assert padded_spy == ["lora_experts_forward"]
    _check_against_reference(out, x, weights, idx, w_gu, w_d, lg, ld)
    assert padded_spy == ["lora_experts_forward", "lora_experts_backward"]


def test_small_layer_with_adapters_on_an_expert_parallel_slice(padded_spy) -> None:
    """This rank's experts 2..4 of 7: choices of other ranks' experts go to the padded op's dump row and
    contribute nothing, to the output or to any gradient; adapters given as strided views (PEFT's are)."""
    T, H, I, E, K, r = 13, 20, 11, 7, 3, 4
    x, weights, idx, w_gu, w_d, lg, ld = _case(T, H, I, E, K, r, seed=3)
    start, NR = 2, 3
    w_gu, w_d = w_gu[start:start + NR].clone(), w_d[start:start + NR].clone()
    A1 = torch.randn(NR, H, r).mT.requires_grad_()  # [NR, r, H], not contiguous
    B1 = torch.randn(NR, 2 * I, r).requires_grad_()
    A2, B2 = torch.randn(NR, r, I).requires_grad_(), torch.randn(r, NR, H).permute(1, 2, 0).requires_grad_()
    lg, ld = (A1, B1, 0.5), (A2, B2, 1.5)
    lora = ExpertsLora(LoraWeights(*lg), LoraWeights(*ld))
    out = moe_experts_forward(x, weights, idx, w_gu, w_d, backend="torch", expert_start=start, gemm_engine="auto",
                              lora=lora)
    assert padded_spy == ["lora_experts_forward"]
    ref = reference_lora_experts_forward(x, weights, idx, w_gu, w_d, lg, ld, expert_start=start)
    assert_close(out, ref, msg="forward")
    inputs = [x, weights, A1, B1, A2, B2]
    dout = torch.randn_like(out)
    for i, (a, b) in enumerate(zip(torch.autograd.grad(out, inputs, dout), torch.autograd.grad(ref, inputs, dout))):
        assert_close(a, b, msg=f"gradient {i}")


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_small_layer_with_adapters_as_peft_views(shape, padded_spy) -> None:
    """PEFT hands the padded op views of its ``lora_A``/``lora_B`` weights: ``A [E, r, in]`` a reshape of
    ``[E*r, in]``, ``B [E, out, r]`` a permutation of ``[out, r*E]`` (the experts fastest, no unit stride
    within an expert's matrix). The op makes B dense once, outside the graph; the gradients reach
    the weights the views were taken from, with the reference's numbers."""
    T, H, I, E, K, r = shape
    x, weights, idx, w_gu, w_d, (A1, B1, s1), (A2, B2, s2) = _case(*shape)
    leaves, views = [], []
    for A, B in ((A1, B1), (A2, B2)):
        dense = dict(memory_format=torch.contiguous_format)
        wa = A.detach().reshape(E * r, A.shape[2]).clone(**dense).requires_grad_()  # lora_A.weight
        wb = B.detach().permute(1, 2, 0).reshape(B.shape[1], r * E).clone(**dense).requires_grad_()  # lora_B.weight
        a, b = wa.reshape(E, r, -1), wb.reshape(wb.shape[0], r, E).permute(2, 0, 1)
        assert torch.equal(a, A) and torch.equal(b, B) and not b.is_contiguous()
        leaves += [wa, wb]
        views.append((a, b))
    lg, ld = (*views[0], s1), (*views[1], s2)
    out = moe_experts_forward(x, weights, idx, w_gu, w_d, backend="torch", gemm_engine="auto",
                              lora=ExpertsLora(LoraWeights(*lg), LoraWeights(*ld)))
    assert padded_spy == ["lora_experts_forward"]
    ref = reference_lora_experts_forward(x, weights, idx, w_gu, w_d, lg, ld)
    assert_close(out, ref, msg="forward")
    inputs = [x, weights, *leaves]
    dout = torch.randn_like(out)
    for i, (a, b) in enumerate(zip(torch.autograd.grad(out, inputs, dout), torch.autograd.grad(ref, inputs, dout))):
        assert a.shape == inputs[i].shape
        assert_close(a, b, msg=f"gradient {i}")
    assert padded_spy == ["lora_experts_forward", "lora_experts_backward"]


@pytest.mark.parametrize("gemm_engine", ["auto", "native"], ids=["small-layer-padded", "native"])
def test_lora_bf16_forward_and_gradients(gemm_engine, request) -> None:
    """bf16 with adapters against the fp32 reference: on the staged chain (``native``), and as one op
    (``auto`` on a layer under the padded path's budget, kernels/torch/padded.py)."""
    spy = request.getfixturevalue("padded_spy") if gemm_engine == "auto" else None
    x, weights, idx, w_gu, w_d, lg, ld = _case(*SHAPES[0], dtype=torch.bfloat16)
    lora = ExpertsLora(LoraWeights(*lg), LoraWeights(*ld))
    out = moe_experts_forward(x, weights, idx, w_gu, w_d, backend="torch", gemm_engine=gemm_engine, lora=lora)
    if spy is not None:
        assert spy == ["lora_experts_forward"]
    f32 = lambda t: t.detach().float().requires_grad_()  # noqa: E731
    ref_in = [f32(x), f32(weights), f32(lg[0]), f32(lg[1]), f32(ld[0]), f32(ld[1])]
    ref = reference_lora_experts_forward(ref_in[0], ref_in[1], idx, w_gu.float(), w_d.float(),
                                         (ref_in[2], ref_in[3], lg[2]), (ref_in[4], ref_in[5], ld[2]))
    assert_close(out, ref, torch.bfloat16, "forward")
    dout = torch.randn(out.shape)
    got = torch.autograd.grad(out, [x, weights, *lg[:2], *ld[:2]], dout.bfloat16())
    want = torch.autograd.grad(ref, ref_in, dout)
    for i, (a, b) in enumerate(zip(got, want)):
        assert_close(a, b, torch.bfloat16, f"gradient {i}")


@pytest.fixture(params=["grouped_mm", "loop"])
def low_rank_engine(request, monkeypatch):
    """The engine of the adapters' r-wide products (the registry's ``low_rank_gemm`` for the torch
    base: grouped_mm where it runs, else the per-expert loop); both are run."""
    impl = registry.IMPLEMENTATIONS["torch"]
    monkeypatch.setitem(registry.IMPLEMENTATIONS, "torch", dataclasses.replace(impl, low_rank_gemm=(request.param,)))
    registry._low_rank_set.cache_clear()
    reason = registry.unavailable_reason(request.param, "torch", "cpu", torch.float32)
    if reason is not None:
        pytest.skip(f"low-rank products on {request.param}: {reason}")
    yield request.param
    registry._low_rank_set.cache_clear()


def test_low_rank_products_run_on_the_registry_choice(low_rank_engine, monkeypatch) -> None:
    """The r-wide products run on the engine the registry names (grouped_mm: one call per product,
    not one per expert), the base GEMMs on the kernel set's own; the results match the reference
    at an awkward shape with an empty expert either way."""
    x, weights, idx, w_gu, w_d, lg, ld = _case(*SHAPES[0])
    calls = []
    for engine, module in (("loop", registry.kernels("torch")), ("grouped_mm", registry.module_of("grouped_mm"))):
        for name in ("down_fwd", "down_bwd"):
            def spy(*a, __real=getattr(module, name), __what=(engine, name), **k):
                calls.append((*__what, tuple(a[2 if __what[1] == "down_fwd" else 3].shape)))
                return __real(*a, **k)

            monkeypatch.setattr(module, name, spy)
    registry.kernels.cache_clear()
    try:
        lora = ExpertsLora(LoraWeights(*lg), LoraWeights(*ld))
        out = moe_experts_forward(x, weights, idx, w_gu, w_d, backend="torch", gemm_engine="native", lora=lora)
        _check_against_reference(out, x, weights, idx, w_gu, w_d, lg, ld)
    finally:
        registry.kernels.cache_clear()
    adapter_shapes = {tuple(t.shape) for t in (*lg[:2], *ld[:2])}
    thin = [(engine, name) for engine, name, shape in calls if shape in adapter_shapes]
    # 4 forward products (A and B of both adapters) and 4 backward calls (each forms dA or dB), all on
    # the chosen engine; the base GEMMs (native: the loop) take the base weights
    assert sorted(thin) == [(low_rank_engine, "down_bwd")] * 4 + [(low_rank_engine, "down_fwd")] * 4
    assert {(e, sh) for e, _, sh in calls if sh not in adapter_shapes} == {("loop", tuple(w_gu.shape)),
                                                                            ("loop", tuple(w_d.shape))}


def test_no_base_weight_gradient_is_formed(monkeypatch) -> None:
    """Only adapter-shaped weights ever reach a weight-gradient launcher (of the base's kernels or
    of the engine running the r-wide products); the base weights' own backward launchers are never
    called."""
    x, weights, idx, w_gu, w_d, lg, ld = _case(*SHAPES[0])
    seen = []

    def forbidden(*args, **kwargs):
        raise AssertionError("a base-weight gradient launcher ran")

    for module in {registry.kernels("torch"), registry.module_of("grouped_mm"), registry.module_of("loop")}:
        def down_bwd(dy, a, cum, w, transposed=False, __real=module.down_bwd):
            seen.append(tuple(w.shape))
            return __real(dy, a, cum, w, transposed=transposed)

        monkeypatch.setattr(module, "down_bwd", down_bwd)
        for name in ("gate_up_bwd", "down_weighted_bwd"):
            monkeypatch.setattr(module, name, forbidden)
    registry.kernels.cache_clear()
    try:
        lora = ExpertsLora(LoraWeights(*lg), LoraWeights(*ld))
        out = moe_experts_forward(x, weights, idx, w_gu, w_d, backend="torch", gemm_engine="native", lora=lora)
        out.square().sum().backward()
    finally:
        registry.kernels.cache_clear()
    adapter_shapes = {tuple(t.shape) for t in (*lg[:2], *ld[:2])}
    assert seen and set(seen) <= adapter_shapes
    assert w_gu.grad is None and w_d.grad is None
    assert all(t.grad is not None and t.grad.abs().sum() > 0 for t in (*lg[:2], *ld[:2]))


@pytest.mark.parametrize("transposed", [False, True])
def test_lora_grouped_linear(transposed) -> None:
    """The plain layouts' GEMM with an adapter, weights stored ``[E, out, in]`` or ``[E, in, out]``."""
    T, IN, OUT, E, K, r = 11, 13, 7, 4, 2, 3
    g = torch.Generator().manual_seed(3)
    idx = torch.randn(T, E, generator=g).topk(K).indices
    rows = route(idx, 0, E, "torch", True)
    input_indices, cum = rows[0], rows[3]
    a = torch.randn(T * K, IN, generator=g).requires_grad_()
    w = torch.randn(E, OUT, IN, generator=g)
    A = torch.randn(E, r, IN, generator=g).requires_grad_()
    B = torch.randn(E, OUT, r, generator=g).requires_grad_()
    stored = w.transpose(1, 2).contiguous() if transposed else w
    y = lora_grouped_linear(a, stored, LoraWeights(A, B, 0.5), cum, "torch", transposed)
    bounds = cum.tolist()
    ref = torch.cat([a[s:t] @ (w[e] + 0.5 * B[e] @ A[e]).t() for e, (s, t) in enumerate(zip(bounds, bounds[1:]))])
    assert_close(y, ref, msg="forward")
    dy = torch.randn_like(y)
    for got, want in zip(torch.autograd.grad(y, [a, A, B], dy), torch.autograd.grad(ref, [a, A, B], dy)):
        assert_close(got, want)


def test_bad_adapters_raise() -> None:
    x, weights, idx, w_gu, w_d, lg, ld = _case(*SHAPES[1])
    bad = ExpertsLora(LoraWeights(lg[0][:, :, :-1], lg[1], 1.0))
    with pytest.raises(ValueError, match="error: gate_up_proj LoRA"):
        moe_experts_forward(x, weights, idx, w_gu, w_d, backend="torch", lora=bad)
    with pytest.raises(TypeError, match="dtype"):
        moe_experts_forward(x, weights, idx, w_gu, w_d, backend="torch",
                            lora=ExpertsLora(down=LoraWeights(ld[0].double(), ld[1].double(), 1.0)))
    with pytest.raises(ValueError, match="requires grad"):
        moe_experts_forward(x, weights, idx, w_gu.requires_grad_(), w_d, backend="torch",
                            lora=ExpertsLora(LoraWeights(*lg)))


def test_lora_experts_on_triton_kernels() -> None:
    """The Triton backend (under the interpreter on the CPU) runs the same LoRA ops on its grouped-GEMM
    kernels: forward and every gradient against the reference, an empty expert included."""
    pytest.importorskip("triton")
    x, weights, idx, w_gu, w_d, lg, ld = _case(*SHAPES[0])
    lora = ExpertsLora(LoraWeights(*lg), LoraWeights(*ld))
    from fastmoe_xpu.kernels import triton as triton_kernels

    fused = []
    real = triton_kernels.down_fwd_lora
    with pytest.MonkeyPatch.context() as mp:  # the up-projections run in the base GEMMs' epilogue
        mp.setattr(triton_kernels, "down_fwd_lora", lambda *a, **k: (fused.append(a[4].shape), real(*a, **k))[1])
        out = moe_experts_forward(x, weights, idx, w_gu, w_d, backend="triton", gemm_engine="native", lora=lora)
    assert fused == [lg[1].shape, ld[1].shape]
    _check_against_reference(out, x, weights, idx, w_gu, w_d, lg, ld)


@pytest.mark.parametrize("which", ["both", "down"])
def test_opcheck_lora_ops(which) -> None:
    """Every LoRA op through torch.library's opcheck (schema, fake, autograd registration, dispatch),
    on worst-case row buffers as a traced call sees them; the ops' bodies are in ops.BODIES, where
    bench.studies.audit finds them."""
    from fastmoe_xpu.autograd import lora_ops, ops

    assert set(lora_ops.LORA_OP_NAMES) <= set(ops.BODIES)
    T, H, I, E, K, r = SHAPES[0]
    x, weights, idx, w_gu, w_d, (A1, B1, s1), (A2, B2, s2) = _case(T, H, I, E, K, r)
    if which == "down":
        A1 = B1 = None
    rows = route(idx, 0, E, "torch", False)
    out, gate_up, t1, t2 = torch.ops.fastmoe.lora_mlp_combine(x, w_gu, w_d, weights, A1, B1, A2, B2, *rows, s1, s2,
                                                              "torch", "")
    d = lambda t: None if t is None else t.detach()  # noqa: E731
    a = torch.randn(T * K, H).requires_grad_()
    la, lb = torch.randn(E, r, H).requires_grad_(), torch.randn(E, 2 * I, r).requires_grad_()
    y, t = torch.ops.fastmoe.lora_grouped_linear(a, w_gu, la, lb, rows[3], s1, "torch", False)
    cases = {
        "lora_mlp_combine": (x, w_gu, w_d, weights, A1, B1, A2, B2, *rows, s1, s2, "torch", ""),
        "lora_mlp_combine_backward": (torch.randn(T, H), d(x), w_gu, w_d, d(weights), d(A1), d(B1), d(A2), d(B2),
                                      gate_up, t1, t2, *rows, s1, s2, "torch", ""),
        "lora_grouped_linear": (a, w_gu, la, lb, rows[3], s1, "torch", False),
        "lora_grouped_linear_backward": (torch.randn_like(y), d(a), d(t), w_gu, la.detach(), lb.detach(), rows[3], s1,
                                         "torch", False),
    }
    out2, gate_up_s, plan = torch.ops.fastmoe.lora_experts(x, w_gu, w_d, weights, A1, B1, A2, B2, idx, 0, E, s1, s2,
                                                           "padded")
    cases["lora_experts"] = (x, w_gu, w_d, weights, A1, B1, A2, B2, idx, 0, E, s1, s2, "padded")
    cases["lora_experts_backward"] = (torch.randn(T, H), d(x), w_gu, w_d, d(weights), d(A1), d(B1), d(A2), d(B2),
                                      gate_up_s, plan, 0, E, s1, s2, "padded")
    assert set(cases) == set(lora_ops.LORA_OP_NAMES)
    for name, args in cases.items():
        if which == "down" and "grouped_linear" in name:
            continue  # no optional adapter there: checked once, with "both"
        torch.library.opcheck(getattr(torch.ops.fastmoe, name).default, args)


@pytest.mark.parametrize("rank", [1, 20], ids=["r1", "r20"])
@pytest.mark.parametrize("transposed", [False, True], ids=["W", "W_stored_in_out"])
def test_triton_lora_epilogue(transposed, rank) -> None:
    """The Triton grouped GEMM with the LoRA up-projection in its epilogue (``down_fwd_lora``, under
    the interpreter) against per-expert torch: odd widths, an empty expert, a rank below one dot
    chunk and one over it (two chunks of 16), worst-case rows past RT (never read)."""
    pytest.importorskip("triton")
    from fastmoe_xpu.kernels.triton import grouped_gemm

    g = torch.Generator().manual_seed(5)
    E, IN, OUT = 4, 19, 13
    counts = [5, 0, 9, 3]
    RT = sum(counts)
    R = RT + 6
    cum = torch.tensor([0, *torch.tensor(counts).cumsum(0).tolist()], dtype=torch.int32)
    h = torch.randn(R, IN, generator=g)
    w = torch.randn(E, OUT, IN, generator=g)
    t = torch.randn(R, rank, generator=g)
    B = torch.randn(E, OUT, rank, generator=g)
    stored = w.transpose(1, 2).contiguous() if transposed else w
    y = grouped_gemm.down_fwd_lora(h, cum, stored, t, B, transposed=transposed)
    bounds = cum.tolist()
    want = torch.cat([h[s:e] @ w[i].t() + t[s:e] @ B[i].t() for i, (s, e) in enumerate(zip(bounds, bounds[1:]))])
    assert y.shape == (R, OUT)
    assert_close(y[:RT], want, msg="fused epilogue")
    with pytest.raises(ValueError, match="down_fwd_lora"):
        grouped_gemm.down_fwd_lora(h, cum, stored, t, B[:, :-1], transposed=transposed)
