"""``auto`` without timing for small layers (``registry.untimed_engine``): a fused layer above the
padded op's budget and at most ``registry.SMALL_LAYER_MACS`` runs the staged chain on
``registry.SMALL_LAYER_ENGINE``, times nothing and keeps no watch; its numbers are the reference's.

Awkward shapes: T not a multiple of anything, K=3, an expert no token chose, odd H and I; forward
and the gradients of the input, both weights and the routing weights.
"""
import pytest
import torch

from fastmoe_xpu import settings
from fastmoe_xpu.autograd import ops
from fastmoe_xpu.autograd.moe_experts import moe_experts_forward
from fastmoe_xpu.kernels import grouped_mm, registry, timing
from fastmoe_xpu.reference import reference_experts_forward
from tolerances import assert_close

# (T, H, I, E, K): 8.6 Mi multiply-accumulates, between the padded op's budget and SMALL_LAYER_MACS.
SHAPE = (333, 72, 40, 7, 3)


def _inputs(T, H, I, E, K, seed=0):
    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(seed)
    idx = torch.stack([torch.randperm(E - 1, generator=g)[:K] for _ in range(T)])  # expert E-1: no rows
    x = torch.randn(T, H, requires_grad=True)
    w_gu = (0.3 * torch.randn(E, 2 * I, H)).requires_grad_()
    w_d = (0.3 * torch.randn(E, H, I)).requires_grad_()
    weights = torch.rand(T, K, requires_grad=True)
    return x, w_gu, w_d, weights, idx


def test_untimed_engine_answers_only_for_small_auto_layers_on_the_cpu(monkeypatch):
    T, H, I, E, K = SHAPE
    small, large = (T, K, H, I, E), (2048, 8, 2048, 1024, 64)
    assert registry.layer_macs(*small) > 4 * 2**20 >= registry.layer_macs(48, 2, 64, 32, 8)
    with settings.override(gemm_engine="auto"):  # the tests' conftest pins "native"
        assert registry.untimed_engine("torch", "auto", "cpu", torch.float32, small) == registry.SMALL_LAYER_ENGINE
        assert registry.whole_layer("torch", "auto", "cpu", torch.float32, small) is None  # above the padded op's
        assert registry.untimed_engine("torch", "auto", "cpu", torch.float32, large) is None
        edge = (registry.SMALL_LAYER_MACS // (3 * 64 * 64), 1, 64, 64, 8)  # the largest T within the budget
        over = (edge[0] + 1, *edge[1:])
        assert registry.layer_macs(*edge) <= registry.SMALL_LAYER_MACS < registry.layer_macs(*over)
        assert registry.untimed_engine("torch", "auto", "cpu", torch.float32, edge) == registry.SMALL_LAYER_ENGINE
        assert registry.untimed_engine("torch", "auto", "cpu", torch.float32, over) is None
        assert registry.untimed_engine("torch", "loop", "cpu", torch.float32, small) is None  # named: as named
        assert registry.untimed_engine("triton", "auto", "cpu", torch.float32, small) is None
        assert registry.untimed_engine("torch", "auto", "meta", torch.float32, small) is None
    with settings.override(gemm_engine="native"):
        assert registry.untimed_engine("torch", "auto", "cpu", torch.float32, small) is None
    # where the engine cannot run (a torch without grouped_mm), the layer times its candidates as before
    monkeypatch.setattr(registry, "unavailable_reason", lambda engine, *a: f"no {engine}")
    registry.forget_choices()
    with settings.override(gemm_engine="auto"):
        assert registry.untimed_engine("torch", "auto", "cpu", torch.float32, small) is None
    registry.forget_choices()


def _grads(out, tensors, seed=1):
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed))
    return torch.autograd.grad(out, tensors, dout)


@pytest.mark.parametrize("one_piece", [True, False])
@pytest.mark.parametrize("grad", [True, False])
def test_small_layer_runs_the_untimed_engine_with_the_reference_numbers(monkeypatch, grad, one_piece):
    """On the untimed engine (grouped_mm) a plain fp32 layer runs in one piece (``one_piece``:
    ``grouped_mm.small_layer``, or ``small_inference`` without grad; no staged launcher) or, with that switched off, as the staged chain
    on that engine's launchers; either way nothing is timed and the numbers are the reference's."""
    x, w_gu, w_d, weights, idx = _inputs(*SHAPE)
    ran: list[str] = []
    kernels = ops.kernels
    monkeypatch.setattr(ops, "kernels", lambda name: ran.append(name) or kernels(name))
    monkeypatch.setattr(timing, "time_interleaved", lambda *a, **k: pytest.fail("a small layer was timed"))
    monkeypatch.setattr(grouped_mm, "ONE_PIECE", one_piece)
    pieces: list[int] = []
    small_layer, small_inference = grouped_mm.small_layer, grouped_mm.small_inference
    monkeypatch.setattr(grouped_mm, "small_layer", lambda *a: pieces.append(1) or small_layer(*a))
    # a call no backward follows: the one-piece forward alone (grouped_mm.small_inference)
    monkeypatch.setattr(grouped_mm, "small_inference", lambda *a: pieces.append(1) or small_inference(*a))
    registry.forget_choices()
    with settings.override(gemm_engine="auto"), torch.set_grad_enabled(grad):
        out = moe_experts_forward(x, weights, idx, w_gu, w_d, gemm_engine="auto")
        got = _grads(out, (x, w_gu, w_d, weights)) if grad else ()
    if one_piece:
        assert pieces and not ran, ran  # no staged launcher at all
    else:
        assert not pieces
        assert registry.kernel_set_name("torch", registry.SMALL_LAYER_ENGINE) in ran
        others = {registry.kernel_set_name("torch", e) for e in registry.ENGINES} - {"torch"}  # "torch": stages 2-3
        assert set(ran) & others == {registry.kernel_set_name("torch", registry.SMALL_LAYER_ENGINE)}, ran
    assert not registry._WATCHES and not registry._CHOSEN  # nothing chosen by timing, nothing watched
    want = reference_experts_forward(x, weights, idx, w_gu, w_d)
    assert_close(out, want, msg="output")
    for name, g, r in zip(("dx", "dw_gate_up", "dw_down", "dweights"), got,
                          _grads(want, (x, w_gu, w_d, weights)) if grad else ()):
        assert_close(g, r, msg=name)
    if grad:
        assert not got[1][-1].any() and not got[2][-1].any()  # the expert no token chose


@pytest.mark.parametrize("T,H,I,E,K", [(7, 33, 5, 5, 3), (1, 8, 3, 4, 1), (50, 40, 70, 6, 2), (19, 16, 8, 3, 3)])
@pytest.mark.parametrize("skew", [False, True])
def test_small_layer_in_one_piece_matches_the_reference(T, H, I, E, K, skew):
    """``grouped_mm.small_layer`` on its own at awkward shapes: odd widths (H=33: operands copied
    into aligned storage), K=1 and K=E, I on both sides of the contiguous-gate threshold, every
    token on the same few experts (``skew``: empty experts, one crowded); forward and the gradients
    of the input, both weights and the routing weights against the fp32 reference."""
    g = torch.Generator().manual_seed(T * 1000 + H + skew)
    if skew:
        idx = torch.stack([torch.arange(K) + (E - K) * (t % 2) for t in range(T)])  # the first and last K only
    else:
        idx = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
    x = torch.randn(T, H, generator=g, requires_grad=True)
    w_gu = (0.3 * torch.randn(E, 2 * I, H, generator=g)).requires_grad_()
    w_d = (0.3 * torch.randn(E, H, I, generator=g)).requires_grad_()
    weights = torch.rand(K, T, generator=g).t().requires_grad_()  # non-contiguous, as a router's may be
    assert grouped_mm.small_layer_runs(x, w_gu, w_d, weights)
    out = grouped_mm.small_layer(x, w_gu, w_d, weights, idx)
    want = reference_experts_forward(x, weights, idx, w_gu, w_d)
    assert_close(out, want, msg="output")
    tensors = (x, w_gu, w_d, weights)
    for name, a, b in zip(("dx", "dw_gate_up", "dw_down", "dweights"), _grads(out, tensors), _grads(want, tensors)):
        assert a.shape == b.shape, name
        assert_close(a, b, msg=name)


def test_small_layer_in_one_piece_with_frozen_weights_and_where_it_does_not_run():
    """Only the gradients asked for (frozen weights: the input's and the router's), the reference's;
    a bf16 layer or a traced call (a dispatch mode) is not taken; through ``moe_experts_forward`` an
    id outside the experts still raises (the staged chain's check)."""
    T, H, I, E, K = 40, 24, 12, 4, 2
    x, w_gu, w_d, weights, idx = _inputs(T, H, I, E, K)
    w_gu, w_d = w_gu.detach(), w_d.detach()
    out = grouped_mm.small_layer(x, w_gu, w_d, weights, idx)
    want = reference_experts_forward(x, weights, idx, w_gu, w_d)
    for name, a, b in zip(("dx", "dweights"), _grads(out, (x, weights)), _grads(want, (x, weights))):
        assert_close(a, b, msg=name)
    assert not grouped_mm.small_layer_runs(x.bfloat16(), w_gu.bfloat16(), w_d.bfloat16(), weights.bfloat16())
    from torch.utils._python_dispatch import TorchDispatchMode

    class Seen(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    with Seen():
        assert not grouped_mm.small_layer_runs(x, w_gu, w_d, weights)
    bad = idx.clone()
    bad[3, 1] = E + 2
    with settings.override(gemm_engine="auto"), pytest.raises((ValueError, IndexError, RuntimeError)):
        moe_experts_forward(x, weights, bad, w_gu, w_d, gemm_engine="auto",
                            check_ids=lambda ids: (_ for _ in ()).throw(ValueError("id outside")))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_small_inference_declines_ids_outside_the_experts(dtype, monkeypatch):
    """``small_inference`` finds an id outside ``[0, NR)`` from its own count of rows per expert (no
    check of its own): None for an id past the last expert and for a negative one, before any GEMM;
    in-range ids give the reference's numbers (T=5, K=3: not a multiple of anything)."""
    T, H, I, E, K = 5, 24, 16, 4, 3
    x, w_gu, w_d, weights, idx = (t.detach() for t in _inputs(T, H, I, E, K))
    x, w_gu, w_d, weights = (t.to(dtype) for t in (x, w_gu, w_d, weights))
    gemms = []
    real = grouped_mm._gmm
    monkeypatch.setattr(grouped_mm, "_gmm", lambda *a: gemms.append(1) or real(*a))
    with torch.no_grad():
        for bad in (E, E + 7, -1):
            wrong = idx.clone()
            wrong[2, 1] = bad
            assert grouped_mm.small_inference(x, w_gu, w_d, weights, wrong) is None, bad
        assert not gemms
        got = grouped_mm.small_inference(x, w_gu, w_d, weights, idx)
    assert gemms and got is not None
    want = reference_experts_forward(x.float(), weights.float(), idx, w_gu.float(), w_d.float())
    assert_close(got, want, dtype=dtype)


def test_small_layer_with_lora_runs_the_untimed_engine_with_the_reference_numbers(monkeypatch):
    """A layer with per-expert LoRA adapters in the same size range: the staged LoRA chain on the
    untimed engine, nothing timed; output and gradients (input, router weights, every adapter) are
    the reference's."""
    from fastmoe_xpu.autograd.lora_ops import ExpertsLora, LoraWeights
    from fastmoe_xpu.reference import reference_lora_experts_forward

    T, H, I, E, K = SHAPE
    x, w_gu, w_d, weights, idx = _inputs(*SHAPE)
    w_gu, w_d = w_gu.detach(), w_d.detach()  # frozen base weights
    g = torch.Generator().manual_seed(3)
    ad = lambda *s: (0.3 * torch.randn(*s, generator=g)).requires_grad_()  # noqa: E731
    lg, ld = (ad(E, 5, H), ad(E, 2 * I, 5), 0.75), (ad(E, 5, I), ad(E, H, 5), 2.0)
    ran: list[str] = []
    kernels = ops.kernels
    monkeypatch.setattr(ops, "kernels", lambda name: ran.append(name) or kernels(name))
    monkeypatch.setattr(timing, "time_interleaved", lambda *a, **k: pytest.fail("a small layer was timed"))
    registry.forget_choices()
    with settings.override(gemm_engine="auto"):
        out = moe_experts_forward(x, weights, idx, w_gu, w_d, gemm_engine="auto",
                                  lora=ExpertsLora(LoraWeights(*lg), LoraWeights(*ld)))
    assert registry.kernel_set_name("torch", registry.SMALL_LAYER_ENGINE) in ran and not registry._WATCHES
    ref = reference_lora_experts_forward(x, weights, idx, w_gu, w_d, lg, ld)
    assert_close(out, ref, msg="forward")
    inputs = [x, weights, *lg[:2], *ld[:2]]
    for name, a, b in zip(("dx", "dweights", "A1", "B1", "A2", "B2"), _grads(out, inputs), _grads(ref, inputs)):
        assert_close(a, b, msg=name)


def test_a_call_without_backward_takes_grouped_mm_untimed_up_to_the_inference_bound():
    """A prefill in generation (no backward) up to ``SMALL_INFERENCE_MACS`` takes the engine untimed;
    the same layer with a backward is timed; past the bound both are."""
    mid = (64, 8, 512, 256, 32)  # 192 Mi: a small model's batch-4 prefill
    over = (512, 8, 512, 256, 32)  # 1.5 Gi
    assert registry.SMALL_LAYER_MACS < registry.layer_macs(*mid) <= registry.SMALL_INFERENCE_MACS
    assert registry.layer_macs(*over) > registry.SMALL_INFERENCE_MACS
    _untimed_below_and_above(mid, over, "loop")


def _untimed_below_and_above(inside: tuple, outside: tuple, named: str) -> None:
    """``inside`` without a backward takes grouped_mm untimed, with one it is timed; ``outside`` (without
    a backward) and a named engine are timed."""
    with settings.override(gemm_engine="auto"):
        def untimed(shape: tuple, inference: bool, engine: str = "auto") -> str | None:
            return registry.untimed_engine("torch", engine, "cpu", torch.float32, shape, inference=inference)

        assert untimed(inside, True) == "grouped_mm"
        assert untimed(inside, False) is None
        assert untimed(outside, True) is None
        assert untimed(inside, True, named) is None


def test_a_call_without_backward_of_few_rows_per_expert_is_untimed_at_any_size():
    """A decode step or a short prompt's prefill (at most ``INFERENCE_ROWS_PER_EXPERT`` routed rows per
    local expert, no backward) takes the engine untimed however large the layer; one more row per
    expert, or a backward, is timed."""
    olmoe = (16, 8, 2048, 1024, 64)  # 128 rows over 64 experts: 805 Mi
    more = (24, 8, 2048, 1024, 64)  # three rows per expert
    assert registry.layer_macs(*olmoe) > registry.SMALL_INFERENCE_MACS
    assert 16 * 8 == registry.INFERENCE_ROWS_PER_EXPERT * 64
    _untimed_below_and_above(olmoe, more, "onednn")
