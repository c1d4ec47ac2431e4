"""Helpers shared by the trainer tests: a small config, one-thread and data-cache fixtures, and the
weight comparison every layout test uses.

fp32: any layout equals one process. Losses to 1e-5 relative. Weights: every tensor to 1e-5 relative
in norm, and every element to 1e-5 absolute (weights are ~0.02-1; one wrong update moves an element
by ~lr = 3e-3). A plain elementwise rtol would fail on the rare element whose gradient is ~0: Adam
divides it by its own tiny second moment, so summation-order rounding of ~1e-10 becomes ~1e-6.
"""
from __future__ import annotations

import pytest
import torch

from trainer.config import TrainConfig
from trainer.config.presets import get_preset

RTOL, ATOL = 1e-5, 1e-5


@pytest.fixture(autouse=True)
def one_thread():
    # the suite shares two cores; one intra-op thread avoids oversubscription stalls
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


@pytest.fixture(scope="module")
def data_cache(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("data_cache"))


def small_cfg(data_cache: str, out: str, preset: str = "tiny-moe", steps: int = 6, **over) -> TrainConfig:
    """``steps`` steps of 8 instances x 16 tokens, 4 micro-batches of 2, clipping active from step 2;
    ``section__name=value`` overrides any field."""
    cfg = get_preset(preset)
    cfg.data.context = 16
    cfg.data.cache_dir = data_cache
    cfg.schedule.steps, cfg.schedule.global_batch, cfg.schedule.micro_batch = steps, 8, 2
    cfg.schedule.warmup_steps = 2
    cfg.optim.grad_clip = 0.5
    cfg.logging.out = out
    cfg.logging.progress = cfg.logging.plot = cfg.logging.tensorboard = False
    cfg.logging.peak_tflops = 1.0  # skip the matmul measurement
    for key, value in over.items():
        section, name = key.split("__")
        setattr(getattr(cfg, section), name, value)
    return cfg


def assert_states_close(a: dict, b: dict, rtol: float = RTOL, atol: float = ATOL) -> None:
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=rtol, atol=atol, msg=lambda m, k=k: f"{k}: {m}")
        if a[k].dtype.is_floating_point and b[k].norm() > 0:
            rel = float((a[k].double() - b[k].double()).norm() / b[k].double().norm())
            assert rel <= rtol, f"{k}: relative difference {rel:.2e} in norm"
