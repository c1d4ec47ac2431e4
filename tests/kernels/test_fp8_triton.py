"""The Triton fp8 grouped GEMMs (``kernels/triton/fp8_gemm.py``): the kernels against exact products
of the same codes, the weight-gradient operands' layout, and ``expert_precision="fp8"`` next to the
Triton base (every expert GEMM in these kernels, no host read of the expert bounds) against the
plain-PyTorch reference of the quantized maths (``kernels/quantized/reference.py``), gradients
included, at awkward shapes.

Device-aware: on the CPU (the default) the kernels run under Triton's interpreter, which decodes
fp8 operands exactly (to fp16) and accumulates their products in fp32, as the GPU kernels do;
``--device cuda`` runs them compiled on a GPU with fp8 tensor cores (sm_89+). The bounds differ:
the interpreter's fp32 sums are held to ``K * 2**-24`` of the sum of the products' magnitudes, a
GPU's to ``2**-8`` of it (Hopper's fp8 ``wgmma`` adds with fewer bits inside each k-step before the
kernels promote the partial sums to fp32).
"""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from fastmoe_xpu.autograd.moe_experts import moe_experts_forward  # noqa: E402
from fastmoe_xpu.kernels import kernels, registry  # noqa: E402
from fastmoe_xpu.kernels.quantized import core as qcore, reference as qref  # noqa: E402
from fastmoe_xpu.kernels.triton import fp8_gemm, launch  # noqa: E402
from quantized_util import (  # noqa: E402, F401  (no_host_bounds: a fixture)
    LAYER_SHAPES, bf16_layer, check_layer, close_to_scale, down_case, fp8_layer_tol, layer_case, no_host_bounds,
    run_layer, wgrad_case, within_of,
)

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
FP8_KERNELS = {"_fp8_grouped_mm_kernel", "_fp8_grouped_wgrad_kernel"}


@pytest.fixture
def dev(device):
    if not fp8_gemm.available(device):
        pytest.skip(f"the Triton fp8 kernels do not run on {device} (fp8 tensor cores: sm_89 or newer)")
    return device


def _acc_bound(device: torch.device, k: int) -> float:
    """Relative bound of the kernels' fp32 sums, as a fraction of the sum of |products|."""
    return k * 2.0 ** -24 if device.type == "cpu" else 2.0 ** -8


def _codes(shape, dtype, g, spread=40.0):
    """Random fp8 codes over much of the format's range (both signs, some zeros)."""
    return (torch.randn(shape, generator=g) * spread).to(dtype)


@pytest.mark.parametrize("a_dtype", [E4M3, E5M2], ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("trans_w", [True, False])
@pytest.mark.parametrize("gather", [True, False])
def test_kernel_matches_exact_products(dev, trans_w, gather, a_dtype):
    """Each expert row: the fp8 codes' products summed in fp32, times the row scale, then the column
    scale; rows of no expert (past RT) untouched. Counts 19, 0, 1, 17 (an empty expert, a single row,
    tiles of 16 partly filled), K = 37 and N = 21 not multiples of the tile; e4m3 and e5m2 (the input
    gradient's) activation codes against e4m3 weight codes."""
    g = torch.Generator().manual_seed(0)
    counts = [19, 0, 1, 17]
    cum = torch.tensor([0, *torch.tensor(counts).cumsum(0).tolist()], dtype=torch.int32)
    rt, R, N, K = sum(counts), sum(counts) + 3, 21, 37
    src_rows = 29 if gather else R
    qa = _codes((src_rows, K), a_dtype, g)
    sa = torch.rand(src_rows, generator=g)
    idx = torch.randint(0, src_rows, (R,), generator=g, dtype=torch.int32) if gather else None
    qw = _codes((4, N, K) if trans_w else (4, K, N), E4M3, g)
    sw = torch.rand(4, N, generator=g)
    d = lambda t: None if t is None else t.to(dev)  # noqa: E731
    bound = _acc_bound(dev, K)
    for with_sw, dtype in ((True, torch.float32), (False, torch.float32), (True, torch.bfloat16)):
        out = torch.full((R, N), 7.0, dtype=dtype, device=dev)
        fp8_gemm.fp8_grouped_mm(d(qa), d(sa), d(idx), d(qw), d(sw) if with_sw else None, d(cum), out, trans_w)
        out = out.cpu()
        for e in range(4):
            s, t = int(cum[e]), int(cum[e + 1])
            src = idx[s:t].long() if gather else torch.arange(s, t)
            b = (qw[e].t() if trans_w else qw[e]).double()
            a = qa[src].double()
            scale = sa[src, None].double() * (sw[e][None, :].double() if with_sw else 1.0)
            want = ((a @ b).float() * sa[src, None])
            if with_sw:
                want = want * sw[e][None, :]
            err = (out[s:t].double() - want.double()).abs()
            allowed = bound * (a.abs() @ b.abs()) * scale + 4 * 2.0 ** -24 * want.double().abs()
            if dtype == torch.bfloat16:  # one bf16 step (the interpreter truncates, GPUs round to nearest)
                allowed = allowed + 2.0 ** -7 * want.double().abs()
            assert (err <= allowed).all(), (e, with_sw, dtype, (err - allowed).max().item())
        assert out[rt:].eq(7.0).all()


def test_padded_column_codes():
    """:func:`core.quantize_cols_grouped_t`: expert e's codes at columns ``padded_cum[e] ..``, zeros to
    the next 16-aligned bound and past the last, the same codes and scales as quantizing each
    expert's rows alone (and as the row-major :func:`core.quantize_cols_grouped`); the rows past RT
    (NaN, inf, out-of-range indices) never read."""
    counts = [19, 0, 1, 16, 33]
    cum, grad, x, idx = wgrad_case(counts, 21, 37, seed=1)
    pcum = qcore.padded_bounds(cum)
    assert pcum.tolist() == [0, 32, 32, 48, 64, 112]
    R = len(idx)
    length = qcore.padded_length(R, len(counts))
    assert length % qcore.ROW_ALIGN == 0 and length >= int(pcum[-1])
    for v, dtype, vidx in ((grad, E5M2, None), (x, E4M3, idx)):
        codes, scales = qcore.quantize_cols_grouped_t(v, dtype, cum, pcum, length, idx=vidx)
        assert codes.shape == (v.shape[1], length) and codes.dtype == dtype and codes.is_contiguous()
        rm_codes, rm_scales = qcore.quantize_cols_grouped(v, dtype, cum, idx=vidx, rows=R)
        assert torch.equal(scales, rm_scales)
        filled = torch.zeros(length, dtype=torch.bool)
        for e in range(len(counts)):
            s, t, p = int(cum[e]), int(cum[e + 1]), int(pcum[e])
            if s == t:
                assert scales[e].eq(0).all(), e
                continue
            rows = v[vidx[s:t].long()] if vidx is not None else v[s:t]
            q, sc = qcore.quantize_cols(rows, dtype)
            assert torch.equal(codes[:, p:p + t - s].t().float(), q.float()), e
            assert torch.equal(rm_codes[s:t].float(), q.float()), e
            assert torch.equal(scales[e], sc), e
            filled[p:p + t - s] = True
        assert codes[:, ~filled].float().eq(0).all()


@pytest.mark.parametrize("counts", [[19, 0, 1, 17, 33], [1], [0, 0, 2]], ids=["awkward", "T1", "leading-empty"])
@pytest.mark.parametrize("transposed", [False, True])
def test_wgrad_kernel_matches_reference(dev, counts, transposed, launched):
    """The grouped fp8 weight gradient against the reference's ``[g]_col^T [x]_col`` per expert
    (e5m2 gradient codes, e4m3 input codes, columns quantized over the expert's rows, fp32 scaled by
    the gradient's scales, then the input's), in the stored ``[O, In]`` and the transposed
    ``[In, O]`` layout; zero for empty experts. M = 21, N = 37: partial tiles; an expert of 33 rows:
    three row chunks of the interpreter's 16."""
    M, N = 21, 37
    cum, grad, x, idx = wgrad_case(counts, M, N, seed=len(counts))
    nr = len(counts)
    pcum = qcore.padded_bounds(cum.to(dev))
    length = qcore.padded_length(len(idx), nr)
    qg, sg = qcore.quantize_cols_grouped_t(grad.to(dev), E5M2, cum.to(dev), pcum, length)
    qx, sx = qcore.quantize_cols_grouped_t(x.to(dev), E4M3, cum.to(dev), pcum, length, idx=idx.to(dev))
    out = torch.full((nr, N, M) if transposed else (nr, M, N), 7.0, device=dev)
    if transposed:
        fp8_gemm.fp8_grouped_wgrad(qx, sx, qg, sg, pcum, out, left_scale_first=False)
    else:
        fp8_gemm.fp8_grouped_wgrad(qg, sg, qx, sx, pcum, out, left_scale_first=True)
    assert launched == ["_fp8_grouped_wgrad_kernel"]
    out = out.cpu()
    for e in range(nr):
        s, t = int(cum[e]), int(cum[e + 1])
        got = out[e].t() if transposed else out[e]
        if s == t:
            assert torch.count_nonzero(got) == 0, e
            continue
        rows = x[idx[s:t].long()]
        want = qref.qlinear_backward(grad[s:t], rows, torch.zeros(M, N), "fp8")[1]
        qd, sd = qref.cols_q(grad[s:t], E5M2)
        qa, sa = qref.cols_q(rows, E4M3)
        allowed = _acc_bound(dev, t - s) * (qd.abs().t() @ qa.abs()) * sd[:, None] * sa[None, :]
        err = (got.double() - want.double()).abs()
        assert (err <= allowed + 4 * 2.0 ** -24 * want.double().abs()).all(), e


def test_kernels_reject_bad_operands():
    q = torch.zeros(4, 16, dtype=E4M3)
    s = torch.zeros(1, 16)
    cum = torch.tensor([0, 4], dtype=torch.int32)
    with pytest.raises(ValueError, match="fp8_grouped_mm: codes must be float8"):
        fp8_gemm.fp8_grouped_mm(q.to(torch.int8), torch.ones(4), None, q[None], None, cum, torch.empty(4, 4), True)
    with pytest.raises(ValueError, match="fp8_grouped_mm: codes"):
        fp8_gemm.fp8_grouped_mm(q, torch.ones(4), None, q[None], None, cum, torch.empty(4, 5), True)
    with pytest.raises(ValueError, match="fp8_grouped_wgrad"):  # the codes' row length not a multiple of 16
        fp8_gemm.fp8_grouped_wgrad(q[:, :12], s[:, :4], q[:, :12], s[:, :4], cum, torch.empty(1, 4, 4))
    with pytest.raises(ValueError, match="fp8_grouped_wgrad"):
        fp8_gemm.fp8_grouped_wgrad(q, s[:, :4], q[:3], s[:, :3], cum, torch.empty(1, 4, 4))


@LAYER_SHAPES
def test_triton_fp8_layer_matches_reference(dev, shape, launched, no_host_bounds):
    """``expert_precision="fp8"`` on the Triton base: output and every gradient against the reference,
    all six expert GEMMs in the fp8 kernels (none in the bf16 ones), no host read of the bounds."""
    out, leaves, want, idx = run_layer(shape, dev, "fp8")
    tol = fp8_layer_tol(dev)
    check_layer(lambda got, ref, what: close_to_scale(got, ref, what, tol), out, leaves, want)
    # gate_up forward, down forward, down input gradient, gate_up input gradient
    assert launched.count("_fp8_grouped_mm_kernel") == 4, launched
    assert launched.count("_fp8_grouped_wgrad_kernel") == 2, launched  # down and gate_up weight gradients
    assert not {n for n in launched if "grouped_mm" in n or "gate_up" in n} - FP8_KERNELS, launched
    if shape[0] == 5:
        assert int(idx.max()) <= shape[4], "the routing did not leave experts empty"
        assert torch.count_nonzero(leaves[2].grad[shape[4] + 1:]) == 0


@pytest.mark.parametrize("transposed", [False, True])
def test_triton_fp8_down_launchers_both_layouts(dev, transposed, launched, no_host_bounds):
    """``down_fwd`` / ``down_bwd`` of ``triton+fp8`` in the stored and transposed layouts against the
    reference per expert and, where it runs, against the torch base's per-expert ``torch._scaled_mm``
    path (the same codes and scales; fp32 sums in another order)."""
    counts, cum, a, w, stored, dy = down_case(transposed)
    tri = kernels("triton+fp8")
    rt = sum(counts)
    y = tri.down_fwd(a.to(dev), cum.to(dev), stored.to(dev), transposed=transposed).cpu()
    da, dw = (t.cpu() for t in tri.down_bwd(dy.to(dev), a.to(dev), cum.to(dev), stored.to(dev), transposed=transposed))
    assert launched.count("_fp8_grouped_mm_kernel") == 2, launched
    assert launched.count("_fp8_grouped_wgrad_kernel") == 1, launched
    no_host_bounds()
    tol = fp8_layer_tol(dev)
    if dev.type == "cpu" and registry.unavailable_reason("fp8", "torch", dev, torch.float32) is None:
        ref = kernels("torch+fp8")  # torch._scaled_mm with row-wise scales (on the CPU from torch 2.13)
        close_to_scale(y[:rt], ref.down_fwd(a, cum, stored, transposed=transposed)[:rt], "against torch+fp8 forward", tol)
        want_da, want_dw = ref.down_bwd(dy, a, cum, stored, transposed=transposed)
        close_to_scale(da[:rt], want_da[:rt], "against torch+fp8 input gradient", tol)
        close_to_scale(dw, want_dw, "against torch+fp8 weight gradient", tol)
    for e in range(4):
        s, t = int(cum[e]), int(cum[e + 1])
        if s < t:
            close_to_scale(y[s:t], qref.qlinear(a[s:t], w[e], "fp8"), f"expert {e} forward", tol)
            ref_da, ref_dw = qref.qlinear_backward(dy[s:t], a[s:t], w[e], "fp8")
            close_to_scale(da[s:t], ref_da, f"expert {e} input gradient", tol)
            close_to_scale(dw[e].t() if transposed else dw[e], ref_dw, f"expert {e} weight gradient", tol)
        else:
            assert torch.count_nonzero(dw[e]) == 0


def test_triton_fp8_bf16_close_to_reference(dev):
    """bf16 activations and weights: the Triton base's fp8 layer agrees with the reference (on the
    same bf16 values in fp32) up to fp8 noise, output and every gradient."""
    got, (x, weights, idx, w_gu, w_d, dout) = bf16_layer(dev, "fp8", (23, 24, 14, 5, 2), seed=2)
    want = qref.moe_forward_backward(x.float(), weights.float(), idx, w_gu.float(), w_d.float(), dout.float(), "fp8")
    # the kernels store bf16 rows (gate_up, h, the gradients), which the reference keeps in fp32,
    # so requantized values may move to neighbouring fp8 codes: the bound is a fraction of fp8's
    # own noise (tests/test_precision.py: 0.15 against full precision)
    within_of(got, want, 0.05)


# ---------------------------------------------------------------- the quantization and row passes
def _same_codes(got, want, what):
    assert got.dtype == want.dtype and got.shape == want.shape, what
    assert torch.equal(got.cpu().view(torch.uint8), want.view(torch.uint8)), what


def _rows_case(seed, rows=37, width=45, dtype=torch.float32):
    """Rows of very different sizes, a zero row, values on rounding ties and in the subnormal range."""
    g = torch.Generator().manual_seed(seed)
    v = torch.randn(rows, width, generator=g) * torch.rand(rows, 1, generator=g) * 100
    v[3] = 0
    v[5, 7] = 31.73  # rounds up into the next binade of e4m3 (32)
    v[6, :5] = torch.tensor([1.0, 1e-5, -2e-6, 3e-4, -1e-3]) * v[6].abs().max()
    return v.to(dtype)


@pytest.mark.parametrize("dtype", [E4M3, E5M2], ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("src_dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_quantize_rows_kernel_same_codes(dev, dtype, src_dtype, launched):
    """``fp8_gemm.quantize_rows`` (one kernel) gives the codes and scales of ``core.quantize_rows``,
    bit for bit: plain rows, rows times their expert's column scales (the input gradients': the
    expert found on the device, an empty expert, rows past RT taking the last expert's; ``BLOCK_E``
    smaller than the experts), and with ``routed_only`` the RT rows (the others never written)."""
    v = _rows_case(1, dtype=src_dtype)
    q, s = fp8_gemm.quantize_rows(v.to(dev), dtype)
    want_q, want_s = qcore.quantize_rows(v, dtype)
    _same_codes(q, want_q, "rows")
    assert torch.equal(s.cpu(), want_s)
    g = torch.Generator().manual_seed(2)
    cum = torch.tensor([0, 10, 10, 30, 31, 31, 34], dtype=torch.int32)  # 6 experts, RT = 34 < 37 rows
    cs = torch.rand(6, v.shape[1], generator=g) * 4
    q, s = fp8_gemm.quantize_rows(v.to(dev), dtype, cs.to(dev), cum.to(dev))
    eid = qcore.expert_of_rows(cum, v.shape[0]).clamp_(max=5)
    want_q, want_s = qcore.quantize_rows(v, dtype, cs.index_select(0, eid))
    _same_codes(q, want_q, "rows times column scales")
    assert torch.equal(s.cpu(), want_s)
    q, s = fp8_gemm.quantize_rows(v.to(dev), dtype, cs.to(dev), cum.to(dev), routed_only=True)
    _same_codes(q[:34], want_q[:34], "routed rows")
    assert torch.equal(s[:34].cpu(), want_s[:34])
    assert launched == ["_fp8q_rows_kernel"] * 3


def test_fp8_rounding_ties_and_subnormals(dev):
    """The kernels' fp32 -> fp8 rounding is round-to-nearest-even like ``Tensor.to``: every midpoint
    between neighbouring codes (ties go to the even code), values just above and below them, the
    subnormal range and the largest code, for both formats (a row whose amax is the largest code, so
    the scale is exactly 1 and the codes are the values rounded)."""
    for dtype, qmax in ((E4M3, 448.0), (E5M2, 57344.0)):
        grid = torch.arange(256, dtype=torch.uint8).view(dtype).float()
        grid = grid[grid.isfinite() & (grid >= 0)].unique()
        mid = (grid[:-1] + grid[1:]) / 2
        vals = torch.cat([grid, mid, mid * (1 + 2.0 ** -20), mid * (1 - 2.0 ** -20), -mid])
        vals = vals[vals.abs() <= qmax]
        v = torch.cat([vals, torch.tensor([qmax])])[None, :]
        q, s = fp8_gemm.quantize_rows(v.to(dev), dtype)
        assert s.item() == 1.0
        _same_codes(q, v.to(dtype), str(dtype))


@pytest.mark.parametrize("transposed", [False, True])
def test_quantize_weight_kernel_same_codes(dev, transposed):
    """The weights' per-output-channel codes in both stored layouts, as :func:`core.quantized_weight`
    computes them (bf16 weights, a zero channel, odd sizes)."""
    g = torch.Generator().manual_seed(4)
    w = (torch.randn(3, 13, 11, generator=g) * 3).bfloat16()
    w[1, :, 2] = 0
    w[2, 4] = 0
    q, s = fp8_gemm.quantize_weight(w.to(dev), E4M3, transposed)
    want_q, want_s = (qcore.quantize_cols if transposed else qcore.quantize_rows)(w, E4M3)
    _same_codes(q, want_q, "weight codes")
    assert torch.equal(s.cpu(), want_s)


@pytest.mark.parametrize("counts", [[19, 0, 1, 16, 33], [1], [0, 0, 2]], ids=["awkward", "T1", "leading-empty"])
@pytest.mark.parametrize("dtype", [E4M3, E5M2], ids=["e4m3", "e5m2"])
def test_quantize_cols_grouped_kernel_same_codes(dev, counts, dtype):
    """The weight gradients' column codes (``fp8_gemm.quantize_cols_grouped_t``, one kernel) against
    ``core.quantize_cols_grouped_t`` bit for bit, plain and gathered rows, the rows past RT (NaN,
    inf, indices out of range) never read, the pads and the tail zero."""
    cum, grad, x, idx = wgrad_case(counts, 21, 37, seed=5)
    pcum = qcore.padded_bounds(cum)
    length = qcore.padded_length(len(idx), len(counts))
    for v, vidx in ((grad, None), (x, idx)):
        pcum_out = torch.full((len(counts) + 1,), -1, dtype=torch.int32, device=dev)
        q, s = fp8_gemm.quantize_cols_grouped_t(v.to(dev), dtype, cum.to(dev), length,
                                                idx=None if vidx is None else vidx.to(dev), padded_cum_out=pcum_out)
        want_q, want_s = qcore.quantize_cols_grouped_t(v, dtype, cum, pcum, length, idx=vidx)
        _same_codes(q, want_q, "gathered" if vidx is not None else "rows")
        assert torch.equal(s.cpu(), want_s)
        assert torch.equal(pcum_out.cpu(), pcum)  # the blocks' bounds, summed on the device


def test_quantize_cols_grouped_silu_rows(dev):
    """The down weight gradient's input operand made from ``gate_up``: ``w[r] * silu(gate_r) * up_r``
    in fp32 per column over each expert's rows. The kernel's exp is not torch's to the last bit, so
    against ``core.quantize_cols_grouped_t`` of the torch-computed rows: scales to fp32 rounding and
    codes equal but for the rare value within an ulp of a rounding boundary (one code step there)."""
    counts = [19, 0, 1, 16, 33]
    g = torch.Generator().manual_seed(6)
    cum = torch.tensor([0, *torch.tensor(counts).cumsum(0).tolist()], dtype=torch.int32)
    R, inter = sum(counts) + 3, 29
    gate_up = torch.randn(R, 2 * inter, generator=g) * 3
    gate_up[sum(counts):] = float("nan")  # past RT: never read
    rw = torch.rand(R, generator=g)
    pcum = qcore.padded_bounds(cum)
    length = qcore.padded_length(R, len(counts))
    q, s = fp8_gemm.quantize_cols_grouped_t(gate_up.to(dev), E4M3, cum.to(dev), length, row_weights=rw.to(dev),
                                            silu=True)
    a = torch.nn.functional.silu(gate_up[:, :inter]) * gate_up[:, inter:] * rw[:, None]
    want_q, want_s = qcore.quantize_cols_grouped_t(a, E4M3, cum, pcum, length)
    torch.testing.assert_close(s.cpu(), want_s, rtol=4 * 2.0 ** -24, atol=0)
    got, want = q.cpu().float(), want_q.float()
    differ = got != want
    assert differ.sum() <= max(1, got.numel() // 1000), int(differ.sum())
    # one code step at most: within 2^-3 of the value (e4m3's 3 mantissa bits) or the subnormal step
    assert ((got - want).abs() <= want.abs() / 8 + 2.0 ** -9)[differ].all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_silu_mul_and_row_dot_kernels(dev, dtype):
    """``silu_mul`` (the forward's h) and ``row_dot_scale`` (after the down input gradient: the router
    weights' gradient ``<g, h>`` and ``dh = w * g``) against torch on the routed rows; the rows past
    RT are left untouched."""
    g = torch.Generator().manual_seed(7)
    cum = torch.tensor([0, 5, 5, 14], dtype=torch.int32)
    R, inter = 17, 21
    gate_up = (torch.randn(R, 2 * inter, generator=g) * 3).to(dtype)
    h = torch.full((R, inter), 7.0, dtype=dtype)
    got = fp8_gemm.silu_mul(gate_up.to(dev), cum.to(dev), h.to(dev)).cpu()
    want = (torch.nn.functional.silu(gate_up[:, :inter].float()) * gate_up[:, inter:].float()).to(dtype)
    tol = dict(rtol=4e-6, atol=1e-6) if dtype == torch.float32 else dict(rtol=2 ** -7, atol=1e-5)
    torch.testing.assert_close(got[:14], want[:14], **tol)
    assert got[14:].eq(7.0).all()
    grad = torch.randn(R, inter, generator=g)
    rw = torch.rand(R, generator=g)
    dh = torch.full((R, inter), 7.0, dtype=dtype, device=dev)
    d_row = torch.full((R,), 7.0, device=dev)
    fp8_gemm.row_dot_scale(grad.to(dev), gate_up.to(dev), rw.to(dev), cum.to(dev), dh, d_row)
    hf = torch.nn.functional.silu(gate_up[:, :inter].float()) * gate_up[:, inter:].float()
    torch.testing.assert_close(d_row.cpu()[:14], (grad * hf).sum(1)[:14], rtol=1e-5, atol=1e-5)
    assert torch.equal(dh.cpu()[:14], (grad * rw[:, None]).to(dtype)[:14])
    assert dh.cpu()[14:].eq(7.0).all() and d_row.cpu()[14:].eq(7.0).all()


def test_triton_fp8_local_experts_matches_reference(dev, launched, no_host_bounds):
    """Many experts, a local slice of them (rows past RT in every row buffer, left uninitialised by
    the fp8 path), some empty: output and every gradient against the reference, every operand
    quantized by the one-pass kernels (no eager quantization: ``core``'s quantizers made to fail),
    the weights quantized once per forward and found again by the backward."""
    x, weights, idx, w_gu, w_d, dout = layer_case(29, 24, 20, 16, 4, seed=8)
    start, nl = 3, 9
    w_gu, w_d = w_gu[start:start + nl].contiguous(), w_d[start:start + nl].contiguous()
    leaves = [t.clone().to(dev).requires_grad_(True) for t in (x, weights, w_gu, w_d)]
    real = qcore._quantize_eager, qcore.quantize_cols_grouped_t

    def refuse(*args, **kwargs):
        raise AssertionError("an eager quantization on the Triton fp8 path")

    qcore._quantize_eager = qcore.quantize_cols_grouped_t = refuse
    try:
        out = moe_experts_forward(leaves[0], leaves[1], idx.to(dev), leaves[2], leaves[3], backend="triton",
                                  expert_start=start, num_local=nl, expert_precision="fp8")
        out.backward(dout.to(dev))
    finally:
        qcore._quantize_eager, qcore.quantize_cols_grouped_t = real
    want = qref.moe_forward_backward(x, weights, idx, w_gu, w_d, dout, "fp8", expert_start=start)
    tol = fp8_layer_tol(dev)
    check_layer(lambda got, ref, what: close_to_scale(got, ref, what, tol), out, leaves, want)
    # two weights quantized in the forward, none again in the backward
    assert launched.count("_fp8q_rows_kernel") == 2 + 1 + 2, launched  # + x; + two input gradients
    assert launched.count("_fp8q_cols_kernel") == 4, launched
    # the fused forward: h's codes made from gate_up (h never written)
    assert launched.count("_fp8q_silu_rows_kernel") == 1 and "_fp8q_silu_mul_kernel" not in launched, launched
    # the fused down backward: no [R, H] copy of the output gradient's rows, no silu_mul_bwd pass
    assert "_silu_mul_bwd_kernel" not in launched and launched.count("_combine_bwd_kernel") == 1, launched


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_quantize_rows_gathered_equals_the_gathered_copy(dev, dtype):
    """``quantize_rows`` reading rows ``v[idx[c]]`` by index (the down backward's output-gradient rows by
    token) gives the codes and scales of the copied rows, with and without the experts' column scales,
    ``routed_only`` leaving rows past RT aside (their idx points anywhere)."""
    g = torch.Generator().manual_seed(11)
    T, L, counts = 13, 37, [5, 0, 11, 3]
    cum = torch.tensor([0, *torch.tensor(counts).cumsum(0).tolist()], dtype=torch.int32).to(dev)
    rt = sum(counts)
    v = (torch.randn(T, L, generator=g) * torch.rand(L, generator=g) * 3).to(dtype).to(dev)
    idx = torch.randint(0, T, (rt + 4,), generator=g, dtype=torch.int32).to(dev)
    cs = torch.rand(len(counts), L, generator=g).to(dev) + 0.1
    for fmt in (E4M3, E5M2):
        q, sc = fp8_gemm.quantize_rows(v, fmt, idx=idx)
        wq, wsc = fp8_gemm.quantize_rows(v[idx.long()], fmt)
        assert q.shape == (rt + 4, L) and torch.equal(q.view(torch.uint8), wq.view(torch.uint8))
        assert torch.equal(sc, wsc)
        q, sc = fp8_gemm.quantize_rows(v, fmt, cs, cum, routed_only=True, idx=idx)
        wq, wsc = fp8_gemm.quantize_rows(v[idx.long()], fmt, cs, cum, routed_only=True)
        assert torch.equal(q[:rt].view(torch.uint8), wq[:rt].view(torch.uint8)) and torch.equal(sc[:rt], wsc[:rt])
    with pytest.raises(ValueError, match="2-D"):
        fp8_gemm.quantize_rows(v[None], E4M3, idx=idx)


@pytest.mark.parametrize("act", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("shape", [(29, 24, 20, 16, 4, 3, 9), (37, 33, 21, 7, 3, 0, 7), (5, 16, 9, 9, 2, 0, 9)],
                         ids=["local-slice", "odd-H-I", "empty-experts"])
def test_fused_forward_equals_the_composed_one(dev, shape, act, launched, no_host_bounds):
    """``gate_up_down_fwd`` of ``triton+fp8`` (``h``'s codes made from ``gate_up`` in one pass, ``h`` never
    written) gives exactly what ``gate_up_fwd`` then ``down_fwd`` give: the same ``gate_up``, the same
    codes of ``h`` (SiLU*up rounded to the activations' dtype first, as ``h`` was stored), so the same ``y``."""
    from fastmoe_xpu.autograd import ops

    T, H, I, E, K, start, nl = shape
    x, _, idx, w_gu, w_d, _ = layer_case(T, H, I, E, K, seed=6, empty=T == 5)
    x = x.to(act).to(dev)
    w_gu, w_d = (w[start:start + nl].contiguous().to(act).to(dev) for w in (w_gu, w_d))
    tri = kernels("triton+fp8")
    inp, out, sel, cum, cum_e = ops.route(idx.to(dev), start, nl, "triton", True)
    rt = int(cum[-1])
    gate_up, y = tri.gate_up_down_fwd(x, inp, cum, w_gu, w_d)
    assert launched.count("_fp8q_silu_rows_kernel") == 1 and "_fp8q_silu_mul_kernel" not in launched, launched
    c_gate_up, h = tri.gate_up_fwd(x, inp, cum, w_gu)
    c_y = tri.down_fwd(h, cum, w_d)
    assert gate_up.dtype == y.dtype == act and y.shape == (T * K, H)
    assert torch.equal(gate_up[:rt], c_gate_up[:rt]) and torch.equal(y[:rt], c_y[:rt])
    q, sc = fp8_gemm.quantize_silu_rows(gate_up, E4M3, cum, act)
    wq, wsc = fp8_gemm.quantize_rows(h, E4M3, cum_token_counts=cum, routed_only=True)
    assert torch.equal(q[:rt].view(torch.uint8), wq[:rt].view(torch.uint8)) and torch.equal(sc[:rt], wsc[:rt])


@pytest.mark.parametrize("shape", [(29, 24, 20, 16, 4, 3, 9), (37, 33, 20, 7, 3, 0, 7), (5, 16, 9, 9, 2, 0, 9)],
                         ids=["local-slice", "odd-H-I", "empty-experts"])
def test_fused_down_backward_equals_the_composed_one(dev, shape, launched, no_host_bounds):
    """``down_silu_bwd`` of ``triton+fp8`` (the output gradient's rows read by token in both quantization
    passes, the SiLU*up gradient in the router-weight pass) gives exactly what ``combine_bwd``,
    ``down_weighted_bwd`` and ``silu_mul_bwd`` give in turn: the same codes, so the same bits."""
    from fastmoe_xpu.autograd import ops

    T, H, I, E, K, start, nl = shape
    x, weights, idx, w_gu, w_d, dout = layer_case(T, H, I, E, K, seed=4, empty=T == 5)
    w_gu, w_d = w_gu[start:start + nl].contiguous().to(dev), w_d[start:start + nl].contiguous().to(dev)
    tri = kernels("triton+fp8")
    rows = ops.route(idx.to(dev), start, nl, "triton", True)
    inp, out, sel, cum, cum_e = rows
    gate_up, _ = tri.gate_up_fwd(x.to(dev), inp, cum, w_gu)
    weights, dout = weights.to(dev), dout.to(dev)
    rt = int(cum[-1])
    launched.clear()
    d_gu, dw, d_row = tri.down_silu_bwd(dout, weights, out, sel, cum_e, inp, gate_up, cum, w_d)
    assert "_silu_mul_bwd_kernel" not in launched and launched.count("_combine_bwd_kernel") == 1, launched
    dy, row_w = tri.combine_bwd(dout, weights, out, sel, cum_e)
    dh, c_dw, c_d_row = tri.down_weighted_bwd(dy, gate_up, row_w, cum, w_d)
    c_d_gu = tri.silu_mul_bwd(gate_up, dh, cum)
    assert torch.equal(dw, c_dw) and torch.equal(d_row[:rt], c_d_row[:rt])
    assert torch.equal(d_gu[:rt], c_d_gu[:rt])  # fp32 activations: no rounding between the two


def test_overlapped_promotion_gives_the_same_sums(dev, monkeypatch):
    """The ``OVERLAP`` form of both GEMMs (each k-step's partial product added to the accumulator
    while the next k-step's MMAs run, a config the autotuner may pick) returns exactly what the plain
    form returns: the same partial sums added in the same order. K = 37 and 53 rows per expert: the
    partial of the last, ragged k-step included."""
    from fastmoe_xpu.kernels import configs

    g = torch.Generator().manual_seed(9)
    counts = [19, 0, 1, 33]
    cum = torch.tensor([0, *torch.tensor(counts).cumsum(0).tolist()], dtype=torch.int32)
    R, N, K = sum(counts) + 2, 21, 37
    qa, sa = _codes((29, K), E4M3, g), torch.rand(29, generator=g)
    idx = torch.randint(0, 29, (R,), generator=g, dtype=torch.int32)
    qw, sw = _codes((4, N, K), E4M3, g), torch.rand(4, N, generator=g)
    _, grad, x, widx = wgrad_case(counts, N, K, seed=10)
    pcum = qcore.padded_bounds(cum)
    length = qcore.padded_length(len(widx), len(counts))
    ql, sl = qcore.quantize_cols_grouped_t(grad, E5M2, cum, pcum, length)
    qr, sr = qcore.quantize_cols_grouped_t(x, E4M3, cum, pcum, length, idx=widx)
    table = configs.table_for(dev)
    results = []
    for overlap in (False, True):
        for kernel in (fp8_gemm.KERNEL, fp8_gemm.WGRAD_KERNEL):
            base = configs.configs(table, kernel)[0]
            monkeypatch.setitem(configs.CONFIGS[table], kernel, [configs.KernelConfig(
                base.name, {**base.meta, "OVERLAP": overlap}, base.num_warps, base.num_stages, base.extra_options)])
        out = torch.zeros(R, N, device=dev)
        fp8_gemm.fp8_grouped_mm(qa.to(dev), sa.to(dev), idx.to(dev), qw.to(dev), sw.to(dev), cum.to(dev), out, True)
        dw = torch.zeros(len(counts), N, K, device=dev)
        fp8_gemm.fp8_grouped_wgrad(ql.to(dev), sl.to(dev), qr.to(dev), sr.to(dev), pcum.to(dev), dw)
        results.append((out.cpu(), dw.cpu()))
    assert results[0][0].abs().sum() > 0 and results[0][1].abs().sum() > 0
    assert torch.equal(results[0][0], results[1][0]) and torch.equal(results[0][1], results[1][1])
