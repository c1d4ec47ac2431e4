"""Intel XPU compile gate: every kernel, every XPU config, compiled for Ponte Vecchio (PVC).

The compile runs in ``.venv-xpu`` (Intel's Triton build owns the ``triton`` module, so it cannot
share this interpreter) as a subprocess; ``scripts/setup_xpu_venv.sh`` builds that venv. Without
it those tests skip and say so. The TTGIR and IGC-dump readers are tested here on text cut from
real compiles, in any environment.
"""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from fastmoe_xpu.tools.compile_xpu import XpuResult, analyse_ttgir, count_dots, least_spilling, parse_igc_asm

ROOT = Path(__file__).resolve().parents[2]
XPU_PYTHON = ROOT / ".venv-xpu" / "bin" / "python"
SKIP_REASON = ".venv-xpu does not exist: run scripts/setup_xpu_venv.sh to build it (Intel's Triton build + ocloc)"

# CI builds .venv-xpu before the tests (make test), so there a missing venv is a failure, not a skip.
_skip_without_venv = pytest.mark.skipif(not XPU_PYTHON.exists() and not os.environ.get("CI"), reason=SKIP_REASON)


def needs_xpu_venv(test):  # noqa: ANN001, ANN201
    """Runs in .venv-xpu: skipped without it, and marked ``xpu_venv`` (the work is the same whatever
    versions run pytest, so make test-compat leaves it to make test)."""
    return pytest.mark.xpu_venv(_skip_without_venv(test))

# Cut from Intel Triton 3.3's TTGIR of the weight-gradient GEMM with gathered rows: the A operand
# comes from a 2D block load, B from a pointer-tensor load staged through shared memory.
TTGIR_DPAS = """
#blocked = #ttg.blocked<{sizePerThread = [1, 8], threadsPerWarp = [1, 16], warpsPerCTA = [32, 1], order = [1, 0]}>
#mma = #triton_intel_gpu.dpas<{repeatCount = 8, systolicDepth = 8, executionSize = 16, opsPerChan = 2, threadsPerWarp = 16, warpsPerCTA = [8, 4], repCluster = [4, 2], A = [32, 16], B = [16, 32], C = [32, 32]}>
    %31:3 = scf.for %arg7 = %c0_i32 to %7 step %c32_i32 iter_args(%arg8 = %cst_1, %arg9 = %22, %arg10 = %21) -> (tensor<256x128xf32, #mma>, !tt.ptr<tensor<256x32xbf16, #blocked1>>)  : i32 {
      %56 = tt.load %55, %50, %cst_0 : tensor<32x128x!tt.ptr<bf16>, #blocked> loc(#loc5)
      %57 = ttg.local_alloc %56 : (tensor<32x128xbf16, #blocked>) -> !ttg.memdesc<32x128xbf16, #shared, #smem>
      %58 = tt.load %arg10 {boundaryCheck = array<i32: 0, 1>, padding = 1 : i32, triton_intel_gpu.block_io = "column_major"} : !tt.ptr<tensor<256x32xbf16, #ttg.dot_op<{opIdx = 0, parent = #mma, kWidth = 1}>>>
      %59 = ttg.local_load %57 : !ttg.memdesc<32x128xbf16, #shared, #smem> -> tensor<32x128xbf16, #ttg.dot_op<{opIdx = 1, parent = #mma, kWidth = 2}>>
      %60 = tt.dot %58, %59, %arg8 : tensor<256x32xbf16, #ttg.dot_op<{opIdx = 0, parent = #mma, kWidth = 1}>> * tensor<32x128xbf16, #ttg.dot_op<{opIdx = 1, parent = #mma, kWidth = 2}>> -> tensor<256x128xf32, #mma> loc(#loc9)
"""

# An fp32 IEEE dot: Intel's backend keeps a blocked (FMA) layout.
TTGIR_FMA = """
#blocked = #ttg.blocked<{sizePerThread = [1, 1], threadsPerWarp = [16, 1], warpsPerCTA = [2, 2], order = [0, 1]}>
    %10 = tt.load %9 : tensor<32x32x!tt.ptr<f32>, #blocked>
    %11 = tt.load %8 : tensor<32x32x!tt.ptr<f32>, #blocked>
    %12 = ttg.convert_layout %10 : tensor<32x32xf32, #blocked> -> tensor<32x32xf32, #ttg.dot_op<{opIdx = 0, parent = #blocked}>>
    %13 = ttg.convert_layout %11 : tensor<32x32xf32, #blocked> -> tensor<32x32xf32, #ttg.dot_op<{opIdx = 1, parent = #blocked}>>
    %14 = tt.dot %12, %13, %cst, inputPrecision = ieee : tensor<32x32xf32, #ttg.dot_op<{opIdx = 0, parent = #blocked}>> * tensor<32x32xf32, #ttg.dot_op<{opIdx = 1, parent = #blocked}>> -> tensor<32x32xf32, #blocked>
"""

# Header and body lines of IGC's .asm dump (Debian's IGC 1.0.12504, PVC).
IGC_ASM = """//.kernel _grouped_mm_bwd_kernel
//.platform PVCXT
//.thread_config numGRF=256, numAcc=8, numSWSB=32
//.RA type\tGRAPH_COLORING_SPILL_FF_RA
//.spill size 65536
//.declare V0072 (80)  rf=r size=64 type=d align=32 words (spilled -> Scratch[0x64])
//.declare V0322 (332)  rf=r size=512 type=d align=32 words (spilled -> Scratch[95x64])
//.declare V0121 (130)  rf=r size=64 type=f align=32 words (spilled -> Scratch[119x64])
        calla (16|M0)            r253.0        r253.0                           {$0.src}             // $90
        dpas.8x8 (16|M0)         r10:f         r10:f             r188:bf           r76.0:bf         {Atomic,Compacted,$9.dst}
        dpas.8x8 (16|M0)         r18:f         r18:f             r188:bf           r84.0:bf         {$9}
"""


def _run_xpu(module: str, args: list[str], json_path: Path) -> tuple[subprocess.CompletedProcess, dict[str, Any]]:
    # PYTHONPATH: compile this checkout's kernels even if .venv-xpu's editable install points elsewhere.
    env = dict(os.environ, CC="g++", PYTHONPATH=str(ROOT))
    env.pop("TRITON_INTERPRET", None)
    proc = subprocess.run(
        [str(XPU_PYTHON), "-m", module, *args, "--json", str(json_path)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=1500,
    )
    sys.stdout.write(proc.stdout)  # the table, shown with -s or on failure
    data = json.loads(json_path.read_text()) if json_path.exists() else {}
    return proc, data


def test_ttgir_reader_finds_dpas_and_block_io() -> None:
    # A dot with a DPAS result: one operand from a 2D block load, the other traced through
    # shared memory to a plain pointer load.
    got = analyse_ttgir(TTGIR_DPAS)
    assert got == {"ttgir_dots": 1, "dpas_dots": 1, "operand_loads": 2, "block_io_loads": 1,
                   "block_io_kinds": ["column_major"]}
    assert count_dots(TTGIR_DPAS) == 1


def test_ttgir_reader_flags_fma_dot() -> None:
    # A dot left on FMA (blocked result encoding) is not counted as DPAS.
    got = analyse_ttgir(TTGIR_FMA)
    assert got["ttgir_dots"] == 1 and got["dpas_dots"] == 0
    assert got["operand_loads"] == 2 and got["block_io_loads"] == 0


def test_igc_asm_reader() -> None:
    # Spill bytes are the end of the furthest spilled value's scratch slot (119*64 + 64), not the
    # header's "spill size", which with calls present is the whole scratch/stack size.
    got = parse_igc_asm(IGC_ASM)
    assert got == {"grf": 256, "ra_type": "GRAPH_COLORING_SPILL_FF_RA", "spill_bytes": 119 * 64 + 64,
                   "spilled_values": 3, "calls": 1, "native_dpas": 2, "dpas_types": ["bf*bf->f"]}
    # the integer form: int8 sources into int32 accumulators
    int8 = "        dpas.8x8 (16|M0)         r71:d         r15:d             r41:b             r67.0:b    {Atomic}\n"
    assert parse_igc_asm(int8)["dpas_types"] == ["b*b->d"]


@pytest.mark.parametrize(
    "rows,want",
    [
        # the smaller spill wins
        ([("k", "a", 100, True), ("k", "b", 0, True)], {"k": ["b"]}),
        # ties are all listed
        ([("k", "a", 0, True), ("k", "b", 0, True)], {"k": ["a", "b"]}),
        # a config that fails the gate cannot be the least-spilling one
        ([("k", "a", 100, True), ("k", "b", 0, False)], {"k": ["a"]}),
    ],
)
def test_least_spilling(rows: list[tuple[str, str, int, bool]], want: dict[str, list[str]]) -> None:
    results = []
    for kernel, config, spill, ok in rows:
        r = XpuResult(kernel=kernel, config=config, is_default=False, compiled=True, ocloc_ok=True, dots=1,
                      ttgir_dots=1, dpas_dots=1 if ok else 0, native_dpas=8 if ok else 0, spill_bytes=spill)
        results.append(r)
    assert least_spilling(results) == want


@pytest.fixture(scope="module")
def xpu_check(tmp_path_factory: pytest.TempPathFactory) -> tuple[subprocess.CompletedProcess, dict[str, Any]]:
    out = tmp_path_factory.mktemp("xpu") / "xpu.json"
    # compile_xpu directly: the same run as `compile_check --target xpu`, which forwards to it.
    return _run_xpu("fastmoe_xpu.tools.compile_xpu", [], out)


@needs_xpu_venv
def test_probe_gate_tells_dpas_gemm_from_fma_dot(tmp_path: Path) -> None:
    # The gate's own check: a block-pointer bf16 GEMM must pass with DPAS and 2D block loads, and an
    # fp32 IEEE dot (no DPAS on PVC) must be reported as missing DPAS; exit 0 means both verdicts held.
    proc, data = _run_xpu("fastmoe_xpu.tools.compile_xpu", ["--probe"], tmp_path / "probe.json")
    assert proc.returncode == 0, proc.stderr[-3000:]
    by_kernel: dict[str, list[dict[str, Any]]] = {}
    for r in data["results"]:
        by_kernel.setdefault(r["kernel"], []).append(r)
    assert by_kernel["probe_gemm"], "no probe GEMM compiled"
    for r in by_kernel["probe_gemm"]:
        assert r["passed"] and r["dpas_dots"] == r["ttgir_dots"] == r["dots"] == 1, r
        assert r["native_dpas"] > 0, r
        assert r["block_io_loads"] == r["operand_loads"] == 2, r
        assert r["grf"] == {"large": 256, "small": 128}[r["config"].rsplit("_", 1)[1]], r
    (fma,) = by_kernel["probe_fma_dot"]
    assert fma["ocloc_ok"] and not fma["dpas_ok"] and not fma["passed"] and fma["dpas_dots"] == 0, fma


@needs_xpu_venv
def test_every_kernel_compiles_for_pvc_with_dpas(xpu_check: tuple[subprocess.CompletedProcess, dict[str, Any]]) -> None:
    from fastmoe_xpu.tools.kernel_specs import kernel_specs

    proc, data = xpu_check
    assert data, f"no JSON from the XPU compile check (exit {proc.returncode}):\n{proc.stderr[-4000:]}"
    results = data["results"]
    want = sorted((s.name, s.config_name) for s in kernel_specs("xpu"))
    assert sorted((r["kernel"], r["config"]) for r in results) == want
    bad = [f"{r['kernel']}[{r['config']}]: compiled={r['compiled']} {r['error']} ocloc_ok={r['ocloc_ok']} "
           f"dpas {r['dpas_dots']}/{r['ttgir_dots']} of {r['dots']} dots, native dpas={r['native_dpas']}"
           for r in results if not r["passed"]]
    assert not bad, "\n".join(bad)
    assert any(r["dots"] > 0 for r in results), "no GEMM among the XPU kernel specs"
    assert proc.returncode == 0, proc.stderr[-3000:]


@needs_xpu_venv
def test_xpu_default_config_is_least_spilling(xpu_check: tuple[subprocess.CompletedProcess, dict[str, Any]]) -> None:
    _, data = xpu_check
    assert data, "no JSON from the XPU compile check"
    best = data["least_spilling"]
    defaults = {r["kernel"]: r["config"] for r in data["results"] if r["is_default"]}
    assert set(defaults) == {r["kernel"] for r in data["results"]}, "a kernel without a default XPU config"
    wrong = {k: (cfg, best.get(k)) for k, cfg in defaults.items() if cfg not in best.get(k, [])}
    assert not wrong, f"default config is not the least-spilling one (kernel: (default, least-spilling)): {wrong}"


@needs_xpu_venv
def test_int8_kernels_use_integer_dpas(xpu_check: tuple[subprocess.CompletedProcess, dict[str, Any]]) -> None:
    """The int8 grouped GEMM and weight gradient compile for PVC to DPAS on int8 sources with int32
    accumulators (``dpas ... :d :d :b :b``), and to nothing else, without spills."""
    _, data = xpu_check
    assert data, "no JSON from the XPU compile check"
    rows = [r for r in data["results"] if r["kernel"].startswith("int8_")]
    assert {r["kernel"] for r in rows} == {"int8_grouped_mm[W^T+gather]", "int8_grouped_mm[W^T]", "int8_grouped_mm[W]",
                                           "int8_grouped_wgrad[W]", "int8_grouped_wgrad[W^T]"}
    for r in rows:
        assert r["passed"] and r["native_dpas"] > 0 and r["dpas_types"] == ["b*b->d"], r
        assert r["spill_bytes"] == 0, r
