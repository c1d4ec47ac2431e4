"""MFU: stated peaks of the known accelerators, a CPU peak measured robustly (best call of one
thread x threads, never below a floor), and never an MFU above 1."""
from __future__ import annotations

import time
import types

import pytest
import torch

from trainer.records import metrics
from trainer.records.metrics import (CPU_FLOOR_TFLOPS_PER_THREAD, MfuMeter, device_peak_tflops,
                                     measure_matmul_tflops, stated_peak_tflops)
from trainer_util import data_cache, one_thread, small_cfg  # noqa: F401 (fixtures)


@pytest.mark.parametrize("name, eus, peak", [
    ("NVIDIA H100 80GB HBM3", None, 989.4),      # SXM
    ("NVIDIA H100 PCIe", None, 756.0),
    ("NVIDIA H100 NVL", None, 835.0),
    ("NVIDIA H200", None, 989.4),
    ("NVIDIA H200 NVL", None, 835.0),
    ("NVIDIA GH200 480GB", None, 989.4),
    ("AMD Instinct MI300X", None, 1307.4),
    ("AMD Instinct MI300X VF", None, 1307.4),
    ("Intel(R) Data Center GPU Max 1550", 512, 419.4),   # one tile (FLAT mode): 64 Xe cores at 1.6 GHz
    ("Intel(R) Data Center GPU Max 1550", 1024, 838.9),  # the whole card (COMPOSITE mode)
    ("Intel(R) Data Center GPU Max 1550", None, 419.4),  # no properties: a tile
    ("Intel(R) Data Center GPU Max 1100", 448, 355.5),
    ("NVIDIA GeForce RTX 4090", None, None),
])
def test_stated_peaks_of_known_devices(name, eus, peak):
    props = types.SimpleNamespace(gpu_eu_count=eus) if eus else None
    assert stated_peak_tflops(name, props) == peak


def test_a_known_gpu_uses_its_stated_peak_and_an_unknown_one_is_measured(monkeypatch):
    fake = types.SimpleNamespace(get_device_name=lambda d: "NVIDIA H200",
                                 get_device_properties=lambda d: types.SimpleNamespace(),
                                 synchronize=lambda: None)
    monkeypatch.setattr(torch, "cuda", fake)
    peak, source = device_peak_tflops(torch.device("cuda"))
    assert peak == 989.4 and source == "stated bf16 peak (NVIDIA H200)"
    assert device_peak_tflops(torch.device("cuda"), override=123.0) == (123.0, "configured")
    fake.get_device_name = lambda d: "Some New GPU"
    monkeypatch.setattr(metrics, "measure_matmul_tflops", lambda device: 42.0)
    assert device_peak_tflops(torch.device("cuda")) == (42.0, "measured bf16 matmul (Some New GPU)")


def test_best_call_is_taken_over_the_rounds():
    # calls of 20 ms, one of 1 ms among them: the best is the 1 ms one, not an average
    durations = iter([0.0, 0.02, 0.02, 0.001] + [0.02] * 1000)
    best = metrics._best_call_seconds(lambda: time.sleep(next(durations)), lambda: None, rounds=2, seconds=0.05)
    assert 0.0009 <= best < 0.01


def test_cpu_peak_is_one_threads_best_times_the_threads_and_never_below_the_floor(monkeypatch):
    threads = torch.get_num_threads()
    seen = []
    monkeypatch.setattr(metrics, "_best_call_seconds",
                        lambda fn, sync, rounds, seconds: seen.append(torch.get_num_threads()) or 1e-3)
    torch.set_num_threads(3)
    try:
        # n = 256: 2 * 256**3 FLOP in 1 ms is 0.0336 TFLOP/s for one thread, times 3 threads
        assert measure_matmul_tflops(torch.device("cpu")) == pytest.approx(3 * 2 * 256 ** 3 / 1e-3 / 1e12)
        assert seen == [1] and torch.get_num_threads() == 3  # measured on one thread, the setting restored
        # a machine so loaded that the best call took a second: the floor, not 3e-5 TFLOP/s
        monkeypatch.setattr(metrics, "_best_call_seconds", lambda fn, sync, rounds, seconds: 1.0)
        assert measure_matmul_tflops(torch.device("cpu")) == pytest.approx(3 * CPU_FLOOR_TFLOPS_PER_THREAD)
    finally:
        torch.set_num_threads(threads)
    # the real measurement, on this machine: at least the floor, and a plausible CPU
    peak, source = device_peak_tflops(torch.device("cpu"))
    assert threads * CPU_FLOOR_TFLOPS_PER_THREAD <= peak < threads * 10 and source.startswith("measured fp32")


def test_mfu_is_never_above_one():
    said = []
    flops_per_token, world = 1e6, 2
    # a measured peak below what a step achieves: the peak is raised to the step's rate, once said
    m = MfuMeter(1.0, "measured fp32 matmul", flops_per_token, world, warn=said.append)
    assert m(1e6) == pytest.approx(0.5)   # 1e12 FLOP/s over 2 devices = 0.5 TFLOP/s each
    assert m(4e6) == 1.0 and m.peak_tflops == pytest.approx(2.0)
    assert m(2e6) == pytest.approx(0.5)   # now relative to the rate the run has shown
    assert m(8e6) == 1.0 and len(said) == 1 and "the peak is raised to it" in said[0]
    # a stated or configured peak is kept; the step counts as 1 and the line says what to do
    said.clear()
    m = MfuMeter(1.0, "configured", flops_per_token, world, warn=said.append)
    assert [m(x) for x in (1e6, 4e6, 8e6)] == [pytest.approx(0.5), 1.0, 1.0] and m.peak_tflops == 1.0
    assert len(said) == 1 and "--logging.peak_tflops" in said[0]


def test_trainer_records_never_show_mfu_above_one(tmp_path, data_cache, capsys):  # noqa: F811
    from trainer.trainer import Trainer

    # a configured peak far below what any step reaches
    hist = Trainer(small_cfg(data_cache, str(tmp_path / "run"), steps=3, logging__peak_tflops=1e-9,
                             eval__enabled=False)).fit()
    assert [r["mfu"] for r in hist] == [1.0, 1.0, 1.0]
    assert capsys.readouterr().out.count("mfu: a step ran at") == 1
    # the default: the CPU peak measured; every step well below it
    hist = Trainer(small_cfg(data_cache, str(tmp_path / "run2"), steps=2, logging__peak_tflops=0.0,
                             eval__enabled=False)).fit()
    assert all(0 < r["mfu"] < 1 for r in hist)
