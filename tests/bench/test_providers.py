"""``pytest tests/bench``: the benchmark's cases through pytest-benchmark, at the tiny presets (fast).

Each case is built by the same setup factory as ``python -m bench``; each provider's result is
checked against hf_v4 before it is timed, so a fast wrong provider fails instead of winning.
"""
from __future__ import annotations

import pytest
import torch

# the timing half of every test is the pytest-benchmark fixture; without the plugin nothing here can run
pytest.importorskip("pytest_benchmark", reason="pytest-benchmark is not installed (pip install -e .[test])")

from bench.harness.cases import make_case  # noqa: E402
from bench.harness.measure import compare, timed_call  # noqa: E402
from bench.harness.presets import PRESETS  # noqa: E402
from bench.harness.providers import ALL_PROVIDERS, REFERENCE, ProviderSkipped, build_provider  # noqa: E402

PRESET_NAMES = ["tiny", "tiny-ep"]


@pytest.fixture(scope="module", params=PRESET_NAMES)
def case_and_ref(request):
    case = make_case(PRESETS[request.param], dtype="fp32", device="cpu", seed=0)
    ref = build_provider(REFERENCE, case)
    _, _, got = timed_call(ref, case, backward=True, capture=True)
    return case, got


@pytest.mark.parametrize("mode", ["fwd", "fwdbwd"])
@pytest.mark.parametrize("name", ALL_PROVIDERS)
def test_provider(benchmark, case_and_ref, name, mode):
    case, ref = case_and_ref
    try:
        prov = build_provider(name, case)
    except ProviderSkipped as exc:
        pytest.skip(str(exc))
    backward = mode == "fwdbwd"
    _, _, got = timed_call(prov, case, backward=backward, capture=True)
    check = compare(got, ref, case.dtype)
    assert check["ok"], check
    benchmark.group = f"{case.preset.name}-{mode}"
    benchmark.extra_info.update(preset=case.preset.name, rows=case.rows, flops=case.flops()[mode])
    torch.set_grad_enabled(True)
    benchmark.pedantic(timed_call, args=(prov, case), kwargs={"backward": backward}, rounds=3, iterations=1,
                       warmup_rounds=1)
