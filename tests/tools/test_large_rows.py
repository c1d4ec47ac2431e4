"""The large-rows check (``python -m fastmoe_xpu.tools.large_rows``) at a small shape on the CPU.

On a GPU it runs a layer whose ``gate_up`` buffer passes 2^31 elements; here the same code runs the
Triton kernels under the interpreter at a toy shape (fp32: the interpreter has no bf16 arithmetic),
and a planted wrong row shows that its comparison fails when a row is wrong.
"""
from __future__ import annotations

import pytest
import torch

from fastmoe_xpu.kernels import registry
from fastmoe_xpu.tools import large_rows


def test_small_triton_layer_matches_the_torch_backend_under_the_interpreter():
    if not registry.triton_interpreting():
        pytest.skip("Triton kernels on CPU tensors need TRITON_INTERPRET=1 (this run compiles for a GPU)")
    report = large_rows.run(23, 3, 4, 16, 8, device="cpu", dtype="fp32", engines=("triton",), samples=12,
                            progress=lambda s: None)
    assert report["ok"], report
    assert report["rows"] == 69 and report["gate_up_elements"] == 69 * 16 and not report["past_int32"]
    (res,) = report["engines"]
    assert res["engine"] == "triton" and res["finite"]
    assert set(res["errors"]) == {"out", "dx", "dweights"}
    assert all(res["errors"][k] <= res["bounds"][k] for k in res["errors"])
    assert set(res["weight_grad_rel"]) == {"dw_gate_up", "dw_down"}
    assert all(res["weight_grad_rel"][k] <= res["weight_grad_bounds"][k] for k in res["weight_grad_rel"])
    assert set(report["torch_weight_grad_rel"]) == {"dw_gate_up", "dw_down"}


def test_the_default_shape_passes_two_to_the_31():
    s = large_rows.DEFAULT_SHAPE
    assert (s["tokens"], s["top_k"], s["experts"], s["hidden"], s["intermediate"]) == (140_000, 8, 16, 512, 1024)
    assert s["tokens"] * s["top_k"] * 2 * s["intermediate"] > 2**31 > s["tokens"] * s["top_k"] * s["intermediate"]


def test_sample_holds_the_highest_rows():
    """The sample holds the last tokens routed to the last expert (whose rows are the highest of every
    row buffer), tokens of expert 0, and the batch's first and last tokens."""
    inputs = large_rows.make_inputs(200, 2, 5, 8, 4, torch.float32, torch.device("cpu"))
    idx = inputs["idx"]
    picked = set(large_rows.sample_tokens(idx, 5, 40).tolist())
    last_expert = torch.nonzero((idx == 4).any(-1)).flatten().tolist()
    assert set(last_expert[-10:]) <= picked
    assert torch.nonzero((idx == 0).any(-1)).flatten()[0].item() in picked
    assert {0, 199} <= picked and len(picked) <= 40


def test_a_wrong_row_or_a_nan_fails_the_check(monkeypatch):
    """With the engine's results replaced by the torch backend's plus one wrong row (the highest row's
    token) or one NaN in a weight gradient, the check fails; unchanged, it passes. No Triton kernel
    runs: the planted engine is the torch backend."""
    inputs = large_rows.make_inputs(40, 2, 4, 8, 4, torch.float32, torch.device("cpu"))
    tokens = large_rows.sample_tokens(inputs["idx"], 4, 16)
    reference = large_rows.weight_grad_reference(inputs)
    assert all(v < 1e-6 for v in reference["native_rel"].values())  # fp32 inputs: the same computation
    layer = large_rows._layer
    plant = {}

    def planted(inputs_, backend, engine, tokens_=None):
        got = layer(inputs_, "torch", "native", tokens_)
        if backend == "triton" and plant:
            got[plant["name"]].view(-1)[plant["at"]] += plant["by"]
        return got

    monkeypatch.setattr(large_rows, "_layer", planted)
    assert large_rows.check_engine(inputs, "planted", tokens, True, reference).ok
    row = int(tokens[-1])
    plant.update(name="out", at=row * 8, by=1.0)
    res = large_rows.check_engine(inputs, "planted", tokens, True, reference)
    assert not res.ok and res.finite and res.errors["out"] > res.bounds["out"]
    # a weight gradient off the fp32 reference by more than 1e-2 (and than the torch backend's own error)
    plant.update(name="dw_down", at=3, by=1.0)
    res = large_rows.check_engine(inputs, "planted", tokens, True, reference)
    assert not res.ok and res.finite and res.weight_grad_rel["dw_down"] > res.weight_grad_bounds["dw_down"] == 1e-5
    plant.update(name="dw_down", at=3, by=float("nan"))
    res = large_rows.check_engine(inputs, "planted", tokens, True, reference)
    assert not res.ok and not res.finite
