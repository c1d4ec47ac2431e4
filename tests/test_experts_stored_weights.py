"""The plain path on transposed weights (GPT-OSS's ``[E, H, 2I]`` / ``[E, I, H]``) makes no copy of them.

The grouped-GEMM launchers read the weights as stored (``transposed=True``), so: what the forward
saves for backward is the parameters themselves, no operation of the forward produces a tensor of a
weight's size, and the backward produces exactly one weight-sized tensor per weight (its gradient,
already in the stored layout, taken by the parameter as is). Shapes are chosen so that no
activation is as large as a weight, which makes "weight-sized" unambiguous.
"""
from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

pytest.importorskip("transformers")

import fastmoe_xpu  # noqa: F401,E402  (registers "fastmoe")
from fastmoe_xpu.integrations.families import tiny_config  # noqa: E402

T, K, E, H, I = 5, 2, 4, 32, 32


def _gpt_oss_experts() -> torch.nn.Module:
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts

    cfg = tiny_config("gpt_oss", hidden_size=H, intermediate_size=I, num_local_experts=E, num_experts_per_tok=K)
    cfg._experts_implementation = "fastmoe"
    torch.manual_seed(0)
    experts = GptOssExperts(cfg)
    with torch.no_grad():
        for p in experts.parameters():
            p.copy_(torch.randn(p.shape) * 0.1)
    experts.fastmoe_backend = "torch"
    return experts


def _routing() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(T, H, generator=g, requires_grad=True)
    idx = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
    w = torch.softmax(torch.randn(T, K, generator=g), -1).requires_grad_()
    return x, idx, w


class _BigOutputs(TorchDispatchMode):
    """Records every new storage of at least ``min_numel`` elements an op returns (``owned``: storages to ignore)."""

    def __init__(self, min_numel: int, owned: list[torch.Tensor]) -> None:
        super().__init__()
        self.min_numel = min_numel
        self.owned = {t.untyped_storage().data_ptr() for t in owned}
        self.seen: list[tuple[str, tuple[int, ...]]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in (out if isinstance(out, (tuple, list)) else (out,)):
            if not isinstance(t, torch.Tensor) or t.numel() < self.min_numel:
                continue
            ptr = t.untyped_storage().data_ptr()
            if ptr not in self.owned:  # a new storage; views of it (detach, transpose) are not recorded again
                self.owned.add(ptr)
                self.seen.append((str(func), tuple(t.shape)))
        return out


def test_layout_is_the_transposed_one() -> None:
    experts = _gpt_oss_experts()
    assert experts.is_transposed and experts.gate_up_proj.shape == (E, H, 2 * I)
    # No activation of this test is as large as the smaller weight: "weight-sized" means a weight.
    assert T * K * 2 * I < experts.down_proj.numel()


def test_forward_saves_the_parameters_and_copies_no_weight() -> None:
    experts = _gpt_oss_experts()
    weights = [experts.gate_up_proj, experts.down_proj]
    x, idx, w = _routing()
    saved: list[torch.Tensor] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved.append(t)
        return t

    spy = _BigOutputs(min(p.numel() for p in weights), weights)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), spy:
        experts(x, idx, w)
    assert spy.seen == [], f"the forward made weight-sized tensors (copies of a weight): {spy.seen}"
    for p in weights:
        big = [t for t in saved if t.numel() == p.numel()]
        assert big, "the weight must be saved for backward"
        assert all(t.data_ptr() == p.data_ptr() and t.shape == p.shape for t in big), \
            "the weight saved for backward must be the parameter itself, not a copy"


def test_backward_makes_one_gradient_per_weight_in_the_stored_layout() -> None:
    experts = _gpt_oss_experts()
    weights = [experts.gate_up_proj, experts.down_proj]
    x, idx, w = _routing()
    out = experts(x, idx, w)
    spy = _BigOutputs(min(p.numel() for p in weights), weights)
    with spy:
        out.square().sum().backward()
    # One weight-sized result per weight: its gradient. A transposed layout computed as [E, out, in]
    # would need a second (the gradient copied into the parameter's layout).
    assert sorted(s for _, s in spy.seen) == sorted(tuple(p.shape) for p in weights), spy.seen
    for p in weights:
        assert p.grad is not None and p.grad.shape == p.shape and p.grad.stride() == p.stride()


def test_matches_eager_with_the_weights_read_in_place() -> None:
    experts = _gpt_oss_experts()
    x, idx, w = _routing()
    grads = {}
    for impl in ("eager", "fastmoe"):
        experts.config._experts_implementation = impl
        experts.zero_grad(set_to_none=True)
        xi, wi = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
        out = experts(xi, idx, wi)
        out.square().sum().backward()
        grads[impl] = [out.detach(), xi.grad, wi.grad] + [p.grad.clone() for p in experts.parameters()]
    for got, want in zip(grads["fastmoe"], grads["eager"]):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
