"""Triton config choice for the grouped GEMMs (kernels/triton/autotune.py): the fastest config of
``configs.py``'s list under an injected timer, once per (N, K, rows-per-expert bucket), only on
GPUs, and every candidate one the sm_90 / gfx942 / PVC compile gates build."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from fastmoe_xpu.kernels import configs  # noqa: E402
from fastmoe_xpu.kernels.triton import autotune  # noqa: E402
from fastmoe_xpu.tools.kernel_specs import kernel_specs  # noqa: E402

GEMMS = ("gate_up_fwd", "grouped_mm_fwd", "grouped_mm_bwd")


@pytest.fixture(autouse=True)
def _fresh():
    autotune._CHOSEN.clear()
    yield
    autotune._CHOSEN.clear()


def _fake(seconds: dict[str, float], fails: tuple[str, ...] = ()):
    launched: list[str] = []

    def launch(cfg):
        launched.append(cfg.name)
        if cfg.name in fails:
            raise RuntimeError("out of resource: shared memory")

    def timer(run):
        run()
        return seconds[launched[-1]]

    return launch, timer, launched


def test_select_takes_the_fastest_and_skips_configs_that_fail():
    cands = configs.configs("cuda", "grouped_mm_fwd")
    first, second = cands[0].name, cands[1].name
    launch, timer, _ = _fake({first: 2.0, second: 1.0})
    assert autotune.select(cands, launch, timer).name == second
    launch, timer, _ = _fake({first: 2.0, second: 1.0}, fails=(second,))
    assert autotune.select(cands, launch, timer).name == first
    launch, timer, _ = _fake({first: 1.0, second: 1.0}, fails=(first, second))
    with pytest.raises(RuntimeError, match="no Triton config launched"):
        autotune.select(cands, launch, timer)


def test_choice_is_keyed_on_n_k_and_the_rows_per_expert_bucket():
    cands = configs.configs("cuda", "gate_up_fwd")
    times = {cands[0].name: 3.0, cands[1].name: 1.0}
    launch, timer, launched = _fake(times)
    gpu = torch.device("cuda")  # never touched: the launch and the timer are fakes
    pick = lambda n, k, rows: autotune.choose("gate_up_fwd", "cuda", n, k, rows, 8, gpu, launch, timer)  # noqa: E731
    assert pick(1024, 2048, 2048).name == cands[1].name and len(launched) == 2
    assert pick(1024, 2048, 1500).name == cands[1].name and len(launched) == 2  # same bucket (256 rows/expert)
    times[cands[0].name] = 0.5
    assert pick(1024, 2048, 4096).name == cands[0].name and len(launched) == 4  # next bucket: timed again
    assert pick(512, 2048, 2048).name == cands[0].name and len(launched) == 6  # other N
    assert autotune.rows_per_expert_bucket(2048, 8) == 256 and autotune.rows_per_expert_bucket(2049, 8) == 512
    assert len(autotune.chosen()) == 3


def test_no_timing_on_the_cpu_or_the_interpreter_table():
    def launch(cfg):
        pytest.fail("not launched for timing")

    for table, dev in (("cuda", "cpu"), ("interpreter", "cuda")):
        cfg = autotune.choose("grouped_mm_bwd", table, 64, 64, 512, 4, torch.device(dev), launch)
        assert cfg == configs.configs(table, "grouped_mm_bwd")[0]


@pytest.mark.parametrize("target", ["cuda", "sm100", "hip", "xpu"])
def test_every_candidate_is_in_the_compile_gate(target):
    built = {(s.name.split("[")[0], s.config_name) for s in kernel_specs(target)}
    for kernel in GEMMS:
        for cfg in configs.configs(target, kernel):
            assert (kernel, cfg.name) in built, (target, kernel, cfg.name)
