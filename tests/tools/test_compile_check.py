"""The compile check: every Triton kernel compiles for sm_90, sm_100a and gfx942, default configs without
spills, no int32 row-index x stride products in pointer offsets.

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
from fastmoe_xpu.kernels.triton import (  # noqa: E402
    combine, counting, fp8_block_gemm, fp8_gemm, grouped_gemm, indices, int8_gemm, tma_gemm,
)
from fastmoe_xpu.tools import compile_check, offset_check  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
KERNEL_MODULES = (counting, indices, grouped_gemm, combine)
#: Kernels compiled for some targets only: the TMA grouped GEMMs and the fp8 ones are NVIDIA's (sm_90+, sm_89+).
TARGET_MODULES = {"cuda": (tma_gemm, int8_gemm, fp8_gemm, fp8_block_gemm), "hip": (int8_gemm,), "xpu": (int8_gemm,)}
TARGET_MODULES["sm100"] = TARGET_MODULES["cuda"]  # Blackwell compiles the sm_90 kernel set


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


@pytest.mark.parametrize("target", ["cuda", "sm100", "hip", "xpu"])
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
    for target in ("cuda", "sm100", "hip", "xpu"):
        for spec in compile_check.kernel_specs(target):
            callees = _callees(spec.fn)
            assert all(isinstance(c, JITFunction) for c in callees.values()), (spec.name, callees)
            reached |= set(callees)
    assert {"token_slots", "tile", "slot_row"} <= reached  # token_slots calls tile: reached through a helper


@pytest.fixture(scope="module")
def default_rows(tmp_path_factory):
    """The rows of ``python -m fastmoe_xpu.tools.compile_check --defaults-only`` for sm_90, sm_100a and
    gfx942 (one compile run per target, the three side by side on the machine's cores; shared by the
    tests that read them)."""
    out = tmp_path_factory.mktemp("compile")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    procs = {}
    try:
        for target in compile_check.TARGETS:
            procs[target] = subprocess.Popen(
                [sys.executable, "-m", "fastmoe_xpu.tools.compile_check", "--target", target, "--defaults-only",
                 "--json", str(out / f"{target}.json")],
                cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            )
        rows = []
        for target, proc in procs.items():
            log, _ = proc.communicate(timeout=1200)
            print(log)
            assert proc.returncode == 0, f"compile_check --target {target}:\n" + log[-6000:]
            rows += json.loads((out / f"{target}.json").read_text())
        return rows
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def test_compile_check_defaults_compile_without_spills(default_rows):
    """Every kernel variant's default config compiles for sm_90, sm_100a and gfx942 without spills,
    and no kernel forms a row-index x stride product in int32 (``i32_offsets``)."""
    rows = default_rows
    n_variants = sum(len({s.name for s in compile_check.kernel_specs(t)}) for t in compile_check.TARGETS)
    assert len(rows) == n_variants
    for row in rows:
        assert row["ok"], row
        assert row["registers"] and row["registers"] > 0, row
        assert row["spills"] == 0, row
        assert row["shared_ok"], row
        assert row["i32_offsets"] == [], row
    assert {r["target"] for r in rows} == {"cuda", "sm100", "hip"}


def _triton_version() -> tuple[int, int]:
    import triton

    major, minor = triton.__version__.split(".")[:2]
    return int(major), int(minor)


def test_blackwell_kernels_use_tcgen05(default_rows):
    """On sm_100a every kernel that multiplies matrices on sm_90 (wgmma) does so with tcgen05, the
    fifth-generation tensor core's MMA (``tcgen05.mma`` in the PTX; UTCHMMA on bf16 and UTCIMMA on
    int8 in the SASS where ``cuobjdump`` ships with Triton); the TMA kernels load through TMA there
    too; the kernels without a matrix product have none. Triton before 3.9 (3.6 was seen) lowers
    int8 dots on sm_100a to mma.sync (IMMA) instead: still the integer MMA, never a float one."""
    by = {(r["kernel"], r["target"]): r for r in default_rows}
    sm100 = [r for r in default_rows if r["target"] == "sm100"]
    assert {r["kernel"] for r in sm100} == {r["kernel"] for r in default_rows if r["target"] == "cuda"}
    gemms = {r["kernel"] for r in sm100 if by[(r["kernel"], "cuda")]["mma"] != "-"}
    assert {"gate_up_fwd", "grouped_mm_fwd[W^T]", "grouped_mm_bwd[rows]", "int8_grouped_mm[W]"} <= gemms
    assert all(by[(k, "cuda")]["mma"] in ("wgmma", "mma.sync") for k in gemms)
    int8_tcgen05 = _triton_version() >= (3, 9)
    for row in sm100:
        if row["kernel"] not in gemms:
            assert row["mma"] == "-", row
        elif row["kernel"].startswith("int8_") and not int8_tcgen05:
            assert row["mma"] in ("tcgen05", "mma.sync"), row
        else:
            assert row["mma"] == "tcgen05", row
    if compile_check._cuobjdump() is None:
        return
    for row in sm100:
        utc = {m for m in row["sass"] if m.startswith("UTC")}
        if row["kernel"].startswith("int8_"):
            assert utc == {"UTCIMMA"} if row["mma"] == "tcgen05" else (not utc and "IMMA" in row["sass"]), row
        elif row["kernel"].startswith(("fp8_", "fp8b_")) and row["kernel"] in gemms:
            assert utc == {"UTCQMMA"}, row  # fp8 operands: tcgen05's narrow-float form
        elif row["kernel"] in gemms:
            assert utc and "UTCIMMA" not in utc and "UTCQMMA" not in utc, row
        else:
            assert not utc, row
        assert not {"HGMMA", "IGMMA"} & set(row["sass"]), row  # no Hopper wgmma on Blackwell
        if row["kernel"].startswith("tma_"):
            assert "UTMALDG" in row["sass"], row


def test_tma_kernels_use_tma_and_wgmma_on_sm90(default_rows):
    """The persistent grouped GEMMs as compiled for sm_90: their SASS (read by ``cuobjdump -sass``,
    which ships with Triton) loads through TMA (UTMALDG) into wgmma (HGMMA), without spills; the
    plain grouped GEMMs, for contrast, do not use TMA."""
    if compile_check._cuobjdump() is None:
        pytest.skip("no cuobjdump: this triton ships without backends/nvidia/bin/cuobjdump")
    tma = [r for r in default_rows if r["target"] == "cuda" and r["kernel"].startswith("tma_")]
    assert {r["kernel"] for r in tma} == {s.name for s in compile_check.kernel_specs("cuda") if s.name.startswith("tma_")}
    assert len(tma) == 5  # tma_gate_up_fwd, tma_grouped_mm x2, tma_grouped_mm_bwd x2
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
    rows = [r for r in default_rows if r["kernel"].startswith("int8_") and r["target"] in ("cuda", "hip")]
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
    rows = {r["kernel"]: r for r in default_rows if r["kernel"].startswith("fp8_") and r["target"] == "cuda"}
    assert set(rows) == {s.name for s in compile_check.kernel_specs("cuda") if s.name.startswith("fp8_")}
    assert len(rows) == 7
    for row in rows.values():
        assert row["ok"] and row["spills"] == 0, row
        if compile_check._cuobjdump() is not None:
            assert "QGMMA" in row["sass"] and "HGMMA" not in row["sass"], row
    if compile_check._cuobjdump() is not None:
        for name in ("fp8_grouped_wgrad[W]", "fp8_grouped_wgrad[W^T]", "fp8_grouped_mm[W^T+gather]"):
            assert "LDGSTS" in rows[name]["sass"], rows[name]


def test_fp8_block_gemms_use_fp8_mma(default_rows):
    """The block-scaled fp8 GEMMs (``fp8-block``: seven row-GEMM variants, four weight-gradient
    variants) compile for sm_90 without spills to wgmma's fp8 form (QGMMA) and no 16-bit float MMA,
    though their operands arrive in the activations' dtype: the codes are made in registers, so the
    only MMA is the fp8 one; the weights' block quantizer has no matrix product."""
    rows = {r["kernel"]: r for r in default_rows if r["kernel"].startswith("fp8b_") and r["target"] == "cuda"}
    assert set(rows) == {s.name for s in compile_check.kernel_specs("cuda") if s.name.startswith("fp8b_")}
    assert len(rows) == 12
    for name, row in rows.items():
        assert row["ok"] and row["spills"] == 0, row
        if name == "fp8b_weight":
            assert row["mma"] == "-", row
            continue
        assert row["mma"] == "wgmma", row
        if compile_check._cuobjdump() is not None:
            assert "QGMMA" in row["sass"] and "HGMMA" not in row["sass"], row


def test_offset_check_finds_planted_int32_products():
    """The offset check fails when a row-index x stride product is formed in int32: each real kernel
    with one ``.to(tl.int64)`` taken out (the down GEMM's first row, the gate/up forward's gathered
    token rows, the token count's block start) is flagged at the line of the product, and the same
    kernels loaded the same way but unchanged are not (tests/tools/plant_int32_offsets.py)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    env.pop("TRITON_INTERPRET", None)
    res = subprocess.run([sys.executable, str(Path(__file__).with_name("plant_int32_offsets.py"))], cwd=REPO,
                         env=env, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stdout[-4000:] + res.stderr[-4000:]
    found = json.loads(res.stdout.strip().splitlines()[-1])
    assert found["grouped_mm_fwd: control"] == [] and found["gate_up_fwd: control"] == []
    planted = found["grouped_mm_fwd: row0 int32"]
    assert any("a_ptrs = a_ptr + rows[:, None] * K" in f for f in planted), planted
    assert any("out_ptr + rows[:, None] * N" in f for f in planted), planted
    assert [f.split(": ", 1)[1] for f in found["gate_up_fwd: tok int32"]] == [
        "a_ptrs = x_ptr + tok[:, None] * H + offs_k[None, :]"]
    assert any("tok = b * block_size + offs_t" in f for f in found["count_tokens: tok int32"])


#: A hand-written TTIR: a loaded row index times the argument ``%H`` in int32, carried into a loop
#: as a pointer offset; a tile start (program id times a constant) and an int64 product beside it.
_TTIR = """module {
  tt.func public @k(%x_ptr: !tt.ptr<bf16> loc("x_ptr"(#loc)), %idx_ptr: !tt.ptr<i32> loc("idx_ptr"(#loc)), %H: i32 loc("H"(#loc))) attributes {noinline = false} {
    %c0_i32 = arith.constant 0 : i32 loc(#loc1)
    %c16_i32 = arith.constant 16 : i32 loc(#loc1)
    %pid = tt.get_program_id x : i32 loc(#loc2)
    %start = arith.muli %pid, %c16_i32 : i32 loc(#loc2)
    %r = tt.make_range {end = 16 : i32, start = 0 : i32} : tensor<16xi32> loc(#loc2)
    %s = tt.splat %start : i32 -> tensor<16xi32> loc(#loc2)
    %rows = arith.addi %s, %r : tensor<16xi32> loc(#loc2)
    %ip = tt.splat %idx_ptr : !tt.ptr<i32> -> tensor<16x!tt.ptr<i32>> loc(#loc3)
    %ip2 = tt.addptr %ip, %rows : tensor<16x!tt.ptr<i32>>, tensor<16xi32> loc(#loc3)
    %tok = tt.load %ip2 : tensor<16x!tt.ptr<i32>> loc(#loc3)
    %h = tt.splat %H : i32 -> tensor<16xi32> loc(#loc4)
    %off = arith.muli %tok, %h : tensor<16xi32> loc(#loc4)
    %tok64 = arith.extsi %tok : tensor<16xi32> to tensor<16xi64> loc(#loc5)
    %h64 = arith.extsi %h : tensor<16xi32> to tensor<16xi64> loc(#loc5)
    %off64 = arith.muli %tok64, %h64 : tensor<16xi64> loc(#loc5)
    %xp = tt.splat %x_ptr : !tt.ptr<bf16> -> tensor<16x!tt.ptr<bf16>> loc(#loc5)
    %safe = tt.addptr %xp, %off64 : tensor<16x!tt.ptr<bf16>>, tensor<16xi64> loc(#loc5)
    %acc = scf.for %k = %c0_i32 to %H step %c16_i32 iter_args(%o = %off) -> (tensor<16xi32>)  : i32 {
      %p = tt.addptr %xp, %o : tensor<16x!tt.ptr<bf16>>, tensor<16xi32> loc(#loc6)
      %next = arith.addi %o, %r : tensor<16xi32> loc(#loc6)
      scf.yield %next : tensor<16xi32> loc(#loc6)
    } loc(#loc6)
    tt.return loc(#loc6)
  } loc(#loc)
} loc(#loc)
#loc = loc("/nowhere/k.py":1:0)
#loc1 = loc("/nowhere/k.py":2:0)
#loc2 = loc("/nowhere/k.py":3:0)
#loc3 = loc("/nowhere/k.py":4:0)
#loc4 = loc("off"("/nowhere/k.py":5:0))
#loc5 = loc("/nowhere/k.py":6:0)
#loc6 = loc(callsite("/nowhere/k.py":7:0 at "/nowhere/k.py":8:0))
"""


def test_offset_check_reads_ttir():
    """Only the int32 product of the loaded row index and ``%H`` is found (it reaches a pointer
    through a loop's carried value), named by its location; the tile start (a product with a
    constant) and the int64 product are not; the product removed, nothing is."""
    assert offset_check.int32_offset_products(_TTIR) == ["k.py:5"]
    clean = _TTIR.replace("%off = arith.muli %tok, %h : tensor<16xi32>", "%off = arith.addi %tok, %h : tensor<16xi32>")
    assert offset_check.int32_offset_products(clean) == []
