"""What the tests of the Triton int8 and fp8 grouped GEMMs share (tests/kernels/test_int8_triton.py,
tests/kernels/test_fp8_triton.py): the weight-gradient case, the fixture that refuses a host read
of the expert bounds, and the comparison of a layer's output and gradients with the reference's."""
from __future__ import annotations

from typing import Callable

import pytest
import torch

from fastmoe_xpu.autograd.moe_experts import moe_experts_forward
from fastmoe_xpu.kernels.quantized import launchers as qlaunchers, reference as qref, small as qsmall
from fastmoe_xpu.routing import topk_routing

#: The layers ``(T, H, I, E, K)`` the layer tests run: awkward widths, a layer whose routing leaves
#: experts empty (T = 5, see :func:`run_layer`) and a single token.
LAYER_SHAPES = pytest.mark.parametrize("shape", [(37, 33, 20, 7, 3), (5, 16, 9, 9, 2), (1, 12, 10, 4, 2)],
                                       ids=lambda s: "T{}-H{}-I{}-E{}-K{}".format(*s))


def layer_case(T, H, I, E, K, seed=0, empty=False):  # noqa: ANN001, ANN201
    """``(x, weights, topk_idx, w_gate_up, w_down, dout)`` of a layer; ``empty``: the routing avoids
    the experts past K + 1."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=g)
    logits = torch.randn(T, E, generator=g)
    if empty:
        logits[:, K + 1:] -= 100
    weights, idx = topk_routing(logits, K, True)
    return (x, weights, idx, torch.randn(E, 2 * I, H, generator=g) * 0.3, torch.randn(E, H, I, generator=g) * 0.3,
            torch.randn(T, H, generator=g))


def run_layer(shape, dev: torch.device, fmt: str):  # noqa: ANN001, ANN201
    """The layer of ``shape`` (:data:`LAYER_SHAPES`; experts left empty for T = 5) in
    ``expert_precision=fmt`` on the Triton base, forward and backward on ``dev``, and the reference's
    numbers: ``(out, leaves (x, weights, w_gate_up, w_down), reference, topk_idx)``."""
    x, weights, idx, w_gu, w_d, dout = layer_case(*shape, empty=shape[0] == 5)
    leaves = [t.clone().to(dev).requires_grad_(True) for t in (x, weights, w_gu, w_d)]
    out = moe_experts_forward(leaves[0], leaves[1], idx.to(dev), leaves[2], leaves[3], backend="triton",
                              expert_precision=fmt)
    out.backward(dout.to(dev))
    return out, leaves, qref.moe_forward_backward(x, weights, idx, w_gu, w_d, dout, fmt), idx


def down_case(transposed: bool):  # noqa: ANN201
    """The down launchers' case: ``(counts, cum_token_counts, a [R, 11], w [4, 13, 11], the weight as
    stored (``transposed``: ``[4, 11, 13]``), dy [R, 13])`` with counts 5, 0, 19, 1 and two rows past RT."""
    g = torch.Generator().manual_seed(3)
    counts = [5, 0, 19, 1]
    cum = torch.tensor([0, *torch.tensor(counts).cumsum(0).tolist()], dtype=torch.int32)
    a = torch.randn(sum(counts) + 2, 11, generator=g)
    w = torch.randn(4, 13, 11, generator=g)
    stored = w.transpose(1, 2).contiguous() if transposed else w
    dy = torch.randn(sum(counts) + 2, 13, generator=g)
    return counts, cum, a, w, stored, dy


def wgrad_case(counts, M, N, seed):  # noqa: ANN001, ANN201
    """Gradient rows ``g [R, M]`` and input rows ``x [T, N]`` gathered by ``idx [R]``, with NaN, inf
    and out-of-range indices in the rows past RT (unspecified there: never read)."""
    g = torch.Generator().manual_seed(seed)
    cum = torch.tensor([0, *torch.tensor(counts).cumsum(0).tolist()], dtype=torch.int32)
    rt, R, T = sum(counts), sum(counts) + 3, 13
    grad = torch.randn(R, M, generator=g) * torch.rand(M, generator=g) * 4  # columns of different sizes
    grad[rt:] = float("nan")
    grad[rt + 1:, 0] = float("inf")
    x = torch.randn(T, N, generator=g)
    idx = torch.randint(0, T, (R,), generator=g, dtype=torch.int32)
    idx[rt:] = 10**6
    if rt > 2:
        grad[1] = 0  # a zero row within an expert
    return cum, grad, x, idx


@pytest.fixture
def no_host_bounds(monkeypatch):  # noqa: ANN001, ANN201
    """The quantized launchers' host read of the expert bounds, made to fail: the Triton int8 and fp8
    paths must never take it. Returns a function that allows it again (for the torch-base launchers)."""
    real = qlaunchers._groups

    def refuse(cum_token_counts):  # noqa: ANN001, ANN202
        raise AssertionError("the expert bounds were read on the host")

    monkeypatch.setattr(qlaunchers, "_groups", refuse)
    return lambda: monkeypatch.setattr(qlaunchers, "_groups", real)


def fp8_layer_tol(device: torch.device) -> dict:
    """The fp8 layers' tolerance against their reference: under the interpreter, fp32 sums in another
    order than the reference's exact ones (as tests/test_precision.py allows the torch base's fp8); on a
    GPU, the coarser in-MMA additions, which may move a requantized value to the neighbouring code."""
    return dict(rtol=2e-5, atol=1e-6) if device.type == "cpu" else dict(rtol=2e-2, atol=1e-3)


def close_to_scale(got: torch.Tensor, want: torch.Tensor, what: str, tol: dict) -> None:
    """``got`` equals ``want`` within ``tol``'s ``rtol``, the absolute part ``atol + rtol * max|want|``."""
    scale = want.abs().max().item() if want.numel() else 1.0
    torch.testing.assert_close(got.detach().float().cpu(), want.float().cpu(), rtol=tol["rtol"],
                               atol=tol["atol"] + tol["rtol"] * scale, msg=lambda m: f"{what}: {m}")


def bf16_layer(dev: torch.device, fmt: str, shape: tuple[int, int, int, int, int], seed: int):  # noqa: ANN201
    """The layer of ``shape`` in bf16 (activations, weights, router weights, output gradient) on the
    Triton base in ``expert_precision=fmt``, forward and backward on ``dev``: ``(got, case)`` with ``got``
    the output and the gradients as :func:`within_of` compares them, ``case`` the bf16 inputs."""
    x, weights, idx, w_gu, w_d, dout = layer_case(*shape, seed=seed)
    x, weights, w_gu, w_d, dout = (t.to(torch.bfloat16) for t in (x, weights, w_gu, w_d, dout))
    leaves = [t.to(dev).requires_grad_(True) for t in (x, weights, w_gu, w_d)]
    out = moe_experts_forward(leaves[0], leaves[1], idx.to(dev), leaves[2], leaves[3], backend="triton",
                              expert_precision=fmt)
    out.backward(dout.to(dev))
    assert out.dtype == torch.bfloat16 and leaves[2].grad.dtype == torch.bfloat16
    return [out, leaves[0].grad, leaves[2].grad, leaves[3].grad, leaves[1].grad], (x, weights, idx, w_gu, w_d, dout)


def within_of(got: list[torch.Tensor], want: tuple[torch.Tensor, ...], bound: float) -> None:
    """Each of the output and gradients ``got`` within ``bound`` of the reference's (relative norm)."""
    for name, a, b in zip(("out", "dx", "dw_gate_up", "dw_down", "dweights"), got, want):
        rel = ((a.detach().float().cpu() - b).norm() / b.norm()).item()
        assert rel < bound, (name, rel)


def check_layer(close: Callable[[torch.Tensor, torch.Tensor, str], None], out: torch.Tensor,
                leaves: list[torch.Tensor], want: tuple[torch.Tensor, ...]) -> None:
    """``close`` on a layer's output and the gradients of its leaves ``(x, weights, w_gate_up, w_down)``
    against the reference's ``(out, dx, dw_gate_up, dw_down, dweights)``."""
    close(out, want[0], "output")
    close(leaves[0].grad, want[1], "input gradient")
    close(leaves[2].grad, want[2], "gate_up weight gradient")
    close(leaves[3].grad, want[3], "down weight gradient")
    close(leaves[1].grad, want[4], "router-weight gradient")


class WeightCodes(list):
    """Every distinct set of weight codes the quantized launchers got from ``core.quantized_weight``
    since the last :meth:`clear` (each object once: a hit of the remembered codes adds nothing), and
    ``calls``, how many times they asked."""

    calls = 0

    def clear(self) -> None:
        super().clear()
        self.calls = 0


def count_weight_codes(monkeypatch) -> WeightCodes:  # noqa: ANN001
    """Counts the weight quantizations of the int8/fp8 launchers and of the one-piece int8 layer
    (``kernels/quantized/small.py``) for the rest of the test (:class:`WeightCodes`)."""
    made = WeightCodes()
    real = qlaunchers.quantized_weight
    assert qsmall.quantized_weight is real

    def counting(w, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
        made.calls += 1
        qw = real(w, *args, **kwargs)
        if not any(qw is m for m in made):
            made.append(qw)
        return qw
    monkeypatch.setattr(qlaunchers, "quantized_weight", counting)
    monkeypatch.setattr(qsmall, "quantized_weight", counting)
    return made
