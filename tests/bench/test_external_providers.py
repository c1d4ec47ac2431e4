"""The other projects' MoE layers in the benchmark (``liger``, ``sonicmoe``): fed the case's routing and
weights, checked against the fp32 reference the shape set uses, and refused in one line where they cannot
run. Liger's kernels run under the Triton interpreter on CPU tensors here (the suite's setting), with its
one pinned config."""
from __future__ import annotations

import os

import pytest
import torch

from bench.harness.cases import make_case
from bench.harness.measure import compare, timed_call
from bench.harness.presets import Preset
from bench.harness.providers import EXTERNAL_PROVIDERS, ProviderSkipped, build_provider, expand_names
from bench.studies.practitioners import fp32_reference

# T=37 tokens over E=7 experts, H and I neither a power of two nor a multiple of the kernels' tiles.
AWKWARD = Preset("awkward", 33, 21, 7, 3, 37, 1, "awkward shape for the provider tests")
SLICE = Preset("slice", 32, 16, 8, 2, 12, 2, "a rank's slice (EP=2)")


def test_external_providers_are_named_on_request():
    assert expand_names(["liger", "sonicmoe"])[1:] == ["liger", "sonicmoe"]
    assert not set(EXTERNAL_PROVIDERS) & set(expand_names(None))
    with pytest.raises(ValueError, match="liger"):
        expand_names(["ligr"])


@pytest.mark.interpreter
def test_liger_matches_the_fp32_reference_with_gradients():
    pytest.importorskip("liger_kernel", reason="liger-kernel is not installed (pip install -e .[bench])")
    if os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
        pytest.skip("Liger's kernels on CPU tensors need TRITON_INTERPRET=1 (the suite sets it on the CPU)")
    case = make_case(AWKWARD, dtype="fp32", device="cpu", seed=3)
    ref = fp32_reference(case)
    prov = build_provider("liger", case)
    assert "pinned config" in prov.note
    _, _, got = timed_call(prov, case, backward=True, capture=True)
    check = compare(got, ref, torch.float32)
    assert set(check["max_rel_error"]) == {"out", "dx", "dweights", "dw_gate_up", "dw_down"}
    assert check["ok"], check
    # a wrong layer is caught: the same check fails when the down projection is perturbed
    with torch.no_grad():
        case.w_down_NHI[2, 5, 7] += 0.5
    _, _, bad = timed_call(prov, case, backward=True, capture=True)
    assert not compare(bad, ref, torch.float32)["ok"]


@pytest.mark.parametrize("name", EXTERNAL_PROVIDERS)
def test_a_rank_slice_is_refused_in_one_line(name):
    case = make_case(SLICE, dtype="fp32", device="cpu", seed=0)
    with pytest.raises(ProviderSkipped, match=r"one rank's slice \(4 of 8 experts, EP=2\)") as err:
        build_provider(name, case)
    assert "\n" not in str(err.value)


def test_sonicmoe_off_nvidia_says_why():
    case = make_case(AWKWARD, dtype="fp32", device="cpu", seed=0)
    with pytest.raises(ProviderSkipped, match="Hopper and Blackwell GPUs only, not on cpu"):
        build_provider("sonicmoe", case)


def test_liger_on_the_cpu_without_the_interpreter_says_why(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    case = make_case(AWKWARD, dtype="fp32", device="cpu", seed=0)
    with pytest.raises(ProviderSkipped, match="TRITON_INTERPRET=1"):
        build_provider("liger", case)
