"""Intel XPU compile gate: every kernel, every XPU config, compiled for Ponte Vecchio (PVC).

The compile runs in ``.venv-xpu`` (Intel's Triton build owns the ``triton`` module, so it cannot
share this interpreter) as a subprocess; ``scripts/setup_xpu_venv.sh`` builds that venv. Without
it these tests skip and say so.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
XPU_PYTHON = ROOT / ".venv-xpu" / "bin" / "python"
SKIP_REASON = ".venv-xpu does not exist: run scripts/setup_xpu_venv.sh to build it (Intel's Triton build + ocloc)"

pytestmark = pytest.mark.skipif(not XPU_PYTHON.exists(), reason=SKIP_REASON)


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


@pytest.fixture(scope="module")
def xpu_check(tmp_path_factory: pytest.TempPathFactory) -> tuple[subprocess.CompletedProcess, dict[str, Any]]:
    out = tmp_path_factory.mktemp("xpu") / "xpu.json"
    return _run_xpu("fastmoe_xpu.kernels.compile_check", ["--target", "xpu"], out)


def test_probe_gate_tells_dpas_gemm_from_fma_dot(tmp_path: Path) -> None:
    # The gate's own check: a block-pointer bf16 GEMM must pass with DPAS and 2D block loads, and an
    # fp32 IEEE dot (no DPAS on PVC) must be reported as missing DPAS; exit 0 means both verdicts held.
    proc, data = _run_xpu("fastmoe_xpu.kernels.compile_xpu", ["--probe"], tmp_path / "probe.json")
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


def test_every_kernel_compiles_for_pvc_with_dpas(xpu_check: tuple[subprocess.CompletedProcess, dict[str, Any]]) -> None:
    from fastmoe_xpu.kernels.compile_check import kernel_specs

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


def test_xpu_default_config_is_least_spilling(xpu_check: tuple[subprocess.CompletedProcess, dict[str, Any]]) -> None:
    _, data = xpu_check
    assert data, "no JSON from the XPU compile check"
    best = data["least_spilling"]
    defaults = {r["kernel"]: r["config"] for r in data["results"] if r["is_default"]}
    assert set(defaults) == {r["kernel"] for r in data["results"]}, "a kernel without a default XPU config"
    wrong = {k: (cfg, best.get(k)) for k, cfg in defaults.items() if cfg not in best.get(k, [])}
    assert not wrong, f"default config is not the least-spilling one (kernel: (default, least-spilling)): {wrong}"
