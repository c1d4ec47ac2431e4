"""bench/studies/traffic.py: the passes of a layer counted on the meta device (real shapes, no
storage), and what they show about the Triton fp8 path: every pass over a row buffer or a weight is a
Triton kernel (the torch operators left touch only the per-expert bounds), no host read."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from bench.studies import traffic  # noqa: E402

T, H, I, E, K = 64, 48, 40, 12, 4


def _ops(passes):
    return [(p.name, o) for p in passes for o in p.ops]


def test_unique_bytes_counts_expanded_dims_once():
    base = torch.empty(5, 1, dtype=torch.float32, device="meta")
    assert traffic.unique_bytes(base.expand(5, 7)) == 20
    assert traffic.unique_bytes(torch.empty(3, 4, dtype=torch.bfloat16, device="meta")) == 24


def test_fp8_path_runs_every_row_pass_in_triton():
    passes = traffic.layer_traffic("triton+fp8", T, H, I, E, K, torch.bfloat16)
    names = [p.name for p in passes]
    assert names[:2] == ["gate_up_fwd", "down_fwd"] and "down_weighted_bwd" in names and "gate_up_bwd" in names
    kernels = [o.name for _, o in _ops(passes) if o.kind == "kernel"]
    assert kernels.count("_fp8_grouped_mm_kernel") == 4 and kernels.count("_fp8_grouped_wgrad_kernel") == 2
    # the weights quantized in the forward (one kernel each), reused by the backward; x, h and the two
    # input gradients' rows; four column-code operands
    assert kernels.count("_fp8q_rows_kernel") == 6 and kernels.count("_fp8q_cols_kernel") == 4
    for name, op in _ops(passes):
        if op.kind == "op":  # bookkeeping of the expert bounds only: nothing of a row buffer's size
            assert op.read + op.written <= 64 * (E + 1), (name, op)


def test_bf16_path_is_kernels_only():
    passes = traffic.layer_traffic("triton", T, H, I, E, K, torch.bfloat16)
    assert all(o.kind == "kernel" for _, o in _ops(passes))
    assert len(_ops(passes)) == 12


def test_a_host_read_fails_loudly():
    with pytest.raises(RuntimeError, match="host read"):
        with traffic.recording():
            torch.empty(3, device="meta").sum().item()


def test_report_table(capsys):
    assert traffic.main(["--shape", "qwen3-30b-a3b", "--sets", "triton+fp8"]) == 0
    out = capsys.readouterr().out
    assert "| gate_up_fwd |" in out and "| **total** |" in out and "T=32768 H=2048 I=768 E=128 K=8" in out
