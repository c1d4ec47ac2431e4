"""bf16/fp16 forwards no backward follows (generation) round where transformers' own experts round
(``fastmoe_xpu/kernels/torch/rounding.py``): the ``decode`` and ``padded`` bodies against
``transformers.integrations.moe.grouped_mm_experts_forward`` on the same inputs, bit for bit, at
awkward shapes (T = 1, 3, 5; K = 2, 3; H and I multiples of 8, not of 16: transformers' grouped_mm
needs 16-byte row strides), with bf16 routing weights
(Qwen3-MoE, OLMoE) and fp32 ones (Mixtral). The training path (a backward follows) keeps fp32
SiLU*up: its output and gradients against the fp32 reference within tests/tolerances.py.
"""
import types

import pytest
import torch

from fastmoe_xpu import settings
from fastmoe_xpu.autograd.moe_experts import moe_experts_forward
from fastmoe_xpu.kernels import grouped_mm
from fastmoe_xpu.kernels.torch import decode, padded, rounding
from fastmoe_xpu.reference import reference_experts_forward
from tolerances import assert_close

moe = pytest.importorskip("transformers.integrations.moe")

# (T, H, I, E, K)
SHAPES = [(1, 40, 24, 6, 2), (1, 56, 40, 8, 3), (3, 40, 24, 6, 2), (5, 56, 40, 8, 3), (3, 72, 56, 4, 3)]


def _inputs(T, H, I, E, K, dtype, weights_dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=g).to(dtype)
    w_gu = (torch.randn(E, 2 * I, H, generator=g) / H ** 0.5).to(dtype)
    w_d = (torch.randn(E, H, I, generator=g) / I ** 0.5).to(dtype)
    idx = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
    weights = torch.rand(T, K, generator=g).softmax(-1).to(weights_dtype)
    return x, w_gu, w_d, weights, idx


def _transformers(x, w_gu, w_d, weights, idx):
    """transformers' grouped_mm experts forward on a module holding ``w_gu [E, 2I, H]``, ``w_d [E, H, I]``."""
    module = types.SimpleNamespace(
        num_experts=w_gu.shape[0], has_gate=True, has_bias=False, is_transposed=False, _is_expert_parallel=False,
        has_post_expert_norm=False, gate_up_proj=w_gu, down_proj=w_d, act_fn=torch.nn.functional.silu)
    module._apply_gate = lambda gate_up: moe._default_apply_gate(module, gate_up)
    return moe.grouped_mm_experts_forward(module, x, idx, weights)


def _bits_equal(got, want, what):
    assert got.dtype == want.dtype and got.shape == want.shape, what
    diff = (got.float() - want.float()).abs()
    assert torch.equal(got, want), f"{what}: {int((diff > 0).sum())} of {diff.numel()} differ, max {diff.max():.3g}"


@pytest.mark.parametrize("weights_dtype", ["same", torch.float32], ids=["bf16-weights", "fp32-weights"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "T{}-H{}-I{}-E{}-K{}".format(*s))
@pytest.mark.parametrize("body", [decode, padded], ids=["decode", "padded"])
def test_no_grad_body_rounds_as_transformers_grouped_mm(body, shape, dtype, weights_dtype):
    x, w_gu, w_d, weights, idx = _inputs(*shape, dtype, dtype if weights_dtype == "same" else weights_dtype)
    want = _transformers(x, w_gu, w_d, weights, idx)
    with torch.no_grad():
        got, _, _ = body.experts_forward(x, w_gu, w_d, weights, idx, 0, w_gu.shape[0])
    _bits_equal(got, want, f"{body.__name__} {shape} {dtype}")


@pytest.mark.parametrize("shape", SHAPES[:4], ids=lambda s: "T{}-H{}-I{}-E{}-K{}".format(*s))
def test_generation_through_the_layer_rounds_as_transformers(shape):
    """Under no_grad with parameters that require gradients (a model's generate), the whole layer."""
    x, w_gu, w_d, weights, idx = _inputs(*shape, torch.bfloat16, torch.bfloat16)
    w_gu, w_d = torch.nn.Parameter(w_gu), torch.nn.Parameter(w_d)
    want = _transformers(x, w_gu.detach(), w_d.detach(), weights, idx)
    with torch.no_grad(), settings.override(gemm_engine="auto"):
        got = moe_experts_forward(x, weights, idx, w_gu, w_d, backend="torch", gemm_engine="auto")
    _bits_equal(got, want, f"layer {shape}")


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "T{}-H{}-I{}-E{}-K{}".format(*s))
def test_training_keeps_fp32_silu_and_matches_the_fp32_reference(shape):
    """With a backward to follow the forward is the fp32-SiLU one (not the per-step rounding), and
    output and gradients match the fp32 reference within the bf16 tolerance."""
    x, w_gu, w_d, weights, idx = _inputs(*shape, torch.bfloat16, torch.bfloat16)
    leaves = [t.clone().requires_grad_() for t in (x, w_gu, w_d, weights)]
    with settings.override(gemm_engine="auto"):  # the whole-layer bodies, through their op
        out = moe_experts_forward(leaves[0], leaves[3], idx, leaves[1], leaves[2], backend="torch", gemm_engine="auto")
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(out.dtype)
    grads = torch.autograd.grad(out, leaves, dout)
    ref_leaves = [t.float().requires_grad_() for t in (x, w_gu, w_d, weights)]
    ref = reference_experts_forward(ref_leaves[0], ref_leaves[3], idx, ref_leaves[1], ref_leaves[2])
    ref_grads = torch.autograd.grad(ref, ref_leaves, dout.float())
    assert_close(out, ref, torch.bfloat16, msg=f"out {shape}")
    for name, g, r in zip(("dx", "dw_gate_up", "dw_down", "dweights"), grads, ref_grads):
        assert_close(g, r, torch.bfloat16, msg=f"{name} {shape}")
    # the same forward as the body computes inside backward_follows (fp32 SiLU*up, one rounding)
    with torch.no_grad(), rounding.backward_follows():
        body = decode if shape[0] == 1 else padded
        kept, _, _ = body.experts_forward(x, w_gu, w_d, weights, idx, 0, w_gu.shape[0])
    _bits_equal(out.detach(), kept, f"training forward {shape}")


def test_per_step_only_for_half_inputs_outside_a_backward():
    x = torch.zeros(2, 3, dtype=torch.bfloat16)
    assert rounding.per_step(x) and rounding.per_step(x.half()) and not rounding.per_step(x.float())
    with rounding.backward_follows():
        assert not rounding.per_step(x)
    assert rounding.per_step(x)


@pytest.mark.parametrize("weights_dtype", [torch.bfloat16, torch.float32], ids=["bf16-weights", "fp32-weights"])
def test_staged_chain_without_grad_rounds_as_transformers(weights_dtype, monkeypatch):
    """A layer above the whole-layer bodies' budget (a prefill) off the one-piece path runs the staged
    chain; its combine (kernels/torch/combine.py) weights and sums as transformers does when no
    backward follows."""
    x, w_gu, w_d, weights, idx = _inputs(61, 136, 88, 8, 3, torch.bfloat16, weights_dtype)
    w_gu, w_d = torch.nn.Parameter(w_gu), torch.nn.Parameter(w_d)
    want = _transformers(x, w_gu.detach(), w_d.detach(), weights, idx)
    monkeypatch.setattr(grouped_mm, "ONE_PIECE", False)
    monkeypatch.setattr(grouped_mm, "small_inference", lambda *a: pytest.fail("the one-piece path ran"))
    with torch.no_grad(), settings.override(gemm_engine="auto"):
        got = moe_experts_forward(x, weights, idx, w_gu, w_d, backend="torch", gemm_engine="auto")
    _bits_equal(got, want, "staged chain")


@pytest.mark.parametrize("weights_dtype", ["same", torch.float32], ids=["bf16-weights", "fp32-weights"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", SHAPES[2:] + [(61, 136, 88, 8, 3), (2, 40, 24, 6, 1)],
                         ids=lambda s: "T{}-H{}-I{}-E{}-K{}".format(*s))
def test_one_piece_inference_rounds_as_transformers(shape, dtype, weights_dtype, monkeypatch):
    """A call of several tokens no backward follows on the untimed grouped_mm engine runs in one piece
    (``grouped_mm.small_inference``), bf16 and fp16 too: transformers' bits, on its own and through the
    layer (parameters that require gradients, under no_grad)."""
    x, w_gu, w_d, weights, idx = _inputs(*shape, dtype, dtype if weights_dtype == "same" else weights_dtype)
    want = _transformers(x, w_gu, w_d, weights, idx)
    assert grouped_mm.small_inference_runs(x, w_gu, w_d, weights)
    _bits_equal(grouped_mm.small_inference(x, w_gu, w_d, weights, idx), want, f"small_inference {shape} {dtype}")
    ran = []
    real = grouped_mm.small_inference
    monkeypatch.setattr(grouped_mm, "small_inference", lambda *a: ran.append(1) or real(*a))
    w_gu, w_d = torch.nn.Parameter(w_gu), torch.nn.Parameter(w_d)
    with torch.no_grad(), settings.override(gemm_engine="auto"):
        got = moe_experts_forward(x, weights, idx, w_gu, w_d, backend="torch", gemm_engine="auto")
    assert ran == [1]
    _bits_equal(got, want, f"layer {shape} {dtype}")


def test_compiled_training_forward_keeps_training_numerics():
    """A compiled graph's forward calls the staged chain's ops with grad mode off and no Function of
    ours around them: with a backward to follow it must still not round per step (it is told by the
    request's ``:inference`` suffix only), so compiled and eager training forwards are bit-equal."""
    x, w_gu, w_d, weights, idx = _inputs(61, 136, 88, 8, 3, torch.bfloat16, torch.bfloat16)
    leaves = [t.clone().requires_grad_() for t in (x, w_gu, w_d, weights)]

    def layer(a, b, c, d):
        return moe_experts_forward(a, d, idx, b, c, backend="torch")

    eager = layer(*leaves)
    torch._dynamo.reset()
    compiled = torch.compile(layer)(*leaves)
    _bits_equal(compiled.detach(), eager.detach(), "compiled training forward")


@pytest.mark.parametrize("gather", [True, False], ids=["batched", "per-expert"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_one_token_products_either_way_round_as_transformers(gather, dtype, monkeypatch):
    """One token's bf16/fp16 products: the chosen experts' matrices side by side in one batched product
    (up to ``decode.GATHER_MAX_BYTES``) or a matrix-vector product per expert; transformers' bits either way."""
    monkeypatch.setattr(decode, "GATHER_MAX_BYTES", 1 << 30 if gather else 0)
    for shape in SHAPES[:2]:
        x, w_gu, w_d, weights, idx = _inputs(*shape, dtype, dtype)
        assert decode._gathered(w_gu, shape[4]) == gather
        want = _transformers(x, w_gu, w_d, weights, idx)
        with torch.no_grad():
            got, _, _ = decode.experts_forward(x, w_gu, w_d, weights, idx, 0, w_gu.shape[0])
        _bits_equal(got, want, f"{'batched' if gather else 'per-expert'} {shape} {dtype}")
