"""The compile check: every Triton kernel compiles for sm_90 and gfx942, default configs without spills.

Compiling needs compiled-mode kernels, which a process that imported triton under
``TRITON_INTERPRET=1`` (the suite's setting) does not have, so the compiles run in a subprocess
(``python -m fastmoe_xpu.tools.compile_check`` drops the variable before importing triton). The
in-process tests only inspect :func:`kernel_specs`.
"""
from __future__ import annotations

import inspect
import json
import os

os.environ["TRITON_INTERPRET"] = "1"  # keep this process's triton in the suite's (interpreter) mode

import subprocess  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402

pytest.importorskip("triton")

from fastmoe_xpu.kernels import configs  # noqa: E402
from fastmoe_xpu.kernels.triton import combine, counting, fp8_gemm, grouped_gemm, indices, int8_gemm, tma_gemm  # noqa: E402
from fastmoe_xpu.tools import compile_check  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
KERNEL_MODULES = (counting, indices, grouped_gemm, combine)
#: Kernels compiled for some targets only: the TMA grouped GEMMs and the fp8 ones are NVIDIA's (sm_90+, sm_89+).
TARGET_MODULES = {"cuda": (tma_gemm, int8_gemm, fp8_gemm), "hip": (int8_gemm,), "xpu": (int8_gemm,)}


def _all_kernels(target: str) -> dict[str, object]:
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    found = {}
    for mod in KERNEL_MODULES + TARGET_MODULES.get(target, ()):
        for name, obj in vars(mod).items():
            # the kernels a module defines; the jit functions they call (kernels/triton/common.py) are not launched
            if isinstance(obj, (JITFunction, InterpretedFunction)) and obj.fn.__module__ == mod.__name__:
                found[name] = obj
    return found


@pytest.mark.parametrize("target", ["cuda", "hip", "xpu"])
def test_kernel_specs_cover_every_kernel_and_config(target):
    from triton.runtime.jit import JITFunction

    specs = compile_check.kernel_specs(target)
    kernels = _all_kernels(target)
    assert {s.fn.fn.__name__ for s in specs} == set(kernels), "a kernel is missing from the compile check"
    for spec in specs:
        assert isinstance(spec.fn, JITFunction)
        params = list(inspect.signature(spec.fn.fn).parameters)
        assert set(spec.signature) == set(params), spec.name  # every argument typed, nothing extra
        for name, ty in spec.signature.items():
            assert (ty == "constexpr") == (name in spec.constexprs), (spec.name, name)
        assert set(spec.divisible_by_16) <= set(spec.signature)
        if "BLOCK_PTR" in spec.constexprs:  # Intel loads tl.dot operands through block pointers
            assert spec.constexprs["BLOCK_PTR"] is (target == "xpu")
        if target == "xpu":
            assert spec.extra_options.get("grf_mode") == "large"
    # Every config of configs.py is compiled, and each kernel variant has exactly one default.
    by_variant: dict[str, list] = {}
    for spec in specs:
        by_variant.setdefault(spec.name, []).append(spec)
    for name, group in by_variant.items():
        assert sum(s.is_default for s in group) == 1, name
        key = name.split("[")[0]
        assert [s.config_name for s in group] == [c.name for c in configs.configs(target, key)]


def _callees(fn) -> dict[str, object]:
    """The jit functions that ``fn`` names in its globals, recursively, by qualified name."""
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    seen: dict[str, object] = {}
    todo = [fn]
    while todo:
        for obj in todo.pop().fn.__globals__.values():
            if isinstance(obj, (JITFunction, InterpretedFunction)) and obj.fn.__qualname__ not in seen:
                seen[obj.fn.__qualname__] = obj
                todo.append(obj)
    return seen


def test_specs_reach_only_compiled_mode_callees():
    """Under the interpreter the kernels' helpers are interpreted functions, which ``triton.compile``
    rejects as callees: each spec's kernel, and every jit function it reaches, is a JITFunction
    (helpers called from helpers included), and the kernel modules themselves are left as they were."""
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    assert isinstance(combine._combine_fwd_kernel, InterpretedFunction)  # this process runs the interpreter
    assert isinstance(combine._combine_fwd_kernel.fn.__globals__["token_slots"], InterpretedFunction)
    reached = set()
    for target in ("cuda", "hip", "xpu"):
        for spec in compile_check.kernel_specs(target):
            callees = _callees(spec.fn)
            assert all(isinstance(c, JITFunction) for c in callees.values()), (spec.name, callees)
            reached |= set(callees)
    assert {"token_slots", "tile", "slot_row"} <= reached  # token_slots calls tile: reached through a helper


@pytest.fixture(scope="module")
def default_rows(tmp_path_factory):
    """The rows of ``python -m fastmoe_xpu.tools.compile_check --defaults-only`` for sm_90 and gfx942
    (one compile run shared by the tests that read it)."""
    out = tmp_path_factory.mktemp("compile") / "rows.json"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    res = subprocess.run(
        [sys.executable, "-m", "fastmoe_xpu.tools.compile_check", "--target", "all", "--defaults-only",
         "--json", str(out)],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=1200,
    )
    print(res.stdout)
    assert res.returncode == 0, res.stdout[-4000:] + res.stderr[-4000:]
    return json.loads(out.read_text())


def test_compile_check_defaults_compile_without_spills(default_rows):
    """Every kernel variant's default config compiles for sm_90 and gfx942 without spills."""
    rows = default_rows
    n_variants = sum(len({s.name for s in compile_check.kernel_specs(t)}) for t in ("cuda", "hip"))
    assert len(rows) == n_variants
    for row in rows:
        assert row["ok"], row
        assert row["registers"] and row["registers"] > 0, row
        assert row["spills"] == 0, row
        assert row["shared_ok"], row
    assert {r["target"] for r in rows} == {"cuda", "hip"}


def test_tma_kernels_use_tma_and_wgmma_on_sm90(default_rows):
    """The persistent grouped GEMMs as compiled for sm_90: their SASS (read by ``cuobjdump -sass``,
    which ships with Triton) loads through TMA (UTMALDG) into wgmma (HGMMA), without spills; the
    plain grouped GEMMs, for contrast, do not use TMA."""
    if compile_check._cuobjdump() is None:
        pytest.skip("no cuobjdump: this triton ships without backends/nvidia/bin/cuobjdump")
    tma = [r for r in default_rows if r["target"] == "cuda" and r["kernel"].startswith("tma_")]
    assert {r["kernel"] for r in tma} == {s.name for s in compile_check.kernel_specs("cuda") if s.name.startswith("tma_")}
    assert len(tma) == 6
    for row in tma:
        assert row["ok"] and row["spills"] == 0, row
        assert "UTMALDG" in row["sass"] and "HGMMA" in row["sass"], row
    plain = [r for r in default_rows if r["target"] == "cuda" and r["kernel"].startswith("grouped_mm_fwd")]
    assert plain and all("HGMMA" in r["sass"] and "UTMALDG" not in r["sass"] for r in plain), plain


def test_int8_grouped_gemm_uses_integer_mma(default_rows):
    """The int8 grouped GEMM's three variants and the int8 weight gradient's two (stored and
    transposed layout) compile without spills to the integer tensor-core MMA: wgmma's int8 form
    (IGMMA) or mma.sync's (IMMA) in the sm_90 SASS, ``v_mfma_i32_*`` in the gfx942 amdgcn; no float
    MMA in either."""
    rows = [r for r in default_rows if r["kernel"].startswith("int8_")]
    assert {(r["kernel"], r["target"]) for r in rows} == {
        (s.name, t) for t in ("cuda", "hip") for s in compile_check.kernel_specs(t) if s.name.startswith("int8_")}
    assert len(rows) == 10
    assert sum(r["kernel"].startswith("int8_grouped_wgrad") for r in rows) == 4
    for row in rows:
        assert row["ok"] and row["spills"] == 0, row
        if row["target"] == "hip":
            assert "v_mfma_i32" in row["sass"] and "v_mfma_f32" not in row["sass"], row
        elif compile_check._cuobjdump() is not None:
            assert {"IGMMA", "IMMA"} & set(row["sass"]) and "HGMMA" not in row["sass"], row



def test_fp8_grouped_gemm_uses_fp8_mma(default_rows):
    """The fp8 grouped GEMM's five variants (e4m3 forward with and without the gather, in both weight
    layouts; e5m2 input gradients in both) and the fp8 weight gradient's two compile for sm_90 without
    spills to wgmma's fp8 form (QGMMA), with no 16-bit float MMA; the weight gradient's operands,
    stored by column with each expert's rows aligned, are copied to shared memory asynchronously
    (LDGSTS), and so are the forward's gathered rows."""
    rows = {r["kernel"]: r for r in default_rows if r["kernel"].startswith("fp8_")}
    assert set(rows) == {s.name for s in compile_check.kernel_specs("cuda") if s.name.startswith("fp8_")}
    assert len(rows) == 7 and all(r["target"] == "cuda" for r in rows.values())
    for row in rows.values():
        assert row["ok"] and row["spills"] == 0, row
        if compile_check._cuobjdump() is not None:
            assert "QGMMA" in row["sass"] and "HGMMA" not in row["sass"], row
    if compile_check._cuobjdump() is not None:
        for name in ("fp8_grouped_wgrad[W]", "fp8_grouped_wgrad[W^T]", "fp8_grouped_mm[W^T+gather]"):
            assert "LDGSTS" in rows[name]["sass"], rows[name]