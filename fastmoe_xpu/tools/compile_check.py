"""Compile every Triton kernel with every config for real GPU targets, without a GPU.

``python -m fastmoe_xpu.tools.compile_check [--target cuda|sm100|hip|all] [--defaults-only] [--kernels PREFIX]
[--json PATH]`` (``--target xpu`` hands over to :mod:`fastmoe_xpu.tools.compile_xpu`, run with ``.venv-xpu``).

For each kernel (and each constexpr variant the launchers use, e.g. the down GEMM's ``TRANS_W``
forward and input-gradient forms), each config of ``configs.py`` and each target it builds
``triton.compile(ASTSource(fn, signature, constexprs, attrs), target=GPUTarget(...))`` and prints
registers, spills and shared memory:

* ``cuda`` = ``GPUTarget("cuda", 90, 32)`` (H100): registers and spill bytes from
  ``cuobjdump --dump-resource-usage`` (shipped in Triton's ``backends/nvidia/bin``) on the cubin
  (``REG``, ``LOCAL``); the compiled kernel's ``n_regs``/``n_spills`` metadata where that tool is
  missing; and which of HGMMA (wgmma), UTMALDG / UTMASTG (TMA) and LDGSTS (cp.async) the SASS
  (``cuobjdump -sass``) contains (the row's ``sass``).
* ``sm100`` = ``GPUTarget("cuda", 100, 32)`` (B200, PTX ``.target sm_100a``; Triton ships
  ``ptxas-blackwell`` for it): the same readings, the SASS markers being the fifth-generation tensor
  core's MMAs (tcgen05: UTCHMMA on 16-bit floats, UTCIMMA on int8, UTCQMMA on fp8) beside TMA and
  cp.async. Its configs are ``configs.py``'s ``sm100`` table; its kernel variants are ``cuda``'s.
* ``hip`` = ``GPUTarget("hip", "gfx942", 64)`` (MI300X): ``.vgpr_count``, ``.vgpr_spill_count`` and
  ``.sgpr_spill_count`` from the amdgcn text, and which MFMA forms (integer ``v_mfma_i32``, float
  ``v_mfma_f32``) it contains (the row's ``sass`` column too).

Every row also names its MMA instruction family (``mma``: ``tcgen05``, ``wgmma`` or ``mma.sync`` from
the PTX, ``mfma`` from the amdgcn, ``-`` for kernels without a matrix product) and lists the int32
products of a run-time value and a kernel argument (a row index times a stride) that reach a
pointer offset in its TTIR (``i32_offsets``, :mod:`fastmoe_xpu.tools.offset_check`): such a product
wraps once a buffer passes 2^31 elements, so any finding fails the check.

:func:`fastmoe_xpu.tools.kernel_specs.kernel_specs` is the shared description of what to compile
(also used for Intel XPU by :mod:`fastmoe_xpu.tools.compile_xpu`).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from typing import Any

# The specs must hold compiled-mode kernels: drop the interpreter switch before the kernel modules
# are imported by this process (``python -m``); imported as a library, kernels are re-wrapped below.
if __name__ == "__main__":
    if os.environ.pop("TRITON_INTERPRET", "0") not in ("", "0") and "triton" in sys.modules:
        # Too late for this process: importing the package (torch.compiler's decorators import
        # torch._dynamo, which imports triton) already fixed triton's library functions in interpreter
        # mode, and tl.dot kernels would not compile. Start again without the switch.
        os.execv(sys.executable, [sys.executable, "-m", __spec__.name, *sys.argv[1:]])

from .kernel_specs import NVIDIA_TARGETS, KernelSpec, kernel_specs  # noqa: E402
from .offset_check import int32_offset_products  # noqa: E402

TARGETS = ("cuda", "sm100", "hip")

#: Hardware limits to judge shared memory against (bytes per block / workgroup): sm_90 and sm_100
#: both allow 227 KiB of shared memory per block.
SHARED_LIMIT = {"cuda": 232448, "sm100": 232448, "hip": 65536, "xpu": 131072}

#: ``GPUTarget`` arguments of each target.
GPU_TARGETS = {"cuda": ("cuda", 90, 32), "sm100": ("cuda", 100, 32), "hip": ("hip", "gfx942", 64)}


# ---------------------------------------------------------------- compiling and reading resources
def _gpu_target(target: str):
    from triton.backends.compiler import GPUTarget

    return GPUTarget(*GPU_TARGETS[target])


def compile_spec(spec: KernelSpec, target: str):
    import triton
    from triton.compiler import ASTSource

    arg_names = list(spec.fn.arg_names)
    attrs = {(arg_names.index(a),): [["tt.divisibility", 16]] for a in spec.divisible_by_16}
    src = ASTSource(fn=spec.fn, signature=spec.signature, constexprs=spec.constexprs, attrs=attrs)
    return triton.compile(src, target=_gpu_target(target), options=spec.options())


def _cuobjdump() -> str | None:
    import triton

    path = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    return path if os.access(path, os.X_OK) else shutil.which("cuobjdump")


def cuda_resources(compiled) -> tuple[int | None, int | None]:
    """``(registers, spill bytes)`` of an sm_90 or sm_100a kernel."""
    tool = _cuobjdump()
    if tool is not None:
        with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
            f.write(compiled.asm["cubin"])
            f.flush()
            out = subprocess.run([tool, "--dump-resource-usage", f.name], capture_output=True, text=True).stdout
        m = re.search(r"REG:(\d+).*?LOCAL:(\d+)", out)
        if m:
            return int(m.group(1)), int(m.group(2))
    md = compiled.metadata
    return getattr(md, "n_regs", None), getattr(md, "n_spills", None)


#: SASS instructions whose presence the check reports: Hopper's tensor-core MMA (wgmma: HGMMA on
#: 16/32-bit floats, IGMMA on int8, QGMMA on fp8), the integer and fp8 MMAs of mma.sync (IMMA, QMMA),
#: TMA loads and stores, and cp.async copies.
SASS_MARKERS = ("HGMMA", "IGMMA", "QGMMA", "IMMA", "QMMA", "UTMALDG", "UTMASTG", "LDGSTS")
#: Blackwell's (sm_100a) tensor-core MMAs, issued through tcgen05 (accumulators in tensor memory):
#: on 16-bit floats, int8, fp8 (and fp6/fp4), and the block-scaled narrow forms.
TCGEN05_MARKERS = ("UTCHMMA", "UTCIMMA", "UTCQMMA", "UTCOMMA")


def cuda_sass(compiled) -> list[str]:
    """Which of :data:`SASS_MARKERS` and :data:`TCGEN05_MARKERS` the kernel's SASS (``cuobjdump
    -sass`` of the cubin) contains; empty where that tool is missing."""
    tool = _cuobjdump()
    if tool is None:
        return []
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        sass = subprocess.run([tool, "-sass", f.name], capture_output=True, text=True).stdout
    return [m for m in SASS_MARKERS + TCGEN05_MARKERS if re.search(rf"\b{m}\b", sass)]


def mma_family(compiled, target: str) -> str:
    """The matrix-multiply instruction family a kernel uses, read from its PTX (NVIDIA: ``tcgen05``
    for Blackwell's ``tcgen05.mma``, ``wgmma`` for Hopper's ``wgmma.mma_async``, ``mma.sync``) or
    amdgcn (``mfma``); ``-`` for none. Needs no disassembler."""
    if target == "hip":
        return "mfma" if re.search(r"^\s*v_mfma_", compiled.asm["amdgcn"], re.M) else "-"
    ptx = compiled.asm["ptx"]
    for family, pattern in (("tcgen05", r"\btcgen05\.mma\b"), ("wgmma", r"\bwgmma\.mma_async\b"),
                            ("mma.sync", r"\bmma\.sync\b")):
        if re.search(pattern, ptx):
            return family
    return "-"


#: amdgcn instructions whose presence the check reports for gfx942: the matrix cores' integer
#: (int8 -> int32) and float MFMAs.
HIP_MARKERS = ("v_mfma_i32", "v_mfma_f32")


def hip_isa(compiled) -> list[str]:
    """Which of :data:`HIP_MARKERS` a gfx942 kernel's amdgcn contains (as instruction prefixes)."""
    text = compiled.asm["amdgcn"]
    return [m for m in HIP_MARKERS if re.search(rf"^\s*{m}_", text, re.M)]


def hip_resources(compiled) -> tuple[int | None, int | None]:
    """``(VGPRs, VGPR + SGPR spill count)`` of a gfx942 kernel."""
    text = compiled.asm["amdgcn"]
    vgpr = re.search(r"\.vgpr_count:\s+(\d+)", text)
    vspill = re.search(r"\.vgpr_spill_count:\s+(\d+)", text)
    sspill = re.search(r"\.sgpr_spill_count:\s+(\d+)", text)
    spills = None
    if vspill or sspill:
        spills = int(vspill.group(1) if vspill else 0) + int(sspill.group(1) if sspill else 0)
    return (int(vgpr.group(1)) if vgpr else None), spills


def run_check(targets: tuple[str, ...] = TARGETS, defaults_only: bool = False,
              prefix: str = "") -> list[dict[str, Any]]:
    """One row per compiled (kernel variant, config, target); ``prefix``: only kernels whose spec
    name starts with it."""
    rows = []
    for target in targets:
        for spec in kernel_specs(target):
            if (defaults_only and not spec.is_default) or not spec.name.startswith(prefix):
                continue
            t0 = time.time()
            row: dict[str, Any] = {"kernel": spec.name, "config": spec.config_name, "target": target,
                                   "default": spec.is_default, "num_warps": spec.num_warps,
                                   "num_stages": spec.num_stages}
            try:
                compiled = compile_spec(spec, target)
            except Exception as exc:  # a kernel that does not compile is a result, not a crash
                row.update(ok=False, error=f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}")
                rows.append(row)
                continue
            nvidia = target in NVIDIA_TARGETS
            regs, spills = cuda_resources(compiled) if nvidia else hip_resources(compiled)
            shared = int(getattr(compiled.metadata, "shared", 0) or 0)
            row["sass"] = cuda_sass(compiled) if nvidia else hip_isa(compiled)
            row.update(ok=True, registers=regs, spills=spills, shared=shared,
                       shared_ok=shared <= SHARED_LIMIT[target], mma=mma_family(compiled, target),
                       i32_offsets=int32_offset_products(compiled.asm["ttir"]),
                       seconds=round(time.time() - t0, 2))
            rows.append(row)
    return rows


def format_table(rows: list[dict[str, Any]]) -> str:
    head = ("kernel", "config", "target", "warps", "stages", "registers", "spills", "shared", "mma", "sass",
            "status")
    lines = []
    for r in rows:
        if r["ok"]:
            status = "ok" if r["spills"] in (0, None) and r["shared_ok"] else "SPILLS" if r["spills"] else "SHARED>LIMIT"
            if r.get("i32_offsets"):
                status = "INT32 OFFSETS"
            status += " (default)" if r["default"] else ""
            vals = (r["kernel"], r["config"], r["target"], r["num_warps"], r["num_stages"], r["registers"],
                    r["spills"], r["shared"], r.get("mma", "-"), "+".join(r.get("sass", [])) or "-", status)
        else:
            vals = (r["kernel"], r["config"], r["target"], r["num_warps"], r["num_stages"], "-", "-", "-", "-", "-",
                    "FAILED: " + r["error"])
        lines.append(tuple(str(v) for v in vals))
    widths = [max(len(h), *(len(l[i]) for l in lines)) if lines else len(h) for i, h in enumerate(head)]
    fmt = " | ".join(f"{{:<{w}}}" for w in widths)
    out = [fmt.format(*head), "-+-".join("-" * w for w in widths)]
    out += [fmt.format(*l) for l in lines]
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", choices=(*TARGETS, "all", "xpu"), default="all",
                        help="cuda: sm_90 (H100); sm100: sm_100a (B200); hip: gfx942 (MI300X); all: these three; "
                             "xpu: Intel PVC through tools/compile_xpu.py (run it with .venv-xpu/bin/python)")
    parser.add_argument("--defaults-only", action="store_true", help="compile only each kernel's default config")
    parser.add_argument("--json", metavar="PATH", help="also write the rows as JSON")
    parser.add_argument("--kernels", metavar="PREFIX", default="",
                        help="only kernels whose name starts with PREFIX (int8, tma, grouped_mm, ...)")
    args, rest = parser.parse_known_args(argv)
    if args.target == "xpu":
        from .compile_xpu import main as xpu_main

        if args.defaults_only:
            parser.error("--defaults-only is not available for --target xpu")
        return xpu_main(rest + (["--json", args.json] if args.json else []))
    if rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    targets = TARGETS if args.target == "all" else (args.target,)
    rows = run_check(targets, args.defaults_only, args.kernels)
    print(format_table(rows))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(rows, f, indent=1)
    failed = [r for r in rows if not r["ok"]]
    bad_defaults = [r for r in rows if r["ok"] and r["default"] and (r["spills"] or not r["shared_ok"])]
    wrapping = [r for r in rows if r["ok"] and r["i32_offsets"]]
    for kernel in sorted({r["kernel"] for r in wrapping}):
        found = next(r["i32_offsets"] for r in wrapping if r["kernel"] == kernel)
        print(f"\n{kernel}: int32 row-index x stride products in pointer offsets (form them in int64):",
              *(f"  {f}" for f in found), sep="\n", file=sys.stderr)
    if failed or bad_defaults or wrapping:
        print(f"\n{len(failed)} failed, {len(bad_defaults)} default configs spill or exceed shared memory, "
              f"{len(wrapping)} with int32 offset products", file=sys.stderr)
        return 1
    print(f"\n{len(rows)} kernels compiled, default configs without spills, no int32 offset products")
    return 0


if __name__ == "__main__":
    sys.exit(main())
