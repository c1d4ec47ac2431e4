"""bench: each grouped-GEMM engine as its own provider (fastmoe/<backend>@<engine>), and the plain
provider's auto choice named in its note."""
from __future__ import annotations

import pytest
import torch

from bench.cases import make_case
from bench.presets import PRESETS, Preset
from bench.providers import ProviderSkipped, build_provider, expand_names
from fastmoe_xpu import settings
from fastmoe_xpu.kernels import registry
from tolerances import assert_close


def test_engine_provider_names():
    assert expand_names(["fastmoe/torch@grouped_mm", "fastmoe/torch@loop"]) == [
        "hf_v4", "fastmoe/torch@grouped_mm", "fastmoe/torch@loop"]
    with pytest.raises(ValueError, match="engine providers"):
        expand_names(["fastmoe/torch@cutlass"])


def test_each_engine_computes_the_same_layer_and_auto_is_named(tmp_path):
    case = make_case(PRESETS["tiny"], dtype="fp32", device="cpu", seed=0)
    outs = {}
    for name in ("fastmoe/torch@loop", "fastmoe/torch@grouped_mm"):
        p = build_provider(name, case)
        assert name.split("@")[1] + " GEMM engine" in p.note
        outs[name] = p.forward(case.x_TH, case.weights_TK, case.topk_idx_TK).detach()
    assert_close(outs["fastmoe/torch@grouped_mm"], outs["fastmoe/torch@loop"])
    registry.forget_choices()
    # Above the small-layer budget auto times the engines and the note names the one it took; the
    # tiny preset is under it, and the note says that the whole layer ran as one op instead.
    wider = make_case(Preset("wider", 256, 128, 8, 2, 96, 1, "above the padded budget"), dtype="fp32", device="cpu",
                      seed=0)
    with settings.override(gemm_engine=None, gemm_cache=str(tmp_path / "c.json")):
        auto = build_provider("fastmoe/torch", wider)
        small = build_provider("fastmoe/torch", case)
    registry.forget_choices()
    chosen = auto.note.rsplit("auto -> ", 1)[1]
    assert chosen in registry.candidates("torch", torch.device("cpu"), torch.float32)  # loop, grouped_mm, onednn
    assert small.note.rsplit("auto -> ", 1)[1] == "padded experts op (stages 2-5 in one piece)"
    with pytest.raises(ProviderSkipped, match="interpreter|TRITON_INTERPRET|GPU"):
        build_provider("fastmoe/triton@triton", case)
    assert torch.isfinite(outs["fastmoe/torch@loop"]).all()


def test_engines_command_lists_and_clears_the_cached_choices(tmp_path, capsys):
    """``fastmoe-bench --engines`` shows each cached choice with every candidate's time and how it
    was timed; ``--engines clear`` removes them."""
    from bench.cli import main
    from fastmoe_xpu.kernels import timing

    path = tmp_path / "c.json"
    with settings.override(gemm_cache=str(path)):
        timing.store("cpu:test-cpux1", registry.ShapeKey("torch", "float32", 128, 64, 6, 512), "grouped_mm",
                     {"loop": 0.0031, "grouped_mm": 0.0021}, forward={"loop": 0.001, "grouped_mm": 0.0008}, rows=384,
                     timed={"reason": "first use", "rounds": 3, "threads": 1, "check": "run-queue wait",
                            "starved": {"loop": 1, "grouped_mm": 0}})
        assert main(["--engines"]) == 0
        out = capsys.readouterr().out
        assert f"{path}: 1 cached engine choice" in out
        assert "H=128 I=64 NR=6 rows<=512: grouped_mm  [timed at 384 rows]" in out
        assert "F+B ms: grouped_mm 2.1*, loop 3.1" in out
        assert "timed: first use; 3 interleaved rounds, 1 thread, starvation told by run-queue wait, " \
               "starved samples 1" in out
        assert main(["--engines", "clear"]) == 0
        assert "1 cached engine choice removed" in capsys.readouterr().out and not path.exists()
        assert main(["--engines", "list"]) == 0
        assert ": 0 cached engine choices" in capsys.readouterr().out
