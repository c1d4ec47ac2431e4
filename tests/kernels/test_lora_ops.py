"""Per-expert LoRA inside stages 4-5 (fastmoe_xpu/autograd/lora_ops.py) against the plain-PyTorch
reference (fastmoe_xpu.reference.reference_lora_experts_forward) at awkward shapes, gradients of the
input, the router weights and both adapters included; the frozen base weights get no gradient and no
launcher ever forms one."""
from __future__ import annotations

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


@pytest.mark.parametrize("which", ["both", "gate_up", "down"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_lora_experts_match_reference(shape, which) -> None:
    x, weights, idx, w_gu, w_d, lg, ld = _case(*shape)
    assert not (idx == shape[3] - 1).any()  # an empty expert is part of every case
    lg = lg if which in ("both", "gate_up") else None
    ld = ld if which in ("both", "down") else None
    lora = ExpertsLora(None if lg is None else LoraWeights(*lg), None if ld is None else LoraWeights(*ld))
    out = moe_experts_forward(x, weights, idx, w_gu, w_d, backend="torch", gemm_engine="native", lora=lora)
    ref = reference_lora_experts_forward(x, weights, idx, w_gu, w_d, lg, ld)
    assert_close(out, ref, msg="forward")
    inputs = [x, weights] + [t for ad in (lg, ld) if ad is not None for t in ad[:2]]
    dout = torch.randn_like(out)
    got = torch.autograd.grad(out, inputs, dout)
    want = torch.autograd.grad(ref, inputs, dout)
    for i, (a, b) in enumerate(zip(got, want)):
        assert_close(a, b, msg=f"gradient {i}")


def test_lora_bf16_forward_and_gradients() -> None:
    x, weights, idx, w_gu, w_d, lg, ld = _case(*SHAPES[0], dtype=torch.bfloat16)
    lora = ExpertsLora(LoraWeights(*lg), LoraWeights(*ld))
    out = moe_experts_forward(x, weights, idx, w_gu, w_d, backend="torch", gemm_engine="native", lora=lora)
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


def test_no_base_weight_gradient_is_formed(monkeypatch) -> None:
    """Only adapter-shaped weights ever reach a weight-gradient launcher; the base weights' own
    backward launchers are never called."""
    x, weights, idx, w_gu, w_d, lg, ld = _case(*SHAPES[0])
    torch_kernels = registry.kernels("torch")
    seen = []
    real_down_bwd = torch_kernels.down_bwd

    def down_bwd(dy, a, cum, w, transposed=False):
        seen.append(tuple(w.shape))
        return real_down_bwd(dy, a, cum, w, transposed=transposed)

    def forbidden(*args, **kwargs):
        raise AssertionError("a base-weight gradient launcher ran")

    monkeypatch.setattr(torch_kernels, "down_bwd", down_bwd)
    for name in ("gate_up_bwd", "down_weighted_bwd"):
        monkeypatch.setattr(torch_kernels, name, forbidden)
    lora = ExpertsLora(LoraWeights(*lg), LoraWeights(*ld))
    out = moe_experts_forward(x, weights, idx, w_gu, w_d, backend="torch", gemm_engine="native", lora=lora)
    out.square().sum().backward()
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
    out = moe_experts_forward(x, weights, idx, w_gu, w_d, backend="triton", gemm_engine="native", lora=lora)
    ref = reference_lora_experts_forward(x, weights, idx, w_gu, w_d, lg, ld)
    assert_close(out, ref, msg="forward")
    inputs = [x, weights, *lg[:2], *ld[:2]]
    dout = torch.randn_like(out)
    for i, (a, b) in enumerate(zip(torch.autograd.grad(out, inputs, dout), torch.autograd.grad(ref, inputs, dout))):
        assert_close(a, b, msg=f"gradient {i}")
