"""Quantized expert GEMMs (``expert_precision="int8"`` / ``"fp8"``) against the plain-PyTorch
statement of the same maths (``fastmoe_xpu/kernels/quantized/reference.py``), gradients included,
at awkward shapes; the quantizers, the padded int8 GEMM, the per-call weight codes and the errors.
Expert parallelism with quantized GEMMs runs in tests/test_dist_ep.py (``int8-*``, ``fp8-*``)."""
from __future__ import annotations

import contextlib
import importlib.util
import threading
import warnings
from types import SimpleNamespace

import pytest
import torch

from fastmoe_xpu import FastSparseMoeBlock, settings
from fastmoe_xpu.autograd.moe_experts import moe_experts_forward
from fastmoe_xpu.kernels import kernels, registry
from fastmoe_xpu.kernels.quantized import core
from fastmoe_xpu.kernels.quantized import reference as qref
from fastmoe_xpu.routing import topk_routing

# int8: the integer GEMMs are exact and the epilogue rounds as the reference does, so only the
# combine's summation order differs; fp8: _scaled_mm accumulates in fp32 in its own order.
TOL = {"int8": dict(rtol=1e-5, atol=1e-6), "fp8": dict(rtol=2e-5, atol=1e-6)}
#: A bf16 weight-gradient GEMM (fp32 sums rounded to bf16) against the exact product rounded to bf16:
#: the sums' order can move an element to the neighbouring bf16 value, 2^-7 of it at most. (The
#: bf16 row of tests/tolerances.py, relative to the largest element, would not tell an int8 product
#: from a bf16 one.)
BF16_STEP = 2.0 ** -7

# (T, H, I, E, K): odd widths, K not dividing E, T not a multiple of the token block, a router
# that leaves experts empty, a single token.
SHAPES = [(37, 33, 20, 7, 3), (5, 16, 9, 9, 2), (1, 12, 10, 4, 2)]


def _torch_runs(fmt: str, also: str = "") -> None:
    """Skips, with the package's own reason, where the torch base's ``fmt`` GEMMs do not run here: torch
    2.11's CPU ``torch._scaled_mm`` takes per-tensor scales only, and fp8 scales here are per row and
    column (row-wise scales on the CPU came with torch 2.13). ``also``: what covers the case instead."""
    reason = core.unsupported_reason(fmt, "cpu", torch.float32)
    if reason is not None:
        pytest.skip(reason + (f"; {also}" if also else ""))


def _base_that_runs(fmt: str) -> str:
    """The kernel base that runs ``fmt`` here: torch where its quantized GEMMs do; else, for fp8, the
    Triton base under the interpreter, whose fp8 grouped GEMMs are every GEMM of the path and need no
    ``torch._scaled_mm`` (the same maths, the same reference); else a skip saying why neither runs."""
    reason = core.unsupported_reason(fmt, "cpu", torch.float32)
    if reason is None:
        return "torch"
    if registry.triton_interpreting() and importlib.util.find_spec("triton") is not None:
        triton_reason = core.unsupported_reason(fmt, "cpu", torch.float32, base="triton")
        if triton_reason is None:
            return "triton"
        reason += f"; next to the Triton base: {triton_reason}"
    else:
        reason += "; the Triton base needs triton and TRITON_INTERPRET=1 on the CPU"
    pytest.skip(reason)


def _close(got: torch.Tensor, want: torch.Tensor, fmt: str, what: str) -> None:
    scale = want.abs().max().item() if want.numel() else 1.0
    if fmt == "bf16":  # a bf16 weight-gradient GEMM: within one bf16 step of each element
        torch.testing.assert_close(got.detach().float(), want.float(), rtol=BF16_STEP, atol=1e-6 * scale,
                                   msg=lambda m: f"bf16 {what}: {m}")
        return
    tol = TOL[fmt]
    torch.testing.assert_close(got.detach().float(), want.float(), rtol=tol["rtol"],
                               atol=tol["atol"] + tol["rtol"] * scale, msg=lambda m: f"{fmt} {what}: {m}")


def _case(T, H, I, E, K, seed=0, empty=False):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=g)
    logits = torch.randn(T, E, generator=g)
    if empty:  # every token to experts [0, K + 1): the rest stay empty
        logits[:, K + 1:] -= 100
    weights, idx = topk_routing(logits, K, True)
    w_gu = torch.randn(E, 2 * I, H, generator=g) * 0.3
    w_d = torch.randn(E, H, I, generator=g) * 0.3
    dout = torch.randn(T, H, generator=g)
    return x, weights, idx, w_gu, w_d, dout


#: The precisions the torch base's tests run, the int8 one with each way of multiplying its weight
#: gradients (``core.weight_grad_gemm``: int8, or bf16 as CPUs with AMX-BF16 do unless told otherwise).
FORMATS = ["int8", "int8/bf16-wgrad", "fp8"]


@contextlib.contextmanager
def _recipe(param: str):
    """``(fmt, how its weight gradients multiply)`` of a :data:`FORMATS` entry, that way in force within."""
    fmt, _, wgrad = param.partition("/")
    wgrad = wgrad.removesuffix("-wgrad") or fmt
    with settings.override(int8_weight_grads=wgrad if fmt == "int8" else None):
        assert core.weight_grad_gemm(fmt, "cpu") == wgrad
        yield fmt, wgrad


@pytest.mark.parametrize("param", FORMATS)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "T{}-H{}-I{}-E{}-K{}".format(*s))
def test_experts_op_matches_reference(param, shape):
    with _recipe(param) as (fmt, wgrad):
        _torch_runs(fmt, "the Triton base's fp8 layer is held to the same reference at these shapes in "
                         "tests/kernels/test_fp8_triton.py")
        x, weights, idx, w_gu, w_d, dout = _case(*shape, empty=shape[0] == 5)
        leaves = [t.clone().requires_grad_(True) for t in (x, weights, w_gu, w_d)]
        out = moe_experts_forward(leaves[0], leaves[1], idx, leaves[2], leaves[3], backend="torch",
                                  expert_precision=fmt)
        out.backward(dout)
    want = qref.moe_forward_backward(x, weights, idx, w_gu, w_d, dout, fmt, weight_grads=wgrad)
    _close(out, want[0], fmt, "output")
    _close(leaves[0].grad, want[1], fmt, "input gradient")
    _close(leaves[2].grad, want[2], wgrad, "gate_up weight gradient")
    _close(leaves[3].grad, want[3], wgrad, "down weight gradient")
    _close(leaves[1].grad, want[4], fmt, "router-weight gradient")
    if shape[0] == 5:
        assert int(idx.max()) <= shape[4], "the routing did not leave experts empty"
        assert torch.count_nonzero(leaves[2].grad[shape[4] + 1:]) == 0


@pytest.mark.parametrize("fmt", ["int8", "fp8"])
def test_quantized_close_to_full_precision(fmt):
    """The straight-through gradients are the gradients of the layer up to quantization noise (on the
    torch base, or for fp8 where torch's CPU ``_scaled_mm`` cannot take its scales, the Triton base)."""
    base = _base_that_runs(fmt)
    x, weights, idx, w_gu, w_d, dout = _case(64, 48, 32, 4, 2, seed=1)
    outs = {}
    for prec in (None, fmt):
        leaves = [t.clone().requires_grad_(True) for t in (x, weights, w_gu, w_d)]
        out = moe_experts_forward(leaves[0], leaves[1], idx, leaves[2], leaves[3], backend=base,
                                  expert_precision=prec)
        out.backward(dout)
        outs[prec] = [out.detach(), *(t.grad for t in leaves)]
    bound = {"int8": 0.03, "fp8": 0.15}[fmt]  # relative error of 8-bit codes (e5m2 has 2 mantissa bits)
    for name, a, b in zip(("out", "dx", "dweights", "dw_gate_up", "dw_down"), outs[fmt], outs[None]):
        rel = ((a - b).norm() / b.norm()).item()
        assert rel < bound, (name, rel)
        assert rel > 0, (name, "quantization changed nothing: the precision was not applied")


@pytest.mark.parametrize("param", FORMATS)
@pytest.mark.parametrize("transposed", [False, True])
def test_grouped_linear_launchers(param, transposed):
    """``down_fwd`` / ``down_bwd`` (the other layouts' stage 4) against :func:`qref.qlinear` per expert."""
    g = torch.Generator().manual_seed(3)
    counts = [5, 0, 19, 1]
    cum = torch.tensor([0, *torch.tensor(counts).cumsum(0).tolist()], dtype=torch.int32)
    a = torch.randn(sum(counts), 11, generator=g)
    w = torch.randn(4, 13, 11, generator=g)  # [NR, O, In]
    stored = w.transpose(1, 2).contiguous() if transposed else w
    dy = torch.randn(sum(counts), 13, generator=g)
    with _recipe(param) as (fmt, wgrad):
        _torch_runs(fmt, "tests/kernels/test_fp8_triton.py holds the Triton base's launchers to the same reference")
        ks = kernels(f"torch+{fmt}")
        y = ks.down_fwd(a, cum, stored, transposed=transposed)
        da, dw = ks.down_bwd(dy, a, cum, stored, transposed=transposed)
    for e in range(4):
        s, t = int(cum[e]), int(cum[e + 1])
        if s == t:
            assert torch.count_nonzero(dw[e]) == 0
            continue
        _close(y[s:t], qref.qlinear(a[s:t], w[e], fmt), fmt, f"expert {e} forward")
        want_da, want_dw = qref.qlinear_backward(dy[s:t], a[s:t], w[e], fmt, weight_grads=wgrad)
        _close(da[s:t], want_da, fmt, f"expert {e} input gradient")
        _close(dw[e].t() if transposed else dw[e], want_dw, wgrad, f"expert {e} weight gradient")


@pytest.mark.parametrize("transposed", [False, True])
def test_bf16_weight_grads_of_bf16_weights(transposed):
    """The int8 layer's bf16 weight gradients where the weights are bf16 (the GEMM writes the gradient
    itself, no fp32 copy): each expert's within one bf16 step of the exact product of the bf16 operands;
    an empty expert's zero."""
    g = torch.Generator().manual_seed(4)
    counts = [7, 0, 21, 2]
    cum = torch.tensor([0, *torch.tensor(counts).cumsum(0).tolist()], dtype=torch.int32)
    a = torch.randn(sum(counts) + 2, 11, generator=g).bfloat16()  # two rows past RT
    w = torch.randn(4, 13, 11, generator=g).bfloat16()
    dy = torch.randn(sum(counts) + 2, 13, generator=g).bfloat16()
    with _recipe("int8/bf16-wgrad"):
        _, dw = kernels("torch+int8").down_bwd(dy, a, cum, w.transpose(1, 2).contiguous() if transposed else w,
                                               transposed=transposed)
    assert dw.dtype == torch.bfloat16
    for e in range(4):
        s, t = int(cum[e]), int(cum[e + 1])
        got = dw[e].t() if transposed else dw[e]
        if s == t:
            assert torch.count_nonzero(got) == 0
            continue
        _close(got, qref.weight_grad(dy[s:t], a[s:t], "int8", "bf16"), "bf16", f"expert {e} weight gradient")


def test_block_surface_and_bf16():
    cfg = SimpleNamespace(hidden_size=24, intermediate_size=16, num_experts=6, num_experts_per_tok=2,
                          norm_topk_prob=True, hidden_act="silu")
    torch.manual_seed(0)
    blocks = {p: FastSparseMoeBlock(cfg, backend="torch", expert_precision=p) for p in (None, "int8")}
    blocks["int8"].load_state_dict(blocks[None].state_dict())
    assert "expert_precision='int8'" in repr(blocks["int8"])
    x = torch.randn(2, 9, 24)
    out = {p: b(x) for p, b in blocks.items()}
    rel = ((out["int8"] - out[None]).norm() / out[None].norm()).item()
    assert 0 < rel < 0.03, rel
    b16 = blocks["int8"].to(torch.bfloat16)
    y = b16(x.bfloat16())
    y.float().sum().backward()
    assert y.dtype == torch.bfloat16 and b16.experts.gate_up_proj.grad.dtype == torch.bfloat16
    assert ((y.float() - out[None]).norm() / out[None].norm()).item() < 0.05


def test_precision_errors():
    cfg = SimpleNamespace(hidden_size=8, intermediate_size=8, num_experts=2, num_experts_per_tok=1,
                          norm_topk_prob=False, hidden_act="silu")
    with pytest.raises(ValueError, match="expert_precision must be one of"):
        FastSparseMoeBlock(cfg, expert_precision="int4")
    with pytest.raises(RuntimeError, match="expert_precision='int8' cannot run here: .*meta"):
        registry.precision_engine("int8", "torch", "meta", torch.float32)
    # precision entries are never a gemm_engine choice, and auto never times them
    assert "int8" not in registry.ENGINES and "int8" not in registry.candidates("torch", "cpu", torch.float32)
    assert registry.PRECISIONS == {"int8": ("int8",), "fp8": ("fp8",), "fp8-block": ("fp8-block",)}


def test_precision_engine_answers_are_kept_per_settings(monkeypatch):
    """The engine of a precision is worked out once per device, dtype and settings (each quantized layer
    call asks), again after the settings change or the choices are forgotten; a refusal is not kept."""
    asked = []
    real = registry.unavailable_reason

    def counted(*args, **kwargs):
        asked.append(args[0])
        return real(*args, **kwargs)

    monkeypatch.setattr(registry, "unavailable_reason", counted)
    registry.forget_choices()
    want = registry.precision_engine("int8", "torch", "cpu", torch.float32)
    assert want == "int8" and asked == ["int8"]
    assert registry.precision_engine("int8", "torch", "cpu", torch.float32) == want and asked == ["int8"]
    with settings.override(int8_weight_grads="int8"):
        assert registry.precision_engine("int8", "torch", "cpu", torch.float32) == want and len(asked) == 2
    registry.forget_choices()
    registry.precision_engine("int8", "torch", "cpu", torch.float32)
    assert len(asked) == 3
    for _ in range(2):
        with pytest.raises(RuntimeError, match="cannot run here"):
            registry.precision_engine("int8", "torch", "meta", torch.float32)
    assert len(asked) == 5


@pytest.mark.parametrize("shape", [(5, 13, 11), (16, 8, 8), (40, 24, 7)])
def test_int_mm_padding_is_exact(shape):
    M, K, N = shape
    g = torch.Generator().manual_seed(M)
    a = torch.randint(-127, 128, (M, K), generator=g, dtype=torch.int8)
    b = torch.randint(-127, 128, (K, N), generator=g, dtype=torch.int8)
    want = (a.long() @ b.long()).int()
    assert torch.equal(core.int_mm(a, b, pad=True), want)
    assert torch.equal(core.int_mm(a, b, pad=False), want)


@pytest.mark.parametrize("shape", [(5, 13, 11), (32, 16, 16)])
def test_fp8_padding_is_exact(shape):
    """The padded fp8 GEMM (what CUDA runs for widths not a multiple of 16) equals the unpadded one."""
    _torch_runs("fp8")
    M, K, N = shape
    g = torch.Generator().manual_seed(K)
    qa, sa = core.quantize_rows(torch.randn(M, K, generator=g), torch.float8_e4m3fn)
    qb, sb = core.quantize_cols(torch.randn(K, N, generator=g), torch.float8_e5m2)
    want = (qa.double() @ qb.double()).float() * sa[:, None] * sb[None, :]
    for pad in (True, False):
        torch.testing.assert_close(core.scaled_mm(qa, sa, qb, sb, pad=pad), want, rtol=1e-6, atol=1e-6)


def test_quantizers():
    v = torch.tensor([[0.0, 0.0, 0.0], [1.0, -2.0, 0.5], [-3.0, 3.0, 1e-3]])
    q, s = core.quantize_rows(v, torch.int8)
    assert q.dtype == torch.int8 and s.tolist()[0] == 0.0 and q[0].eq(0).all()  # all-zero row: zero codes
    assert q[1].tolist() == [64, -127, 32] and q[2].tolist() == [-127, 127, 0]
    torch.testing.assert_close(q.float() * s[:, None], v, atol=3 / 254, rtol=0)
    qc, sc = core.quantize_cols(v, torch.int8)
    assert torch.equal(qc, core.quantize_rows(v.t(), torch.int8)[0].t()) and torch.equal(sc, core.quantize_rows(v.t(), torch.int8)[1])
    q8, s8 = core.quantize_rows(v, torch.float8_e4m3fn)
    assert q8.dtype == torch.float8_e4m3fn and q8.float().abs().amax(1).tolist() == [0.0, 448.0, 448.0]


@pytest.mark.parametrize("dtype", [torch.int8, torch.float8_e4m3fn])
@pytest.mark.parametrize("dim", [-1, -2])
def test_weights_quantized_expert_by_expert_equal_the_whole(monkeypatch, dim, dtype):
    """A big 3-D weight is quantized one expert at a time (``core.BY_EXPERT_MIN_ELEMENTS``): the codes
    and scales of quantizing it whole, a zero slice and a non-finite entry included."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(5, 33, 20, generator=g) * torch.logspace(-3, 3, 20)
    w[1, :, 0] = 0
    w[1, 0, :] = 0
    w[3, 2, 7] = float("inf")
    monkeypatch.setattr(core, "FUSED_MIN_ELEMENTS", 1 << 40)  # the eager passes on both sides
    whole = core._quantize_eager(w, dtype, dim)
    monkeypatch.setattr(core, "BY_EXPERT_MIN_ELEMENTS", w.numel())
    split = core.quantize_rows(w, dtype) if dim == -1 else core.quantize_cols(w, dtype)
    for got, want in zip(split, whole):
        assert got.shape == want.shape and got.dtype == want.dtype
        assert torch.equal(got.view(torch.uint8) if got.dtype != torch.float32 else got.nan_to_num(),
                           want.view(torch.uint8) if want.dtype != torch.float32 else want.nan_to_num())


def test_weight_codes_follow_updates():
    """The backward reuses the forward's weight codes only while the weight is unchanged."""
    w = torch.randn(3, 8, 5)
    first = core.quantized_weight(w, torch.int8)
    assert core.quantized_weight(w, torch.int8, reuse=True) is first
    w.mul_(2).add_(0.5)  # an optimizer step: the version moves
    again = core.quantized_weight(w, torch.int8, reuse=True)
    fresh = core.quantize_rows(w, torch.int8)
    assert again is not first and torch.equal(again.codes, fresh[0]) and torch.equal(again.scales, fresh[1])
    key = id(w)
    del w, first, again
    assert key not in core._WEIGHTS


def test_frozen_weights_keep_the_codes_across_calls_until_the_weight_changes():
    """Inside ``frozen_weights`` a forward takes back the codes of an unchanged weight; an in-place
    update (the version) or a new ``.data`` (the address, dtype) makes new ones; thread-local."""
    w = torch.randn(3, 8, 5)
    first = core.quantized_weight(w, torch.int8)
    assert core.quantized_weight(w, torch.int8) is not first  # outside: every forward quantizes anew
    with core.frozen_weights():
        kept = core.quantized_weight(w, torch.int8)
        assert core.quantized_weight(w, torch.int8) is kept
        assert core.quantized_weight(w, torch.float8_e4m3fn) is not kept  # another format
        kept = core.quantized_weight(w, torch.int8)
        w.add_(1.0)  # an optimizer step
        after = core.quantized_weight(w, torch.int8)
        assert after is not kept and torch.equal(after.codes, core.quantize_rows(w, torch.int8)[0])
        w.data = w.data * 2  # a move or a cast: the same object, its version unchanged, a new address
        again = core.quantized_weight(w, torch.int8)
        assert again is not after and torch.equal(again.codes, after.codes)
        assert torch.equal(again.scales, after.scales * 2)
        w.data = w.data.double()
        assert core.quantized_weight(w, torch.int8) is not again
        seen = []
        other = threading.Thread(target=lambda: seen.append(core.weights_frozen()))
        other.start()
        other.join()
        assert seen == [False] and core.weights_frozen()
        with core.frozen_weights():
            assert core.weights_frozen()
        assert core.weights_frozen()  # still inside the outer one
    assert not core.weights_frozen()
    last = core.quantized_weight(w, torch.int8)
    assert core.quantized_weight(w, torch.int8) is not last


def test_inference_outside_frozen_weights_is_hinted_once(monkeypatch):
    """Quantizing an unchanged weight again under ``no_grad`` (decoding without
    ``frozen_expert_weights``) warns once per process, naming the context; a training forward, a
    changed weight or a call inside the context does not."""
    monkeypatch.setattr(core, "_HINTED", [])
    w = torch.randn(3, 8, 5)
    core.forget_weights()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        core.quantized_weight(w, torch.int8)
        core.quantized_weight(w, torch.int8)  # autograd on: a training step's forward, no hint
        with torch.no_grad():
            w.add_(1.0)
            core.quantized_weight(w, torch.int8)  # changed since: no hint
            with core.frozen_weights():
                core.quantized_weight(w, torch.int8)
    with torch.no_grad(), pytest.warns(UserWarning, match=r"inside fastmoe_xpu\.frozen_expert_weights\(\)"):
        core.quantized_weight(w, torch.int8)
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("error")
        core.quantized_weight(w, torch.int8)  # once per process
    core.forget_weights()


@pytest.mark.parametrize("precision", ["int8", "fp8"])
def test_frozen_expert_weights_decode_equals_quantizing_every_call(precision):
    """Decoding a block under ``fastmoe_xpu.frozen_expert_weights``: every call's output is exactly
    the one of quantizing the weights anew, each weight is quantized once, and after an in-place
    update only the changed weight is quantized again."""
    import fastmoe_xpu

    if precision == "fp8" and (reason := core.unsupported_reason("fp8", "cpu", torch.float32)):
        pytest.skip(reason)
    cfg = SimpleNamespace(hidden_size=24, intermediate_size=20, num_experts=7, num_experts_per_tok=3,
                          norm_topk_prob=True, hidden_act="silu")
    torch.manual_seed(0)
    block = FastSparseMoeBlock(cfg, backend="torch", expert_precision=precision)
    xs = [torch.randn(1, 1, 24) for _ in range(3)] + [torch.randn(2, 5, 24)]

    def run(frozen: bool) -> tuple[list[torch.Tensor], list]:
        """The outputs, and every weight's codes the calls used (each object once)."""
        core.forget_weights()
        made: list = []
        with torch.no_grad(), (fastmoe_xpu.frozen_expert_weights() if frozen else contextlib.nullcontext()):
            outs = []
            for x in xs:
                outs.append(block(x))
                made += [e.qw for e in core._WEIGHTS.values() if not any(e.qw is m for m in made)]
        return outs, made
    plain, plain_made = run(False)
    frozen, frozen_made = run(True)
    assert len(plain_made) == 2 * len(xs) and len(frozen_made) == 2
    assert all(torch.equal(a, b) for a, b in zip(plain, frozen))
    with torch.no_grad(), fastmoe_xpu.frozen_expert_weights():  # decoding on, after an update in place
        core.forget_weights()
        block(xs[0])
        before = {id(e.ref()): e.qw for e in core._WEIGHTS.values()}
        block.experts.gate_up_proj.mul_(1.5)
        after_update = [block(x) for x in xs]
        now = {id(e.ref()): e.qw for e in core._WEIGHTS.values()}
    assert now[id(block.experts.down_proj)] is before[id(block.experts.down_proj)]
    assert now[id(block.experts.gate_up_proj)] is not before[id(block.experts.gate_up_proj)]
    plain2, _ = run(False)
    assert all(torch.equal(a, b) for a, b in zip(plain2, after_update))
    assert not torch.equal(plain2[0], plain[0])


@pytest.mark.parametrize("flags", [{}, {"is_transposed": True}], ids=["fused", "plain-transposed"])
def test_transformers_experts_function_decodes_on_frozen_codes(flags):
    """The ``"fastmoe"`` experts function (``model.generate`` inside ``frozen_expert_weights``) keeps
    each weight's codes across calls and gives the outputs of quantizing per call."""
    pytest.importorskip("transformers.integrations.moe")
    import fastmoe_xpu
    from test_experts_interface import _config, _make_class, _routing

    torch.manual_seed(0)
    module = _make_class(**flags)(_config("fastmoe"))
    module.fastmoe_expert_precision = "int8"
    calls = [(torch.randn(t, 16), *_routing(t, 2)) for t in (1, 1, 6)]
    with torch.no_grad():
        core.forget_weights()
        want = [module(*c) for c in calls]
        with fastmoe_xpu.frozen_expert_weights():
            got, codes = [], []
            for c in calls:
                got.append(module(*c))
                codes.append([e.qw for e in core._WEIGHTS.values()])
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert len(codes[0]) == 2 and all(a is b for later in codes[1:] for a, b in zip(codes[0], later))


@pytest.mark.parametrize("flags", [{}, {"is_transposed": True}], ids=["fused", "plain-transposed"])
def test_transformers_experts_function(flags, monkeypatch):
    """The ``"fastmoe"`` experts function takes the precision from the module, its config, or
    ``FASTMOE_EXPERT_PRECISION``, on the fused and the plain path alike."""
    pytest.importorskip("transformers.integrations.moe")
    from test_experts_interface import _config, _make_class, _routing

    from fastmoe_xpu import settings

    torch.manual_seed(0)
    module = _make_class(**flags)(_config("fastmoe"))
    x = torch.randn(13, 16)
    idx, w = _routing(13, 2)

    def run():
        module.zero_grad(set_to_none=True)
        out = module(x, idx, w)
        out.sum().backward()
        return out.detach(), module.down_proj.grad

    full = run()
    module.config.fastmoe_expert_precision = "int8"
    by_config = run()
    del module.config.fastmoe_expert_precision
    with settings.override(expert_precision="int8"):
        by_env = run()
    module.fastmoe_expert_precision = "int8"
    by_module = run()
    for a, b in zip(by_config, by_env):
        assert torch.equal(a, b)
    for a, b in zip(by_config, by_module):
        assert torch.equal(a, b)
    for a, b in zip(by_config, full):
        rel = ((a - b).norm() / b.norm()).item()
        assert 0 < rel < 0.03, rel
    if not flags:  # the fused path is the experts op itself with that precision
        want = moe_experts_forward(x, w, idx, module.gate_up_proj.detach(), module.down_proj.detach(),
                                   backend="torch", expert_precision="int8")
        torch.testing.assert_close(by_config[0], want, rtol=1e-6, atol=1e-7)
    monkeypatch.setenv("FASTMOE_EXPERT_PRECISION", "int4")
    with pytest.raises(ValueError, match="FASTMOE_EXPERT_PRECISION must be one of"):
        settings.read()


@pytest.mark.parametrize("family", ["olmoe", "qwen3_moe"])
def test_int8_experts_from_pretrained(tmp_path, family):
    """``from_pretrained(..., experts_implementation="fastmoe", fastmoe_expert_precision="int8")`` sets the
    precision on the config: the model computes exactly what its experts modules given int8 directly
    compute, a save keeps the choice in config.json, and a value that is no precision is refused."""
    pytest.importorskip("transformers.integrations.moe")
    from transformers import AutoModelForCausalLM

    from fastmoe_xpu.integrations.families import tiny_config

    cfg = tiny_config(family)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(tmp_path / "m")
    q = AutoModelForCausalLM.from_pretrained(tmp_path / "m", experts_implementation="fastmoe",
                                             fastmoe_expert_precision="int8").eval()
    assert q.config.fastmoe_expert_precision == "int8" and q.config._experts_implementation == "fastmoe"
    ref = AutoModelForCausalLM.from_pretrained(tmp_path / "m", experts_implementation="fastmoe").eval()
    assert ref.config.fastmoe_expert_precision is None
    experts = [m for m in ref.modules() if type(m).__name__.endswith("Experts") and hasattr(m, "has_gate")]
    assert experts
    ids = torch.randint(3, cfg.vocab_size, (2, 11))
    with torch.no_grad():
        full = ref(input_ids=ids).logits
        for m in experts:
            m.fastmoe_expert_precision = "int8"  # the per-module form, the reference
        want = ref(input_ids=ids).logits
        got = q(input_ids=ids).logits
    assert torch.equal(got, want)
    assert 0 < ((got - full).norm() / full.norm()).item() < 0.03  # int8 ran
    q.save_pretrained(tmp_path / "q")
    again = AutoModelForCausalLM.from_pretrained(tmp_path / "q").eval()
    assert again.config.fastmoe_expert_precision == "int8" and again.config._experts_implementation == "fastmoe"
    with torch.no_grad():
        assert torch.equal(again(input_ids=ids).logits, want)
    # "none" clears it, for a saved int8 model loaded at full precision
    plain = AutoModelForCausalLM.from_pretrained(tmp_path / "q", fastmoe_expert_precision="none").eval()
    assert plain.config.fastmoe_expert_precision is None
    refused = "fastmoe_expert_precision must be one of \\(None, 'int8', 'fp8', 'fp8-block'\\), got 'int4'"
    with pytest.raises(ValueError, match=refused):
        AutoModelForCausalLM.from_pretrained(tmp_path / "m", experts_implementation="fastmoe",
                                             fastmoe_expert_precision="int4")


def test_generate_inside_frozen_expert_weights_gives_the_same_tokens(tmp_path, monkeypatch):
    """The documented decoding form: an int8 OLMoE model's greedy ``generate`` inside
    ``frozen_expert_weights`` writes the tokens it writes without, and quantizes each expert weight
    once for the whole generation (every layer's two, not two per layer per token)."""
    pytest.importorskip("transformers.integrations.moe")
    import fastmoe_xpu
    from fastmoe_xpu.integrations.families import tiny_config
    from quantized_util import count_weight_codes
    from transformers import AutoModelForCausalLM

    cfg = tiny_config("olmoe")
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(tmp_path / "m")
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "m", experts_implementation="fastmoe",
                                                 fastmoe_expert_precision="int8").eval()
    ids = torch.randint(3, cfg.vocab_size, (1, 5))
    common = dict(max_new_tokens=6, do_sample=False, pad_token_id=0, eos_token_id=None)  # all 6 tokens
    made = count_weight_codes(monkeypatch)
    with torch.no_grad():
        core.forget_weights()
        want = model.generate(ids, **common)
        per_call = len(made)
        made.clear()
        core.forget_weights()
        with fastmoe_xpu.frozen_expert_weights():
            got = model.generate(ids, **common)
    core.forget_weights()
    assert torch.equal(got, want) and got.shape[1] == 5 + 6
    assert len(made) == 2 * cfg.num_hidden_layers and per_call == 6 * len(made), (len(made), per_call)


@pytest.mark.slow
def test_fused_int8_passes_equal_eager(monkeypatch):
    """The inductor-fused quantize and epilogue give the eager passes' bits (awkward shapes, a zero
    row, a 3-D weight, scaled rows). Marked slow: inductor compiles one kernel per case here (15-40 s
    on two shared cores, less once its disk cache holds them); it is needed because the fused path
    is what every large layer runs, and the other tests' shapes stay below its threshold."""
    monkeypatch.setattr(core, "FUSED_MIN_ELEMENTS", 1)
    if core._FUSED_FAILED:
        pytest.skip(f"fused int8 passes unavailable: {core._FUSED_FAILED[0]}")
    g = torch.Generator().manual_seed(5)
    v = torch.randn(37, 53, generator=g)
    v[3] = 0
    w = torch.randn(3, 29, 17, generator=g)
    cs = torch.rand(53, generator=g) + 0.5
    # rows of 3 experts (one without rows), each row times its expert's column scales
    rows_expert = core.rows_of_experts([(0, 0, 20), (1, 20, 20), (2, 20, 37)], v.device)
    cs_experts = torch.rand(3, 53, generator=g) + 0.5
    cases = [(v, -1, None, None), (w, -2, None, None), (v, -1, cs, None), (v, -1, cs_experts, rows_expert)]
    for t, dim, c, rows in cases:
        ok, fused = core._run_fused("quantize", t, dim, c, rows)
        assert ok, core._FUSED_FAILED
        eager = core._quantize_eager(t, torch.int8, dim, c, rows)
        assert torch.equal(fused[0], eager[0]) and torch.equal(fused[1], eager[1]), (tuple(t.shape), dim)
    want_rows = torch.cat([core._quantize_eager(v[:20], torch.int8, -1, cs_experts[0])[0],
                           core._quantize_eager(v[20:], torch.int8, -1, cs_experts[2])[0]])
    assert torch.equal(eager[0], want_rows), "rows_expert: not each expert's rows with its own scales"
    acc = torch.randint(-2**20, 2**20, (37, 29), generator=g, dtype=torch.int32)
    sa, sb = torch.rand(37, generator=g), torch.rand(29, generator=g)
    for cols_first in (False, True):  # True: the transposed weight gradient's order
        buf = torch.zeros(40, 29)
        assert core._run_fused("epilogue", buf[2:39], acc, sa, sb, cols_first)[0]
        want = torch.zeros(40, 29)
        core._epilogue_eager(want[2:39], acc, sa, sb, cols_first)
        assert torch.equal(buf, want), cols_first
    sb_experts = torch.rand(3, 29, generator=g)  # the grouped epilogue: each row its expert's column scales
    buf, want = torch.zeros(37, 29), torch.zeros(37, 29)
    assert core._run_fused("epilogue", buf, acc, sa, sb_experts, False, rows_expert)[0]
    core._epilogue_eager(want, acc, sa, sb_experts, False, rows_expert)
    assert torch.equal(buf, want)
    for e, s, t in ((0, 0, 20), (2, 20, 37)):  # and what the expert-by-expert epilogue gives
        core._epilogue_eager(want[s:t], acc[s:t], sa[s:t], sb_experts[e])
    assert torch.equal(buf, want)


def test_inference_runs_the_eager_passes_until_a_pass_is_used_often(monkeypatch):
    """Inside frozen_weights() a fused pass is not compiled at its first uses (compiling cost a tiny
    model's first generate tens of times transformers' whole first generate): the eager passes run,
    the same bits, until the pass has run FROZEN_COMPILE_AFTER times; then it is compiled once. In
    training it is compiled at its first use."""
    compiled = []

    def fake_compile(fn, dynamic=False):  # noqa: ANN001, ANN202 - the compiled function is the eager one
        compiled.append(fn.__name__)
        return fn

    monkeypatch.setattr(core, "FUSED_MIN_ELEMENTS", 1)
    monkeypatch.setattr(core, "FROZEN_COMPILE_AFTER", 3)
    monkeypatch.setattr(core, "_FUSED", {})
    monkeypatch.setattr(core, "_FROZEN_USES", {})
    monkeypatch.setattr(core, "_FUSED_FAILED", [])
    monkeypatch.setattr(torch, "compile", fake_compile)
    g = torch.Generator().manual_seed(1)
    acc = torch.randint(-2**20, 2**20, (7, 5), generator=g, dtype=torch.int32)
    sa, sb = torch.rand(7, generator=g), torch.rand(5, generator=g)
    want = torch.empty(7, 5)
    core._epilogue_eager(want, acc, sa, sb, False)
    with core.frozen_weights():
        for use in range(1, 5):
            out = torch.empty(7, 5)
            ran, _ = core._run_fused("epilogue", out, acc, sa, sb, False)
            assert ran == (use > 3) and compiled == ([] if use <= 3 else ["_epilogue_rows_cols_rows_cols"]), use
            if not ran:
                core._epilogue_eager(out, acc, sa, sb, False)
            assert torch.equal(out, want)
    assert core._run_fused("quantize", torch.randn(4, 6, generator=g), -1, None)[0]  # training: compiled at once
    assert len(compiled) == 2


@pytest.mark.slow
def test_fused_epilogue_over_expert_slices_compiles_once(monkeypatch):
    """The expert loop hands the fused epilogue one expert's slice after another: views at every
    storage offset of one output buffer and of the scales. Dynamo sees them as plain tensors (no
    base, offset 0), so the slices share one compiled graph instead of recompiling per offset and
    aliasing pattern past the recompile limit; every slice gives the eager pass's bits."""
    from torch._dynamo.utils import counters

    monkeypatch.setattr(core, "FUSED_MIN_ELEMENTS", 1)
    monkeypatch.setattr(core, "_FUSED", {})  # a compiled function of this test's own
    if core._FUSED_FAILED:
        pytest.skip(f"fused int8 passes unavailable: {core._FUSED_FAILED[0]}")
    g = torch.Generator().manual_seed(3)
    rows = [5, 2, 9, 3, 7, 4, 6, 2, 8, 3]
    N = 24
    out, want = torch.zeros(sum(rows) + 1, N), torch.zeros(sum(rows) + 1, N)
    # the row scales of all tokens; the weight scales of 4 experts, expert i's channels at offset i * N
    sa_all, sb_all = torch.rand(sum(rows) + 1, generator=g), torch.rand(4 * N, generator=g)
    before = counters["stats"]["unique_graphs"]
    start = 1  # every slice at an offset: the first at one row (the scales' offset 1), the others further on
    for i, r in enumerate(rows):
        acc = torch.randint(-2**20, 2**20, (r, N), generator=g, dtype=torch.int32)
        sa, sb = sa_all[start:start + r], sb_all[(i % 4) * N:(i % 4 + 1) * N]
        assert core._run_fused("epilogue", out[start:start + r], acc, sa, sb)[0]
        core._epilogue_eager(want[start:start + r], acc, sa, sb, False)
        start += r
    assert torch.equal(out, want)
    # one graph (as views, these slices compiled 4: the offsets 0, 1 and more, and equal offsets)
    assert counters["stats"]["unique_graphs"] - before == 1, counters["stats"]["unique_graphs"] - before


@pytest.mark.slow
@pytest.mark.parametrize("local", [None, (2, 3)], ids=["all-experts", "experts-2-4"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "T{}-H{}-I{}-E{}-K{}".format(*s))
def test_int8_fused_passes_and_pooled_buffers_match_reference(monkeypatch, shape, local):
    """The int8 layer with every quantize and epilogue on the fused passes (which large layers run:
    their codes and scales, the int32 sums and the down backward's rows in pooled CPU buffers; each
    token quantized once and its codes gathered, or with ``local`` (an expert-parallel slice: experts
    ``[start, start + n)`` of E, fewer routed rows than tokens) the routed rows gathered, then
    quantized) at the awkward shapes, held to the reference, twice in a row: the second call gets
    the first call's buffers back from the pool and must not see what they held (the same bits as
    the first)."""
    from fastmoe_xpu.kernels.torch import buffers

    monkeypatch.setattr(core, "FUSED_MIN_ELEMENTS", 1)
    monkeypatch.setattr(buffers._CpuBufferCache, "MIN_BYTES", 0)  # every buffer of these small shapes pooled
    if core._FUSED_FAILED:
        pytest.skip(f"fused int8 passes unavailable: {core._FUSED_FAILED[0]}")
    buffers.release_buffers()
    x, weights, idx, w_gu, w_d, dout = _case(*shape, empty=shape[0] == 5)
    start = 0
    if local is not None:
        start, n = local
        w_gu, w_d = w_gu[start:start + n].contiguous(), w_d[start:start + n].contiguous()
    wgrad = core.weight_grad_gemm("int8", "cpu")  # this CPU's own way (bf16 with AMX-BF16)
    want = qref.moe_forward_backward(x, weights, idx, w_gu, w_d, dout, "int8", expert_start=start,
                                     weight_grads=wgrad)
    runs = []
    for _ in range(2):
        leaves = [t.clone().requires_grad_(True) for t in (x, weights, w_gu, w_d)]
        out = moe_experts_forward(leaves[0], leaves[1], idx, leaves[2], leaves[3], backend="torch",
                                  expert_start=start, expert_precision="int8")
        out.backward(dout)
        got = (out, leaves[0].grad, leaves[2].grad, leaves[3].grad, leaves[1].grad)
        for g, w, what in zip(got, want, ("output", "input gradient", "gate_up weight gradient",
                                          "down weight gradient", "router-weight gradient")):
            _close(g, w, wgrad if "weight gradient" in what and "router" not in what else "int8", what)
        runs.append([t.detach().clone() for t in got])
    assert not core._FUSED_FAILED, core._FUSED_FAILED
    assert all(torch.equal(a, b) for a, b in zip(*runs))
    assert not buffers._CACHE.enabled or buffers._CACHE.pool, "nothing came from the pool"
    buffers.release_buffers()


@pytest.mark.slow
def test_int8_layer_compiles_nothing_after_warm_up(monkeypatch, tmp_path):
    """The int8 layer's fused passes compile while it warms up and never after: calls whose rows per
    expert change (each a new routing, an empty expert among them) run the compiled passes without
    a recompile (dynamo counted every frame it compiled). Before, one compiled function served every
    reduced dimension, scale set and parameter type, guarded on each, and ran past dynamo's
    recompile limit into recompiles and eager fallbacks inside the calls. Marked slow: inductor
    compiles each pass once (tens of seconds on two shared cores)."""
    from torch._dynamo.utils import counters

    monkeypatch.setenv("FASTMOE_GEMM_CACHE", str(tmp_path / "engines.json"))
    if core._FUSED_FAILED:
        pytest.skip(f"fused int8 passes unavailable: {core._FUSED_FAILED[0]}")
    monkeypatch.setattr(core, "_FUSED", {})
    # two layers of other widths in one model, ~512 rows per expert: every product past FUSED_MIN_ELEMENTS
    blocks = []
    for H, I in ((512, 256), (384, 512)):
        cfg = SimpleNamespace(hidden_size=H, intermediate_size=I, num_experts=4, num_experts_per_tok=2,
                              norm_topk_prob=False, hidden_act="silu")
        torch.manual_seed(0)
        blocks.append(FastSparseMoeBlock(cfg, backend="torch", gemm_engine="loop", expert_precision="int8"))

    def call(seed: int, empty_expert: bool = False) -> None:
        g = torch.Generator().manual_seed(seed)
        for block in blocks:
            x = torch.randn(1024, block.gate.weight.shape[1], generator=g, requires_grad=True)
            if empty_expert:  # the router never picks expert 0
                with torch.no_grad():
                    block.gate.weight[0] = -1e3 * block.gate.weight[0].sign().clamp(min=0)
            block(x).sum().backward()

    for seed in (0, 1):
        call(seed)
    assert core._FUSED, "the layers ran none of the fused passes"
    frames = counters["frames"]["total"]
    for seed in (2, 3):
        call(seed)
    call(5, empty_expert=True)
    assert counters["frames"]["total"] == frames, "the int8 layer compiled inside its calls after warm-up"


def test_unavailable_reason_keeps_the_sentence_that_says_why():
    """torch's internal asserts put the reason after the bug-report request (torch 2.11's CPU
    ``_scaled_mm`` with row-wise scales): the probe's reason keeps that sentence."""
    said = core._said(RuntimeError('(scale_a.numel() == 1 && scale_b.numel() == 1) INTERNAL ASSERT FAILED at '
                                   '"/pytorch/aten/src/ATen/native/mkldnn/Linear.cpp":516, please report a bug to '
                                   'PyTorch. Now _scaled_mm only supports per-tensor scaling for CPU backend.'))
    assert said == "Now _scaled_mm only supports per-tensor scaling for CPU backend."
    assert core._said(ValueError("first line\n  second")) == "first line second"
    assert core._said(RuntimeError()) == "RuntimeError"
    assert len(core._said(RuntimeError("x" * 500))) == 160
