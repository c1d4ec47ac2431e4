"""Stage 4 on the CPU with oneDNN's GEMM: the ``loop`` engine's launchers with ``torch.mm`` replaced.

PyTorch's CPU ``torch.mm`` calls MKL's sgemm. On CPUs where MKL does not run its fastest kernels
(AMD's, among others) and for the thin products of an MoE layer (a few to a few hundred rows per
expert against a whole expert matrix), oneDNN's matmul, which PyTorch ships for its own CPU
compiler, was measured 1.3-2.2x faster for all three products of stage 4 (fp32, one thread, an AMD
EPYC; ``python -m bench --preset ... --providers fastmoe/torch@onednn fastmoe/torch@loop``).
It is reached through ``torch.ops.mkldnn._linear_pointwise`` (``input @ weight^T``, any strides), the
op inductor's CPU backend emits; its result is copied into the loop's pooled row and gradient
buffers, a pass over the output that the GEMM's speed pays for many times over.

Which of ``loop``, ``grouped_mm`` and this engine runs is the registry's timed choice
(``gemm_engine="auto"``, :mod:`fastmoe_xpu.kernels.registry`), per CPU model and shape, so a CPU
where MKL is faster keeps MKL. float32 only: oneDNN's bf16 GEMMs need CPU instructions not every
machine has, and the float32 results are what the engine is checked against.
"""
from __future__ import annotations

import functools

import torch

from . import grouped_gemm as _loop

#: The stage-4 launchers this engine provides; ``silu_mul_bwd`` comes from the base.
LAUNCHERS = ("gate_up_fwd", "down_fwd", "down_bwd", "down_weighted_bwd", "gate_up_bwd")


@functools.lru_cache(maxsize=1)
def _linear():  # noqa: ANN202
    """The op, looked up once (``mm_into`` runs it for every expert's products)."""
    return torch.ops.mkldnn._linear_pointwise


@functools.lru_cache(maxsize=None)
def _probe() -> str | None:
    """None when oneDNN's matmul runs here and agrees with ``torch.mm``; else why not."""
    if not torch.backends.mkldnn.is_available():
        return "this PyTorch build has no oneDNN (mkldnn)"
    if not hasattr(torch.ops.mkldnn, "_linear_pointwise"):
        return "torch.ops.mkldnn._linear_pointwise is missing from this PyTorch"
    try:
        g = torch.Generator().manual_seed(0)
        a, w = torch.randn(5, 24, generator=g), torch.randn(40, 24, generator=g)
        got = _linear()(a.t().contiguous().t(), w.t().contiguous().t(), None, "none", [], "")
        want = a @ w.t()
    except Exception as exc:  # an op that exists but does not run on this CPU
        return f"oneDNN's matmul failed here: {type(exc).__name__}: {exc}"
    if not torch.allclose(got, want, rtol=1e-4, atol=1e-4):
        return "oneDNN's matmul disagrees with torch.mm here"
    return None


def unsupported_reason(device: torch.device | str, dtype: torch.dtype) -> str | None:
    """None when this engine runs for ``dtype`` on ``device``; else why not."""
    if torch.device(device).type != "cpu":
        return "oneDNN's matmul runs on CPU tensors"
    if dtype != torch.float32:
        return f"the onednn engine takes float32, not {str(dtype).removeprefix('torch.')}"
    return _probe()


def mm_into(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor, accumulate: bool = False) -> None:
    """``out = a @ b`` (``accumulate``: ``out += a @ b``) on oneDNN: ``linear(a, b^T)``, except where
    ``torch.mm``'s kernels were measured faster on this CPU (one thread, 2048-wide experts): a rank-1
    update (an expert's weight gradient from one row: 16.9 vs 54.5 ms over 32 experts) and a one-row
    product with a weight read transposed (the input gradient ``dY @ W`` of one row: 19.7 vs 44.6 ms).
    The forward ``x @ W^T``, whose weight is in ``linear``'s own layout, runs on oneDNN at any row
    count, one row included (26.3 vs 23.1 GB/s of weights read)."""
    # (A one-row ``b`` counts as contiguous either way: the rank-1 test comes first.)
    if a.shape[1] == 1 or (a.shape[0] == 1 and not b.t().is_contiguous()):
        _loop.mm_into(a, b, out, accumulate)
        return
    result = _linear()(a, b.t(), None, "none", [], "")
    if accumulate:
        out.add_(result)
    else:
        out.copy_(result)


_ONEDNN = _loop.launchers_on(mm_into)
gate_up_fwd = _ONEDNN["gate_up_fwd"]
down_fwd = _ONEDNN["down_fwd"]
down_bwd = _ONEDNN["down_bwd"]
down_weighted_bwd = _ONEDNN["down_weighted_bwd"]
gate_up_bwd = _ONEDNN["gate_up_bwd"]
