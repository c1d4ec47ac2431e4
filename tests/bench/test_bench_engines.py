"""bench: each grouped-GEMM engine as its own provider (fastmoe/<backend>@<engine>), and the plain
provider's auto choice named in its note."""
from __future__ import annotations

import pytest
import torch

from bench.harness.cases import make_case
from bench.harness.presets import PRESETS, Preset
from bench.harness.providers import ProviderSkipped, build_provider, expand_names
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
    wider = make_case(Preset("wider", 256, 128, 8, 2, 160, 1, "above the padded budget"), dtype="fp32", device="cpu",
                      seed=0)
    with settings.override(gemm_engine=None, gemm_cache=str(tmp_path / "c.json")):
        auto = build_provider("fastmoe/torch", wider)
        small = build_provider("fastmoe/torch", case)
    registry.forget_choices()
    chosen = auto.note.rsplit("auto -> ", 1)[1]
    options = registry.candidates("torch", torch.device("cpu"), torch.float32)  # loop, grouped_mm, onednn
    if " (forward calls without a backward: " in chosen:  # the timed forwards named another engine for those
        chosen, infer = chosen[:-1].split(" (forward calls without a backward: ")
        assert infer in options and infer != chosen
    assert chosen in options
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


def test_auto_provider_reports_its_choice_and_a_retiming_while_it_was_measured(tmp_path, monkeypatch):
    """The auto provider's row records the choice in use after its rounds; a choice re-timed during
    them (here: an untrusted one, re-timed after one call) is named under the case's table, since
    a sample holding a re-timing is slower than the chosen engine alone."""
    from bench.harness.report import derive, format_case
    from bench.harness.runner import run_case

    wider = make_case(Preset("wider", 256, 128, 8, 2, 160, 1, "above the padded budget"), dtype="fp32", device="cpu",
                      seed=0)
    registry.forget_choices()
    try:
        with settings.override(gemm_engine=None, gemm_cache=str(tmp_path / "c.json")):
            quiet = run_case(wider, ["fastmoe/torch"], rounds=2, budget_s=30.0, ceiling_n=32, progress=False,
                             reference="fastmoe/torch")
            state = quiet["providers"]["fastmoe/torch"]["auto"]
            chosen = quiet["providers"]["fastmoe/torch"]["note"].rsplit("auto -> ", 1)[1]
            # "ENGINE", or "ENGINE (forward calls without a backward: OTHER)" where the timing found
            # another engine faster for forward calls alone (the choice depends on the machine's timing)
            engine, _, infer = chosen.partition(" (forward calls without a backward: ")
            assert state["engine"] == engine
            assert infer == ("" if state["inference_engine"] == engine else state["inference_engine"] + ")")
            assert state["forward_calls"] >= 2 and state["trusted"] in (True, False)
            if state["retimes"] == 0:  # a trusted choice on a quiet machine: nothing to say under the table
                assert "auto_note" not in quiet["providers"]["fastmoe/torch"]
            registry.forget_choices()

            def untrusted():
                p = build_provider("fastmoe/torch", wider)
                watch = registry.watch_for("torch", wider.device, wider.x_TH.dtype,
                                           (256, 128, 8, wider.topk_idx_TK.numel()))
                watch.trusted, watch.retime_at, watch.next_check = False, 0, watch.calls + 1
                return p

            monkeypatch.setattr(registry, "CHECK_EVERY", 10**6)  # one re-timing, at the first check
            # whatever else runs on the machine (the re-timing of an untrusted choice waits for a quiet stretch)
            monkeypatch.setattr(registry.Watch, "_quiet_since_last_check", lambda self: True)
        # a cache of its own: the choice is timed at first use, before the rounds (not reported as theirs)
        with settings.override(gemm_engine=None, gemm_cache=str(tmp_path / "fresh.json")):
            res = run_case(wider, ["fastmoe/torch"], rounds=2, budget_s=30.0, ceiling_n=32, progress=False,
                           reference="fastmoe/torch", build=lambda name, case: untrusted())
    finally:
        registry.forget_choices()
    entry = res["providers"]["fastmoe/torch"]
    assert entry["auto"]["retimes"] == 1 and len(entry["auto"]["history"]) == 1
    assert "re-timed: the last timing was not trusted" in entry["auto"]["history"][0]
    assert entry["auto_note"].startswith("auto re-timed its engines 1 time in ")
    derive(res, ["fastmoe/torch"])
    assert f"* fastmoe/torch: {entry['auto_note']}" in format_case(res, "fwdbwd", "fastmoe/torch")
