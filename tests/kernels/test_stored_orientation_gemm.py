"""``down_fwd`` / ``down_bwd`` with ``transposed=True``: the weight read as stored ``[NR, In, Out]``.

Every engine (the torch loop, PyTorch's grouped_mm, the Triton kernels under the interpreter on the
CPU) against a per-expert reference and against the untransposed launchers on a transposed copy,
the weight gradient in the stored layout, empty experts and odd widths included.
"""
from __future__ import annotations

import pytest
import torch

from fastmoe_xpu.kernels import registry
from fastmoe_xpu.kernels.contract import INDEX_DTYPE

pytestmark = [pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning"),
              pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")]


def _engine(name: str):
    reason = registry.unavailable_reason(name, "torch", torch.device("cpu"), torch.float32)
    if reason is not None:
        pytest.skip(reason)
    return registry.module_of(name)


def _problem(counts: list[int], d_in: int, d_out: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    rows = sum(counts)
    a = torch.randn(rows, d_in, generator=g)
    w = torch.randn(len(counts), d_in, d_out, generator=g)  # stored [NR, In, Out]
    dy = torch.randn(rows, d_out, generator=g)
    cum = torch.tensor([0, *torch.tensor(counts).cumsum(0).tolist()], dtype=INDEX_DTYPE)
    return a, w, dy, cum


def _reference(a, w, dy, cum):
    b = cum.tolist()
    y = torch.cat([a[b[e]:b[e + 1]] @ w[e] for e in range(w.shape[0])])
    da = torch.cat([dy[b[e]:b[e + 1]] @ w[e].t() for e in range(w.shape[0])])
    dw = torch.stack([a[b[e]:b[e + 1]].t() @ dy[b[e]:b[e + 1]] for e in range(w.shape[0])])
    return y, da, dw


# (per-expert row counts, In, Out): odd widths, an empty expert, one expert holding every row.
SHAPES = [
    pytest.param([5, 0, 7, 3, 2], 21, 33, id="odd-widths-empty-expert"),
    pytest.param([0, 0, 9], 16, 8, id="one-expert"),
    pytest.param([4, 6], 32, 48, id="aligned"),
]


@pytest.mark.parametrize("engine", ["loop", "grouped_mm", "onednn", "triton"])
@pytest.mark.parametrize("counts,d_in,d_out", SHAPES)
def test_transposed_launchers_match_the_reference(engine: str, counts: list[int], d_in: int, d_out: int) -> None:
    mod = _engine(engine)
    a, w, dy, cum = _problem(counts, d_in, d_out)
    want_y, want_da, want_dw = _reference(a, w, dy, cum)
    rt = sum(counts)
    y = mod.down_fwd(a, cum, w, transposed=True)
    torch.testing.assert_close(y[:rt], want_y, atol=1e-5, rtol=1e-5)
    da, dw = mod.down_bwd(dy, a, cum, w, transposed=True)
    torch.testing.assert_close(da[:rt], want_da, atol=1e-5, rtol=1e-5)
    assert dw.shape == w.shape, "the weight gradient must come in the stored layout"
    torch.testing.assert_close(dw, want_dw, atol=1e-5, rtol=1e-5)
    # The same numbers as the untransposed launchers on a transposed copy (the path this replaces).
    w_copy = w.transpose(1, 2).contiguous()
    torch.testing.assert_close(y[:rt], mod.down_fwd(a, cum, w_copy)[:rt], atol=1e-5, rtol=1e-5)
    da_c, dw_c = mod.down_bwd(dy, a, cum, w_copy)
    torch.testing.assert_close(da[:rt], da_c[:rt], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(dw, dw_c.transpose(1, 2), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("engine", ["loop", "grouped_mm", "onednn", "triton"])
def test_transposed_width_mismatch_raises(engine: str) -> None:
    mod = _engine(engine)
    a, w, _, cum = _problem([3, 2], 16, 24)
    with pytest.raises(ValueError, match="does not match weight shape"):
        mod.down_fwd(a, cum, w)  # without the flag w [NR, 16, 24] reads as [NR, out 16, in 24]: a is 16 wide
    with pytest.raises(ValueError, match="does not match weight shape"):
        mod.down_fwd(a[:, :8].contiguous(), cum, w, transposed=True)


def test_transposed_flag_must_be_a_bool() -> None:
    mod = _engine("loop")
    a, w, _, cum = _problem([3, 2], 16, 24)
    with pytest.raises(TypeError, match="transposed must be a bool"):
        mod.down_fwd(a, cum, w, transposed="yes")
