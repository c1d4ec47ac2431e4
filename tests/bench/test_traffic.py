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
    assert names[0] == "gate_up_down_fwd" and "down_silu_bwd" in names and "gate_up_bwd" in names
    # the fused forward and down backward: no h, no [R, H] output-gradient rows, no silu_mul_bwd pass
    assert not {"gate_up_fwd", "down_fwd", "silu_mul_bwd", "combine_bwd"} & set(names)
    kernels = [o.name for _, o in _ops(passes) if o.kind == "kernel"]
    assert kernels.count("_fp8_grouped_mm_kernel") == 4 and kernels.count("_fp8_grouped_wgrad_kernel") == 2
    # the weights quantized in the forward (one kernel each), reused by the backward; x and the two
    # input gradients' rows; h's codes from gate_up; four column-code operands
    assert kernels.count("_fp8q_rows_kernel") == 5 and kernels.count("_fp8q_silu_rows_kernel") == 1
    assert kernels.count("_fp8q_cols_kernel") == 4 and "_fp8q_silu_mul_kernel" not in kernels
    composed = [p.name for p in traffic.layer_traffic("triton+fp8:composed", T, H, I, E, K, torch.bfloat16)]
    assert composed[:2] == ["gate_up_fwd", "down_fwd"] and "silu_mul_bwd" in composed
    for name, op in _ops(passes):
        if op.kind == "op":  # bookkeeping of the expert bounds only: nothing of a row buffer's size
            assert op.read + op.written <= 64 * (E + 1), (name, op)


def test_bf16_path_is_kernels_only():
    passes = traffic.layer_traffic("triton", T, H, I, E, K, torch.bfloat16)
    assert all(o.kind == "kernel" for _, o in _ops(passes))
    assert len(_ops(passes)) == 11
    # the same set without its fused launchers: combine_bwd, down_weighted_bwd and silu_mul_bwd again
    composed = traffic.layer_traffic("triton:composed", T, H, I, E, K, torch.bfloat16)
    assert all(o.kind == "kernel" for _, o in _ops(composed)) and len(_ops(composed)) == 12
    assert {"combine_bwd", "down_weighted_bwd", "silu_mul_bwd"} <= {p.name for p in composed}
    assert "down_silu_bwd" not in {p.name for p in composed}


def _gb(passes):
    once = sum(o.read + o.written for _, o in _ops(passes))
    return once, once + sum(o.regathered for _, o in _ops(passes))


def test_the_fused_backward_moves_a_fifth_fewer_bytes():
    """At Qwen3-30B-A3B the fused down backward (the output gradient's rows read in the GEMM loads, the
    SiLU*up gradient in the row pass) takes the F+B from 19.48 to 15.18 GB counted with each argument
    once; if no gathered row hits L2 (each read K times from HBM), 21.36 to 18.94 GB. What it saves for
    certain, counted by hand as the table counts (an argument once per launch, so the in-place scaling of
    dh in row_dot_scale is one [R, I]): the [R, H] row gradients written, combine_bwd's read of dout,
    and three [R, I] passes (silu_mul_bwd's reads of dh and gate_up, dh in row_dot_scale)."""
    T_, H_, I_, E_, K_ = 32768, 2048, 768, 128, 8
    fused = traffic.layer_traffic("triton", T_, H_, I_, E_, K_, torch.bfloat16)
    composed = traffic.layer_traffic("triton:composed", T_, H_, I_, E_, K_, torch.bfloat16)
    (f1, f2), (c1, c2) = _gb(fused), _gb(composed)
    assert c1 == pytest.approx(19.48e9, rel=1e-3) and f1 <= 0.8 * c1  # the goal: at least 20% fewer
    R, b = T_ * K_, 2  # rows, bytes per bf16 element
    certain = R * H_ * b + T_ * H_ * b + 3 * R * I_ * b
    assert c2 - f2 >= certain - 1e7  # small index and weight arrays aside
    assert sum(p.flops for p in fused) == sum(p.flops for p in composed)
    line = traffic.fused_vs_composed("triton", fused, (T_, H_, I_, E_, K_), torch.bfloat16, "cuda")
    assert "15.184 GB (arguments once)" in line and "22.0% / 11.3% fewer" in line
    # fp8 next to the Triton base has the fused down backward too; int8 has none: no line
    fp8 = traffic.layer_traffic("triton+fp8", T_, H_, I_, E_, K_, torch.bfloat16)
    fp8_composed = traffic.layer_traffic("triton+fp8:composed", T_, H_, I_, E_, K_, torch.bfloat16)
    (f1, f2), (c1, c2) = _gb(fp8), _gb(fp8_composed)
    assert c1 - f1 >= R * H_ * b + T_ * H_ * b + 3 * R * I_ * b - 1e7 and f2 < c2
    assert "fewer" in traffic.fused_vs_composed("triton+fp8", fp8, (T_, H_, I_, E_, K_), torch.bfloat16, "cuda")
    assert traffic.fused_vs_composed("triton+int8", traffic.layer_traffic("triton+int8", T, H, I, E, K, torch.bfloat16),
                                     (T, H, I, E, K), torch.bfloat16, "cuda") == ""


def test_block_scaled_fp8_moves_a_quarter_fewer_bytes_than_per_channel():
    """At Qwen3-30B-A3B the block-scaled recipe (activations and gradients quantized in the GEMMs' loads)
    takes one F+B in 13 launches and 16.60 GB, where the per-channel fp8 recipe's quantization passes
    take 21 launches and 22.41 GB (each argument once): 25% fewer bytes. What it saves for certain: the
    codes of x, h and the two input gradients' rows are neither written nor read back (4 one-byte
    [R, *] passes, at least R * (H + I) * 2 bytes), and the weight gradients' operands are not
    re-quantized (their column codes, R * (H + 3I) bytes written and read back)."""
    T_, H_, I_, E_, K_ = 32768, 2048, 768, 128, 8
    block = traffic.layer_traffic("triton+fp8-block", T_, H_, I_, E_, K_, torch.bfloat16)
    chan = traffic.layer_traffic("triton+fp8", T_, H_, I_, E_, K_, torch.bfloat16)
    (b1, b2), (c1, c2) = _gb(block), _gb(chan)
    assert b1 == pytest.approx(16.595e9, rel=1e-3) and c1 == pytest.approx(22.409e9, rel=1e-3)
    assert b1 <= 0.75 * c1 and b2 < c2
    R = T_ * K_
    assert c1 - b1 >= R * (H_ + I_) * 2 + 2 * R * (H_ + 3 * I_) - 1e8
    kernels_run = {o.name for p in block for o in p.ops if o.kind == "kernel"}
    assert not {n for n in kernels_run if n.startswith("_fp8q_") and n != "_fp8q_row_dot_kernel"}, kernels_run
    assert sum(p.totals()[1] for p in block) == 13 and sum(p.totals()[1] for p in chan) == 21
    assert sum(p.flops for p in block) == sum(p.flops for p in chan)
    # four GEMMs gather [T, H] rows by token (x in the gate/up forward and weight gradient, the output
    # gradient in the down input and weight gradients): each row K times where it misses L2, not once
    assert b2 - b1 == pytest.approx(4 * (K_ - 1) * T_ * H_ * 2, rel=0.01)


def test_a_host_read_fails_loudly():
    with pytest.raises(RuntimeError, match="host read"):
        with traffic.recording():
            torch.empty(3, device="meta").sum().item()


def test_report_table(capsys):
    assert traffic.main(["--shape", "qwen3-30b-a3b", "--sets", "triton+fp8"]) == 0
    out = capsys.readouterr().out
    assert "| gate_up_down_fwd |" in out and "| **total** |" in out and "T=32768 H=2048 I=768 E=128 K=8" in out


# ---------------------------------------------------------------- GEMM FLOPs, roofline floor, each launch timed
def test_gemm_flops_by_hand():
    R = T * K  # 256 routed rows
    passes = {p.name: p.flops for p in traffic.layer_traffic("triton", T, H, I, E, K, torch.bfloat16)}
    assert passes["gate_up_fwd"] == 2 * R * H * (2 * I) == 1_966_080  # [R, H] x [H, 2I]
    assert passes["down_fwd"] == 2 * R * I * H == 983_040  # [R, I] x [I, H]
    assert passes["down_silu_bwd"] == 2 * 983_040  # dh = dy Wd, dWd = dy^T h
    assert passes["gate_up_bwd"] == 2 * 1_966_080  # dx = dgu Wgu, dWgu = dgu^T x
    assert passes["combine_fwd"] == passes["router_weights_bwd"] == 0
    composed = {p.name: p.flops for p in traffic.layer_traffic("triton:composed", T, H, I, E, K, torch.bfloat16)}
    assert composed["down_weighted_bwd"] == passes["down_silu_bwd"]
    assert composed["combine_bwd"] == composed["silu_mul_bwd"] == 0
    from fastmoe_xpu.kernels.registry import layer_macs

    total = sum(p.flops for p in traffic.layer_traffic("triton", T, H, I, E, K, torch.bfloat16))
    assert total == 8_847_360 == 2 * 3 * layer_macs(T, K, H, I, E)  # backward twice the forward


def test_floor_is_the_longer_of_bytes_and_flops():
    assert traffic.floor_ms(4_800_000_000, 0, 4800.0, 989.0) == pytest.approx(1.0)
    assert traffic.floor_ms(4_800_000_000, 2 * 989 * 10**9, 4800.0, 989.0) == pytest.approx(2.0)
    h200, h100 = traffic.DEVICE_MODELS["h200"], traffic.DEVICE_MODELS["h100"]
    assert (h200.bandwidth_gbs, h100.bandwidth_gbs) == (4800.0, 3350.0)
    assert traffic.peak_for(h200, "triton", "bf16") == 989.0 and traffic.peak_for(h100, "triton+fp8", "bf16") == 1979.0


def _total(out, title):
    block = out.split(f"### {title}\n", 1)[1]
    return next(line for line in block.splitlines() if line.startswith("| **total** |")).strip("|").split("|")


@pytest.mark.parametrize("model, bandwidth", [("h200", 4800.0), ("h100", 3350.0)])
def test_report_has_flops_and_floor_columns(model, bandwidth, capsys):
    assert traffic.main(["--shape", "qwen3-30b-a3b", "--sets", "triton", "--device-model", model]) == 0
    out = capsys.readouterr().out
    assert f"roofline of {model}: {bandwidth:.0f} GB/s" in out and "GEMM GFLOP | ms at peak | floor ms |" in out
    cells = [c.strip() for c in _total(out, "triton")]
    R = 32768 * 8
    flops = 18 * R * 2048 * 768  # 3 GEMMs forward (gate, up, down), twice that backward
    assert cells[2] == "11" and cells[7] == f"{flops / 1e9:.1f}" == "7421.7"
    assert cells[8] == f"{flops / 989e12 * 1e3:.2f}"
    assert float(cells[5]) >= float(cells[4])  # gathered rows from HBM: never fewer bytes
    passes = traffic.layer_traffic("triton", 32768, 2048, 768, 128, 8, torch.bfloat16)
    floor = sum(traffic.floor_ms(sum(o.read + o.written for o in p.ops), p.flops, bandwidth, 989.0) for p in passes)
    assert cells[9] == f"{floor:.2f}"
    # the floor of every pass is at least its bytes' time and its FLOPs' time
    assert floor >= max(float(cells[6]), float(cells[8])) - 0.01


def test_each_launch_timed_on_the_torch_set():
    inputs = traffic.layer_inputs(T, H, I, E, K, torch.float32, "cpu", "torch")
    spans = traffic.time_launches("torch", inputs, rounds=2)
    passes = traffic.count_passes("torch", inputs)
    assert [s.pass_name for s in spans] == [p.name for p in passes] and all(s.launch is None for s in spans)
    assert all(s.ms > 0 for s in spans)
    assert sum(p.flops for p in passes) == 8_847_360
    table = traffic.timed_report("torch", spans, passes)
    total = table.splitlines()[-1].strip("|").split("|")
    assert total[0].strip() == "**total**" and float(total[2]) == pytest.approx(sum(s.ms for s in spans), abs=2e-3)
    assert total[5].strip() == "0.0" and len(table.splitlines()) == 4 + len(passes) + 1


def test_each_triton_launch_is_timed_in_its_pass(monkeypatch):
    # the launches stood in for by a no-op on the meta device: what the timer records, not what runs
    from fastmoe_xpu.kernels.triton import launch as launch_mod

    monkeypatch.setattr(launch_mod, "launch", lambda *a, **k: None)
    inputs = traffic.layer_inputs(T, H, I, E, K, torch.bfloat16)
    spans = traffic.time_launches("triton", inputs, rounds=1)
    passes = traffic.count_passes("triton", inputs)
    launches = [s for s in spans if s.launch is not None]
    assert len(launches) == 11 and [s.launch for s in launches] == [o.name for p in passes for o in p.ops]
    assert {s.pass_name for s in launches} == {p.name for p in passes}
    table = traffic.timed_report("triton", spans, passes)
    assert "| down_silu_bwd | (pass) |" in table
    assert table.splitlines()[-1].startswith("| **total** | 11 launches |")
    # and without the fused launchers, the launchers they replace
    spans = traffic.time_launches("triton:composed", inputs, rounds=1)
    table = traffic.timed_report("triton:composed", spans, traffic.count_passes("triton:composed", inputs))
    assert "| down_weighted_bwd | (pass) |" in table and "| silu_mul_bwd | (pass) |" in table
    assert table.splitlines()[-1].startswith("| **total** | 12 launches |")


def test_time_cpu_takes_the_torch_set_only(capsys):
    with pytest.raises(SystemExit) as exc:
        traffic.main(["--time", "cpu", "--sets", "triton"])
    assert exc.value.code == 2
    assert capsys.readouterr().err.count("\n") == 1


def test_the_gpu_kit_step_is_this_command_line(tmp_path, capsys):
    from fastmoe_xpu.tools import gpu_check

    (step,) = [s for s in gpu_check.plan("cuda", tmp_path, tmp_path, 540.0) if s.key == "launches"]
    assert step.argv[3:5] == ["traffic", "--shape"] and step.timeout_s <= 0.1 * 540
    shapes = step.argv[5:step.argv.index("--sets")]
    assert shapes[:2] == ["olmoe-1b-7b", "qwen3-30b-a3b"] and len(shapes) == 3
    sets = step.argv[step.argv.index("--sets") + 1:step.argv.index("--time")]
    assert sets == ["triton", "triton:composed", "triton+fp8", "triton+fp8-block"]
    assert step.argv[step.argv.index("--time") + 1] == "cuda"
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is here: the step would run")
    with pytest.raises(SystemExit) as exc:  # parsed whole, then refused before any work: no device
        traffic.main(step.argv[4:])
    assert exc.value.code == 2
    captured = capsys.readouterr()
    assert captured.out == "" and "no CUDA device" in captured.err and captured.err.count("\n") == 1


def test_the_fp8_set_quantizes_its_weights_in_every_timed_call(monkeypatch):
    from fastmoe_xpu.kernels.triton import launch as launch_mod

    monkeypatch.setattr(launch_mod, "launch", lambda *a, **k: None)
    inputs = traffic.layer_inputs(T, H, I, E, K, torch.bfloat16)
    spans = traffic.time_launches("triton+fp8", inputs, rounds=2)
    passes = traffic.count_passes("triton+fp8", inputs)
    assert [s.launch for s in spans if s.launch] == [o.name for p in passes for o in p.ops if o.kind == "kernel"]
    assert "| **total** |" in traffic.timed_report("triton+fp8", spans, passes)
