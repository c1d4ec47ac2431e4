"""The benchmark's precision surface: quantized providers by name, ``--precision`` expansion, and
``bench.studies.precision`` (layer timing, the convergence report's table and chart) on tiny inputs."""
from __future__ import annotations

import pytest

from bench.harness.cases import make_case
from bench.harness.presets import PRESETS
from bench.harness.providers import build_provider, expand_names, with_precisions
from bench.studies.precision import chart, layer, layer_markdown, markdown


def test_precision_providers_by_name():
    assert with_precisions(["hf_v4", "fastmoe/torch"], ["none", "int8"]) == ["hf_v4", "fastmoe/torch",
                                                                           "fastmoe/torch:int8"]
    assert with_precisions(["hf_v4", "fastmoe/torch"], ["fp8"]) == ["hf_v4", "fastmoe/torch:fp8"]
    assert "fastmoe/torch:int8" in expand_names(["fastmoe/torch:int8"])
    with pytest.raises(ValueError, match="quantized providers are fastmoe/<backend>:<precision>"):
        expand_names(["fastmoe/torch:int4"])
    case = make_case(PRESETS["tiny"])
    prov = build_provider("fastmoe/torch:int8", case)
    assert prov.precision == "int8" and "quantized to int8" in prov.note
    out = prov.forward(case.x_TH, case.weights_TK, case.topk_idx_TK)
    assert out.shape == case.x_TH.shape


def test_layer_timing_and_report(tmp_path):
    written = []  # what the caller is handed after each preset, to write it before the next
    rows = layer(["tiny"], ["int8"], rounds=1, done=lambda r: written.append(list(r)))
    assert len(rows) == 1 and rows[0]["precision"] == "int8" and rows[0]["min_s"] > 0
    assert written == [rows]
    machine = {"date_utc": "2026-11-29T00:00:00+00:00", "cpu_model": "Some CPU", "matrix_extensions": ["amx_bf16"],
               "torch_threads": 1, "torch": "2.13.0"}
    md = layer_markdown(rows, machine, "python -m bench precision --layer tiny")
    assert "Some CPU (amx_bf16)" in md and "`python -m bench precision --layer tiny`" in md
    assert f"| tiny | int8 | {rows[0]['fp32_min_s'] * 1e3:.0f} |" in md and f"| {rows[0]['G']:.2f} |" in md
    row = rows[0]  # beside it: fp32, bf16, the faster of them, G and the goal it sets
    assert row["faster_float"] in ("fp32", "bf16") and row["fp32_min_s"] > 0 and row["bf16_min_s"] > 0
    assert row["bf16_weights"]["min_s"] > 0
    assert set(row["gemms"]) == {"gate_up_fwd", "down_fwd", "down_input_grad", "down_weight_grad",
                                 "gate_up_input_grad", "gate_up_weight_grad", "all"}
    g = row["gemms"]["all"]
    assert row["G"] == min(g["fp32_s"], g["bf16_s"]) / g["int8_s"] > 0 and row["goal"] == max(1.5, row["G"] / 2)
    assert row["over_float_best_paired_median"] == (row["over_bf16_paired_median"] if row["faster_float"] == "bf16"
                                                    else row["speedup_paired_median"])
    losses = [3.0, 2.5, 2.0]
    results = {name: {"losses": losses, "train_loss_last10": 2.5, "val_loss": v, "steps_per_s": 1.0,
                      "optimizer_bytes_per_param": 12.0, **extra}
               for name, v, extra in (("fp32", 2.0, {"val_loss_ptq_int8": 2.01}), ("int8-experts", 2.02, {}))}
    text = markdown(results, "cmd")
    assert "int8-trained +0.0200, fp32-trained then quantized to int8 +0.0100" in text
    chart(results, tmp_path / "loss.png")
    assert (tmp_path / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
