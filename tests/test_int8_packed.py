"""int8 expert GEMMs on oneDNN-packed weights (AMX int8) inside ``frozen_weights``: the same outputs as
``torch._int_mm``'s path and the plain-PyTorch reference (``fastmoe_xpu/kernels/quantized/reference.py``)
at awkward shapes, packing only inside the context and after :data:`core.PACK_AFTER_USES` uses, the
packs dropped with changed weights, and the plain path wherever the packed one is unavailable."""
from __future__ import annotations

import pytest
import torch

from fastmoe_xpu.autograd.moe_experts import moe_experts_forward
from fastmoe_xpu.kernels import kernels
from fastmoe_xpu.kernels.quantized import core
from fastmoe_xpu.kernels.quantized import reference as qref
from fastmoe_xpu.routing import topk_routing
from tests.tolerances import assert_close

# (T, H, I, E, K): odd widths (K and N not multiples of 4 or 16), a single token, experts left empty.
SHAPES = [(37, 33, 20, 7, 3), (1, 12, 10, 4, 2), (6, 40, 17, 9, 2)]


def _needs_packs(monkeypatch) -> None:  # noqa: ANN001
    monkeypatch.setattr(core, "PACK_MIN_ELEMENTS", 1)  # these awkward shapes are far below the size packed
    if not core.amx_int8_linear():
        pytest.skip("no AMX int8 linear here (core.amx_int8_linear): the plain path is checked by "
                    "test_plain_path_where_packing_is_unavailable")


def _case(T, H, I, E, K, seed=0):  # noqa: ANN001, ANN202, E741
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=g)
    weights, idx = topk_routing(torch.randn(T, E, generator=g), K, True)
    return x, weights, idx, torch.randn(E, 2 * I, H, generator=g) * 0.3, torch.randn(E, H, I, generator=g) * 0.3


def _forward(x, weights, idx, w_gu, w_d, calls=3):  # noqa: ANN001, ANN202
    """The int8 experts op ``calls`` times inside ``frozen_weights`` (no grad): every output."""
    with torch.no_grad(), core.frozen_weights():
        return [moe_experts_forward(x, weights, idx, w_gu, w_d, backend="torch", expert_precision="int8")
                for _ in range(calls)]


def _packed_experts() -> set[int]:
    return {e for entry in core._WEIGHTS.values() if entry.qw.packs is not None for e in entry.qw.packs.packed}


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "T{}-H{}-I{}-E{}-K{}".format(*s))
def test_packed_forward_equals_int_mm_and_reference(monkeypatch, shape):
    _needs_packs(monkeypatch)
    x, weights, idx, w_gu, w_d = _case(*shape)
    want = qref.moe_forward_backward(x, weights, idx, w_gu, w_d, torch.zeros_like(x), "int8")[0]
    core.forget_weights()
    monkeypatch.setattr(core, "PACK_AFTER_USES", 10**9)
    plain = _forward(x, weights, idx, w_gu, w_d)
    assert not _packed_experts()
    core.forget_weights()
    monkeypatch.setattr(core, "PACK_AFTER_USES", 1)  # packed at each expert's second use
    outs = _forward(x, weights, idx, w_gu, w_d)
    assert _packed_experts() == set(idx.unique().tolist())
    for i, out in enumerate(outs):
        assert torch.equal(out, plain[i]), f"call {i}: the packed path's output differs from torch._int_mm's"
        assert_close(out, want, msg=f"call {i} against the reference")
    core.forget_weights()


@pytest.mark.parametrize("transposed", [False, True], ids=["stored", "transposed"])
def test_packed_down_launcher_per_expert(monkeypatch, transposed):
    """``down_fwd`` in both weight layouts against :func:`qref.qlinear` per expert, some experts packed
    and some not in one call (experts reach the threshold at different calls)."""
    _needs_packs(monkeypatch)
    g = torch.Generator().manual_seed(3)
    counts = [5, 0, 19, 1, 3]
    cum = torch.tensor([0, *torch.tensor(counts).cumsum(0).tolist()], dtype=torch.int32)
    a = torch.randn(sum(counts), 11, generator=g)
    w = torch.randn(5, 13, 11, generator=g)  # [NR, O, In]
    stored = w.transpose(1, 2).contiguous() if transposed else w
    ks = kernels("torch+int8")
    core.forget_weights()
    monkeypatch.setattr(core, "PACK_AFTER_USES", 0)
    with torch.no_grad(), core.frozen_weights():
        qw = core.quantized_weight(stored, torch.int8, transposed)
        qw.packs.uses[3] = -5  # expert 3 packs later than the others
        y = ks.down_fwd(a, cum, stored, transposed=transposed)
        assert set(qw.packs.packed) == {0, 2, 4}
    for e in range(5):
        s, t = int(cum[e]), int(cum[e + 1])
        if s < t:
            assert_close(y[s:t], qref.qlinear(a[s:t], w[e], "int8"), msg=f"expert {e}")
    core.forget_weights()


def test_packs_only_inside_frozen_weights_and_dropped_with_changed_weights(monkeypatch):
    _needs_packs(monkeypatch)
    x, weights, idx, w_gu, w_d = _case(9, 16, 8, 5, 2)
    core.forget_weights()
    monkeypatch.setattr(core, "PACK_AFTER_USES", 0)
    with torch.no_grad():  # outside the context: the codes are made per call and nothing is packed
        moe_experts_forward(x, weights, idx, w_gu, w_d, backend="torch", expert_precision="int8")
    assert not _packed_experts()
    before = _forward(x, weights, idx, w_gu, w_d, calls=1)[0]
    assert _packed_experts()
    with torch.no_grad():
        w_gu.mul_(-1.5)  # an update in place: new codes, no packs of the old ones
        entry = core._WEIGHTS[id(w_gu)]
    after = _forward(x, weights, idx, w_gu, w_d, calls=1)[0]
    assert core._WEIGHTS[id(w_gu)].qw is not entry.qw and not torch.equal(after, before)
    assert_close(after, qref.moe_forward_backward(x, weights, idx, w_gu, w_d, torch.zeros_like(x), "int8")[0])
    core.forget_weights()


def test_plain_path_where_packing_is_unavailable(monkeypatch):
    """Where :func:`core.amx_int8_linear` says no (no AMX, no oneDNN op), the weights carry no packs and
    the forward is ``torch._int_mm``'s, held to the reference."""
    monkeypatch.setattr(core, "amx_int8_linear", lambda: False)
    monkeypatch.setattr(core, "PACK_AFTER_USES", 0)
    x, weights, idx, w_gu, w_d = _case(*SHAPES[0])
    core.forget_weights()
    outs = _forward(x, weights, idx, w_gu, w_d, calls=2)
    assert all(entry.qw.packs is None for entry in core._WEIGHTS.values())
    want = qref.moe_forward_backward(x, weights, idx, w_gu, w_d, torch.zeros_like(x), "int8")[0]
    for out in outs:
        assert_close(out, want, msg="plain path against the reference")
    core.forget_weights()


def test_small_expert_matrices_are_never_packed(monkeypatch):
    """Below :data:`core.PACK_MIN_ELEMENTS` per expert matrix (where oneDNN's quantized linear took
    milliseconds for one row against microseconds for ``torch._int_mm``) the weights carry no packs,
    however often they are used."""
    monkeypatch.setattr(core, "PACK_AFTER_USES", 0)
    x, weights, idx, w_gu, w_d = _case(*SHAPES[0])
    assert w_gu[0].numel() < core.PACK_MIN_ELEMENTS
    core.forget_weights()
    _forward(x, weights, idx, w_gu, w_d, calls=2)
    assert core._WEIGHTS and all(entry.qw.packs is None for entry in core._WEIGHTS.values())
    core.forget_weights()
