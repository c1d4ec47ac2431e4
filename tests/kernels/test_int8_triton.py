"""The Triton int8 grouped GEMMs (``kernels/triton/int8_gemm.py``): the kernels against exact integer
products and the reference's weight-gradient maths, and ``expert_precision="int8"`` next to the Triton
base (every expert GEMM in these kernels) against the plain-PyTorch reference of the quantized maths
(``kernels/quantized/reference.py``), gradients included, at awkward shapes.

On the suite's device (``--device``, tests/device_util.py): under the interpreter on CPU tensors by
default (tests/conftest.py switches it on before triton is imported), compiled on ``--device cuda`` or
``xpu``. The inputs are made on the CPU and moved; the references are computed on the CPU."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from fastmoe_xpu import settings  # noqa: E402
from fastmoe_xpu.autograd.moe_experts import moe_experts_forward  # noqa: E402
from fastmoe_xpu.kernels import kernels  # noqa: E402
from fastmoe_xpu.kernels.quantized import core as qcore, reference as qref  # noqa: E402
from fastmoe_xpu.kernels.triton import int8_gemm, launch  # noqa: E402
from quantized_util import (  # noqa: E402, F401  (no_host_bounds: a fixture)
    LAYER_SHAPES, check_layer, down_case, layer_case, no_host_bounds, run_layer, wgrad_case,
)

# The integer sums are exact and the epilogue rounds as the reference does: only the combine's
# summation order differs (the tolerance of tests/test_precision.py).
RTOL, ATOL = 1e-5, 1e-6


def _close(got, want, what):
    scale = want.abs().max().item() if want.numel() else 1.0
    torch.testing.assert_close(got.detach().float(), want.float(), rtol=RTOL, atol=ATOL + RTOL * scale,
                               msg=lambda m: f"{what}: {m}")


@pytest.fixture
def dev(device):
    """The suite's device, where the int8 kernels have configs (cuda, hip, xpu and the interpreter)."""
    if not int8_gemm.available(device):
        pytest.skip(f"the Triton int8 kernels have no configs for {device}")
    return device


@pytest.mark.parametrize("trans_w", [True, False])
@pytest.mark.parametrize("gather", [True, False])
def test_kernel_is_exact(trans_w, gather, dev):
    """Each expert row: the int8 codes multiplied exactly, converted to fp32, times the row scale,
    then the column scale; rows of no expert (past RT) untouched. Counts 19, 0, 1, 17 (an empty
    expert, a single row, tiles of 16 partly filled), K = 37 and N = 21 not multiples of the tile."""
    g = torch.Generator().manual_seed(0)
    counts = [19, 0, 1, 17]
    cum = torch.tensor([0, *torch.tensor(counts).cumsum(0).tolist()], dtype=torch.int32)
    rt, R, N, K = sum(counts), sum(counts) + 3, 21, 37
    src_rows = 29 if gather else R
    qa = torch.randint(-127, 128, (src_rows, K), generator=g, dtype=torch.int8)
    sa = torch.rand(src_rows, generator=g)
    idx = torch.randint(0, src_rows, (R,), generator=g, dtype=torch.int32) if gather else None
    qw = torch.randint(-127, 128, (4, N, K) if trans_w else (4, K, N), generator=g, dtype=torch.int8)
    sw = torch.rand(4, N, generator=g)
    for with_sw, dtype in ((True, torch.float32), (False, torch.float32), (True, torch.bfloat16)):
        out = torch.full((R, N), 7.0, dtype=dtype, device=dev)
        on = [t.to(dev) if t is not None else None for t in (qa, sa, idx, qw, sw if with_sw else None, cum)]
        int8_gemm.int8_grouped_mm(*on[:6], out, trans_w)
        out = out.cpu()
        for e in range(4):
            s, t = int(cum[e]), int(cum[e + 1])
            src = idx[s:t].long() if gather else torch.arange(s, t)
            b = qw[e].t() if trans_w else qw[e]
            want = (qa[src].double() @ b.double()).float() * sa[src, None]
            if with_sw:
                want = want * sw[e][None, :]
            if dtype == torch.float32:
                assert torch.equal(out[s:t], want), (e, with_sw)
            else:  # one bf16 step: the interpreter truncates float -> bf16 casts, GPUs round to nearest
                torch.testing.assert_close(out[s:t].float(), want, rtol=2 ** -7, atol=0)
        assert out[rt:].eq(7.0).all()


@pytest.mark.parametrize("counts", [[19, 0, 1, 17, 33], [1], [0, 0, 2]], ids=["awkward", "T1", "leading-empty"])
@pytest.mark.parametrize("transposed", [False, True])
def test_wgrad_kernel_equals_reference(counts, transposed, launched, dev):
    """The grouped int8 weight gradient, bit for bit the reference's ``[g]_col^T [x]_col`` per expert
    (columns quantized over the expert's rows, codes multiplied exactly, fp32 scaled by the gradient's
    scales, then the input's), in the stored ``[O, In]`` and the transposed ``[In, O]`` layout; zero for
    empty experts; rows past RT (NaN, inf, out-of-range indices) never read. M = 21, N = 37: partial
    tiles; an expert of 33 rows: three row chunks of the interpreter's 16."""
    M, N = 21, 37
    cum, grad, x, idx = wgrad_case(counts, M, N, seed=len(counts))
    nr = len(counts)
    qg, sg = qcore.quantize_cols_grouped(grad.to(dev), torch.int8, cum.to(dev))
    qx, sx = qcore.quantize_cols_grouped(x.to(dev), torch.int8, cum.to(dev), idx=idx.to(dev))
    assert sg.shape == (nr, M) and qx.shape == (len(idx), N)
    out = torch.full((nr, N, M) if transposed else (nr, M, N), 7.0, device=dev)
    if transposed:
        int8_gemm.int8_grouped_wgrad(qx, sx, qg, sg, cum.to(dev), out, left_scale_first=False)
    else:
        int8_gemm.int8_grouped_wgrad(qg, sg, qx, sx, cum.to(dev), out, left_scale_first=True)
    assert launched == ["_int8_grouped_wgrad_kernel"]
    qg, sg, qx, sx, out = (t.cpu() for t in (qg, sg, qx, sx, out))
    for e in range(nr):
        s, t = int(cum[e]), int(cum[e + 1])
        got = out[e].t() if transposed else out[e]
        if s == t:
            assert torch.count_nonzero(got) == 0 and sg[e].eq(0).all(), e
            continue
        rows = x[idx[s:t].long()]
        # the per-expert codes and scales, from the reference and from the per-expert quantizer
        rq, rs = qref.cols_q(grad[s:t], torch.int8)
        assert torch.equal(qg[s:t].double(), rq) and torch.equal(sg[e], rs), e
        assert torch.equal(qx[s:t], qcore.quantize_cols(rows, torch.int8)[0]), e
        want = qref.qlinear_backward(grad[s:t], rows, torch.zeros(M, N), "int8")[1]
        assert torch.equal(got, want), e


def test_wgrad_kernel_rejects_mismatched_shapes():
    q = torch.zeros(4, 3, dtype=torch.int8)
    s = torch.zeros(1, 3)
    with pytest.raises(ValueError, match="int8_grouped_wgrad"):
        int8_gemm.int8_grouped_wgrad(q, s, q, s, torch.tensor([0, 4], dtype=torch.int32), torch.empty(1, 3, 4))


@LAYER_SHAPES
def test_triton_int8_layer_matches_reference(shape, launched, no_host_bounds, dev):
    out, leaves, want, idx = run_layer(shape, dev, "int8")
    check_layer(lambda got, ref, what: _close(got.cpu(), ref, what), out, leaves, want)
    # gate_up forward, down forward, down input gradient, gate_up input gradient
    assert launched.count("_int8_grouped_mm_kernel") == 4, launched
    assert launched.count("_int8_grouped_wgrad_kernel") == 2, launched  # down and gate_up weight gradients
    assert "_grouped_mm_fwd_kernel" not in launched and "_gate_up_fwd_kernel" not in launched
    if shape[0] == 5:
        assert int(idx.max()) <= shape[4], "the routing did not leave experts empty"
        assert torch.count_nonzero(leaves[2].grad[shape[4] + 1:]) == 0


@pytest.mark.parametrize("transposed", [False, True])
def test_triton_int8_down_launchers_both_layouts(transposed, launched, no_host_bounds, dev):
    """``down_fwd`` / ``down_bwd`` of ``triton+int8`` against the torch-base launchers, bit for bit
    (the same quantized maths, per expert there, grouped here), stored and transposed layouts; the
    weight gradients bit for bit against the reference as well."""
    counts, cum, a, w, stored, dy = down_case(transposed)
    tri, ref = kernels("triton+int8"), kernels("torch+int8")
    rt = sum(counts)
    on = [t.to(dev) for t in (a, cum, stored, dy)]
    y = tri.down_fwd(on[0], on[1], on[2], transposed=transposed).cpu()
    da, dw = (t.cpu() for t in tri.down_bwd(on[3], on[0], on[1], on[2], transposed=transposed))
    assert launched.count("_int8_grouped_mm_kernel") == 2, launched
    assert launched.count("_int8_grouped_wgrad_kernel") == 1, launched
    no_host_bounds()
    with settings.override(int8_weight_grads="int8"):  # the torch base with the kernels' int8 weight gradients
        assert torch.equal(y[:rt], ref.down_fwd(a, cum, stored, transposed=transposed)[:rt])
        want_da, want_dw = ref.down_bwd(dy, a, cum, stored, transposed=transposed)
    assert torch.equal(da[:rt], want_da[:rt]) and torch.equal(dw, want_dw)
    for e in range(4):  # and both against the reference per expert
        s, t = int(cum[e]), int(cum[e + 1])
        if s < t:
            _close(y[s:t], qref.qlinear(a[s:t], w[e], "int8"), f"expert {e} forward")
            ref_da, ref_dw = qref.qlinear_backward(dy[s:t], a[s:t], w[e], "int8")
            _close(da[s:t], ref_da, f"expert {e} input gradient")
            assert torch.equal(dw[e].t() if transposed else dw[e], ref_dw), f"expert {e} weight gradient"
        else:
            assert torch.count_nonzero(dw[e]) == 0


def test_triton_int8_bf16_equals_torch_base(dev):
    """bf16 activations: the Triton base's int8 layer (on the suite's device) agrees with the torch
    base's int8 layer (on the CPU)."""
    x, weights, idx, w_gu, w_d, dout = layer_case(23, 24, 14, 5, 2, seed=2)
    res = {}
    for backend, where in (("torch", torch.device("cpu")), ("triton", dev)):
        leaves = [t.to(where, torch.bfloat16).requires_grad_(True) for t in (x, weights, w_gu, w_d)]
        with settings.override(int8_weight_grads="int8"):  # the kernels' int8 weight gradients on the torch base
            out = moe_experts_forward(leaves[0], leaves[1], idx.to(where), leaves[2], leaves[3], backend=backend,
                                      expert_precision="int8")
            out.backward(dout.to(where, torch.bfloat16))
        res[backend] = [out.detach().cpu(), *(t.grad.cpu() for t in leaves)]
    for name, a, b in zip(("out", "dx", "dweights", "dw_gate_up", "dw_down"), res["triton"], res["torch"]):
        rel = ((a.float() - b.float()).norm() / b.float().norm()).item()
        # The interpreter truncates float -> bf16 casts (GPUs round to nearest), so the bf16 rows
        # the kernels store differ by up to a bf16 step and may requantize to neighbouring codes:
        # the bound is the int8 noise of tests/test_precision.py, not bit equality.
        assert rel < 0.03, (name, rel)
