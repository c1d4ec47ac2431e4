"""The differentiable ops' Autograd kernels apply their Function through the C++ apply
(fastmoe_xpu/autograd/ops.py: _function_apply): the same outputs and gradients as
``Function.apply``, dead functorch wrappers unwrapped as it does, ``Function.apply`` itself under a
functorch transform, and for a Function that has a ``setup_context``."""
from __future__ import annotations

import pytest
import torch

from fastmoe_xpu.autograd.ops import _function_apply


class _ScaledProduct(torch.autograd.Function):
    """``x * w * k`` with a hand-written backward (no setup_context, as the package's Functions)."""

    @staticmethod
    def forward(ctx, x, w, k):  # noqa: ANN001, ANN205
        ctx.save_for_backward(x, w)
        ctx.k = k
        return x * w * k

    @staticmethod
    def backward(ctx, g):  # noqa: ANN001, ANN205
        x, w = ctx.saved_tensors
        return g * w * ctx.k, g * x * ctx.k, None


class _WithSetupContext(torch.autograd.Function):
    @staticmethod
    def forward(x):  # noqa: ANN001, ANN205
        return x * 2

    @staticmethod
    def setup_context(ctx, inputs, output):  # noqa: ANN001, ANN205
        pass

    @staticmethod
    def backward(ctx, g):  # noqa: ANN001, ANN205
        return g * 2


def _grads(apply, x, w):  # noqa: ANN001, ANN202
    x, w = x.detach().requires_grad_(), w.detach().requires_grad_()
    out = apply(x, w, 1.5)
    out.backward(torch.linspace(-1, 1, out.numel()).view_as(out))
    return out.detach(), x.grad, w.grad


def test_outputs_and_gradients_are_function_apply_s() -> None:
    x, w = torch.randn(3, 5), torch.randn(3, 5)
    fast = _function_apply(_ScaledProduct)
    for got, want in zip(_grads(fast, x, w), _grads(_ScaledProduct.apply, x, w)):
        torch.testing.assert_close(got, want, atol=0, rtol=0)
    out = fast(x, w.requires_grad_(), 1.5)
    assert type(out.grad_fn).__name__ == "_ScaledProductBackward"


def test_a_dead_functorch_wrapper_is_unwrapped() -> None:
    """A tensor that escaped a finished ``torch.func.grad`` (a dead wrapper) is read as what it wraps."""
    leaked = []

    def f(x):  # noqa: ANN001, ANN202
        leaked.append(x * 2)
        return (x * 3).sum()

    torch.func.grad(f)(torch.randn(4))
    dead = leaked[0]
    assert torch._C._functorch.is_functorch_wrapped_tensor(dead)
    w = torch.randn(4, requires_grad=True)
    out = _function_apply(_ScaledProduct)(dead, w, 2.0)
    assert not torch._C._functorch.is_functorch_wrapped_tensor(out)
    torch.testing.assert_close(out, _ScaledProduct.apply(dead, w, 2.0), atol=0, rtol=0)
    out.sum().backward()
    torch.testing.assert_close(w.grad, torch._C._functorch.unwrap_if_dead(dead) * 2.0, atol=0, rtol=0)


def test_under_a_functorch_transform_it_is_function_apply() -> None:
    """With a transform active the call is ``Function.apply``'s: for a Function without
    ``setup_context`` that is its refusal, word for word."""
    w = torch.randn(3)
    errors = []
    for apply in (_ScaledProduct.apply, _function_apply(_ScaledProduct)):
        with pytest.raises(RuntimeError, match="setup_context") as err:
            torch.func.grad(lambda x, apply=apply: apply(x, w, 2.0).sum())(torch.randn(3))
        errors.append(str(err.value))
    assert errors[0] == errors[1]


def test_a_function_with_setup_context_keeps_function_apply() -> None:
    assert _function_apply(_WithSetupContext) == _WithSetupContext.apply
