"""Intel XPU compile gate: every Triton kernel compiled for Ponte Vecchio (PVC) without a GPU.

Run it with the interpreter of ``.venv-xpu`` (``scripts/setup_xpu_venv.sh`` builds it; Intel's
Triton build installs a module named ``triton`` too, so it has a venv of its own)::

    .venv-xpu/bin/python -m fastmoe_xpu.tools.compile_check --target xpu

For every ``KernelSpec`` of ``kernel_specs.kernel_specs("xpu")`` (every kernel, every XPU config):

1. ``triton.compile`` for ``GPUTarget("xpu", PVC_PROPERTIES, 16)`` down to SPIR-V;
2. the TTGIR must give every ``tt.dot`` of the TTIR a ``#triton_intel_gpu.dpas`` result encoding
   (otherwise Intel's backend lowered it to FMA loops), and the dot operands are traced back to
   their ``tt.load``s to see whether those carry ``triton_intel_gpu.block_io`` (2D block loads);
3. ``ocloc compile -spirv_input -device pvc`` with the kernel's own build flags (GRF mode), with
   IGC's shader dump on, whose ``.asm`` headers give the GRF count and the spilled variables.

Exit status 1 if a kernel fails to compile for PVC or a GEMM misses DPAS.

Debian's IGC (the ``intel-opencl-icd`` package, 2022) predates Intel's current drivers: it does not
know the 2D block-IO builtins, so it leaves them as function calls (the ``calls`` column), and its
spill figures are a relative signal for comparing configs and kernels, not what a current driver
will produce.

Intel-only modules are imported inside functions, so the main venv can import this file.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Iterable, Sequence

# SYCL's enum value of intel_gpu_pvc (sycl::ext::oneapi::experimental::architecture), which the
# backend maps to ocloc's device name "pvc".
PVC_ARCHITECTURE = 0x030F000700

# What a Max 1550 tile reports through SYCL; the backend reads only these keys.
PVC_PROPERTIES: dict[str, Any] = {
    "name": "Intel(R) Data Center GPU Max 1550",
    "architecture": PVC_ARCHITECTURE,
    "has_subgroup_matrix_multiply_accumulate": True,
    "has_subgroup_matrix_multiply_accumulate_tensor_float32": False,
    "has_subgroup_2d_block_io": True,
    "has_bfloat16_conversions": True,
    "has_fp64": True,
    "sub_group_sizes": [16, 32],
    "max_work_group_size": 1024,
    "max_num_sub_groups": 64,
}
PVC_WARP_SIZE = 16

IGC_CAVEAT = (
    "Native code comes from Debian's IGC (intel-opencl-icd, 2022), older than Intel's current drivers: "
    "it keeps the 2D block-IO builtins as function calls ('calls'), so its GRF use and spill bytes are "
    "a relative signal between configs and kernels, not what a current driver will do."
)

_DPAS_ENCODING = re.compile(r"^#(?:triton_intel_gpu|ttig)\.dpas<")
_ALIAS_DEF = re.compile(r"^(#[\w.$-]+)\s*=\s*(.*)$")
_VALUE = re.compile(r"%[\w$.-]+(?:#\d+)?")
_DEF = re.compile(r"^\s*(%[\w$.-]+)(?::\d+)?(?:\s*,\s*%[\w$.-]+)*\s*=\s*\"?([\w.]+)\"?(.*)$")
_ITER_ARGS = re.compile(r"iter_args\((.*?)\)\s*->")
_ITER_PAIR = re.compile(r"(%[\w$.-]+)\s*=\s*(%[\w$.-]+(?:#\d+)?)")
_BLOCK_IO = re.compile(r"block_io\s*=\s*\"(\w+)\"")

# Ops that hand a dot operand through unchanged in content (layout, memory space, dtype casts),
# so that the trace from tt.dot reaches the tt.load that fetched the matrix.
_PASS_THROUGH = {
    "ttg.convert_layout", "ttg.local_load", "ttg.local_alloc", "ttg.memdesc_subview", "ttg.memdesc_index",
    "ttg.memdesc_trans", "ttg.memdesc_reshape", "tt.trans", "tt.reshape", "tt.broadcast", "tt.expand_dims",
    "arith.truncf", "arith.extf", "arith.bitcast", "tt.bitcast", "tt.fp_to_fp", "arith.sitofp", "arith.uitofp",
}


@dataclass
class XpuResult:
    kernel: str
    config: str
    is_default: bool
    expect_dpas: bool = True
    compiled: bool = False            # triton.compile reached SPIR-V
    error: str = ""
    dots: int = 0                     # tt.dot ops in the TTIR
    dpas_dots: int = 0                # tt.dot ops in the TTGIR with a DPAS result encoding
    ttgir_dots: int = 0
    operand_loads: int = 0            # dot operands traced back to a tt.load
    block_io_loads: int = 0           # ... of which carry triton_intel_gpu.block_io
    block_io_kinds: list[str] = field(default_factory=list)
    build_flags: str = ""
    ocloc_ok: bool = False
    ocloc_log: str = ""
    grf: int | None = None            # GRFs per thread in the native code (128 small, 256 large)
    ra_type: str = ""
    spill_bytes: int | None = None    # scratch bytes the register allocator spilled values to
    spilled_values: int | None = None
    calls: int | None = None          # calla instructions (builtins Debian's IGC leaves as calls)
    native_dpas: int | None = None    # dpas instructions in the native code
    dpas_types: list[str] = field(default_factory=list)  # their operand types, "src1*src2->dst" (b*b->d: int8)
    seconds: float = 0.0

    @property
    def all_dots_dpas(self) -> bool:
        return self.dpas_dots == self.ttgir_dots and self.ttgir_dots >= self.dots

    @property
    def dpas_ok(self) -> bool:
        """No dot, or every dot on DPAS in the TTGIR and DPAS instructions in the native code."""
        if self.dots == 0:
            return True
        return self.all_dots_dpas and (self.native_dpas or 0) > 0

    @property
    def passed(self) -> bool:
        return self.compiled and self.ocloc_ok and self.dpas_ok

    @property
    def as_expected(self) -> bool:
        """The gate's verdict matches the spec's expectation (the probe's negative control expects
        to miss DPAS; every real kernel expects to pass)."""
        if self.expect_dpas:
            return self.passed
        return self.compiled and self.ocloc_ok and self.dots > 0 and not self.dpas_ok


# ---------------------------------------------------------------------------------------------
# TTIR / TTGIR analysis (plain text, so it runs anywhere)


def count_dots(ir: str) -> int:
    return sum(1 for line in ir.splitlines() if re.search(r"=\s*tt\.dot\s", line))


def _aliases(ttgir: str) -> dict[str, str]:
    out = {}
    for line in ttgir.splitlines():
        m = _ALIAS_DEF.match(line)
        if m and not line.startswith("#loc"):
            out[m.group(1)] = m.group(2)
    return out


def _result_encoding(dot_line: str) -> str | None:
    m = re.search(r"->\s*tensor<[^,>]+,\s*(#[\w.$-]+(?:<.*>)?)>", dot_line)
    return m.group(1) if m else None


def _operands(rest: str) -> list[str]:
    """SSA operands of an op: the values before its attribute dict or type signature."""
    head = rest
    for stop in (" : ", " {", "{"):
        i = head.find(stop)
        if i >= 0:
            head = head[:i]
    return _VALUE.findall(head)


def analyse_ttgir(ttgir: str) -> dict[str, Any]:
    """Count DPAS dots and trace every dot's A and B operands back to their loads."""
    aliases = _aliases(ttgir)
    defs: dict[str, tuple[str, list[str], str]] = {}
    iter_init: dict[str, str] = {}
    smem_stores: dict[str, list[str]] = {}
    dots: list[tuple[list[str], str]] = []
    for line in ttgir.splitlines():
        code = line.split(" loc(")[0]
        for m in _ITER_ARGS.finditer(code):
            for arg, init in _ITER_PAIR.findall(m.group(1)):
                iter_init[arg] = init
        m = _DEF.match(code)
        if m:
            name, op, rest = m.group(1), m.group(2), m.group(3)
            defs[name] = (op, _operands(rest), code)
            if op == "tt.dot":
                dots.append((_operands(rest), code))
            continue
        m = re.match(r"^\s*ttg\.local_store\s+(.*)$", code)
        if m:
            ops = _operands(m.group(1))
            if len(ops) >= 2:
                smem_stores.setdefault(ops[1], []).append(ops[0])

    def root_buffer(v: str) -> str:
        for _ in range(32):
            d = defs.get(v)
            if not d or d[0] not in ("ttg.memdesc_subview", "ttg.memdesc_index") or not d[1]:
                return v
            v = d[1][0]
        return v

    stored_into: dict[str, list[str]] = {}
    for dst, srcs in smem_stores.items():
        stored_into.setdefault(root_buffer(dst), []).extend(srcs)

    def trace_load(v: str, depth: int = 0) -> str | None:
        """The defining line of the tt.load that produced v, if v is a loaded matrix."""
        if depth > 64:
            return None
        if v in iter_init:
            return trace_load(iter_init[v], depth + 1)
        d = defs.get(v)
        if d is None:
            return None
        op, ops, code = d
        if op == "tt.load":
            return code
        if op in ("ttg.local_load", "ttg.memdesc_subview", "ttg.memdesc_index") and ops:
            root = root_buffer(ops[0]) if op == "ttg.local_load" else root_buffer(v)
            if root in stored_into:
                return trace_load(stored_into[root][0], depth + 1)
        if op in _PASS_THROUGH and ops:
            return trace_load(ops[0], depth + 1)
        return None

    dpas = 0
    operand_loads = 0
    block_io = 0
    kinds: list[str] = []
    for ops, code in dots:
        enc = _result_encoding(code)
        enc_text = aliases.get(enc, enc or "")
        if _DPAS_ENCODING.match(enc_text):
            dpas += 1
        for operand in ops[:2]:
            load = trace_load(operand)
            if load is None:
                continue
            operand_loads += 1
            m = _BLOCK_IO.search(load)
            if m:
                block_io += 1
                kinds.append(m.group(1))
    return {"ttgir_dots": len(dots), "dpas_dots": dpas, "operand_loads": operand_loads,
            "block_io_loads": block_io, "block_io_kinds": sorted(set(kinds))}


# ---------------------------------------------------------------------------------------------
# ocloc and IGC's dump


def parse_igc_asm(text: str) -> dict[str, Any]:
    """GRF count, RA type, spilled values and their scratch bytes, calls and DPAS instructions
    (how many, and their operand types: ``bf*bf->f`` bf16, ``b*b->d`` int8 into int32) from one
    ``.asm`` file of IGC's shader dump."""
    grf = re.search(r"^//\.thread_config\s+numGRF=(\d+)", text, re.M)
    ra = re.search(r"^//\.RA type\s+(\S+)", text, re.M)
    spill_end = 0
    spilled = 0
    for m in re.finditer(r"size=(\d+)[^\n]*\(spilled -> Scratch\[(\d+)x(\d+)\]\)", text):
        size, slot, slot_bytes = int(m.group(1)), int(m.group(2)), int(m.group(3))
        spilled += 1
        spill_end = max(spill_end, slot * slot_bytes + size)
    calls = len(re.findall(r"^\s*(?:\(W\)\s*)?calla?\s", text, re.M))
    dpas = re.findall(r"^\s*(?:\(W\)\s*)?dpas\.\S+\s+\([^)]*\)\s+\S+?:(\w+)\s+\S+?:\w+\s+\S+?:(\w+)\s+\S+?:(\w+)",
                      text, re.M)
    return {"grf": int(grf.group(1)) if grf else None, "ra_type": ra.group(1) if ra else "",
            "spill_bytes": spill_end, "spilled_values": spilled, "calls": calls, "native_dpas": len(dpas),
            "dpas_types": sorted({f"{a}*{b}->{d}" for d, a, b in dpas})}


def run_ocloc(spv: bytes, kernel_name: str, build_flags: str, workdir: Path) -> dict[str, Any]:
    workdir.mkdir(parents=True, exist_ok=True)
    spv_path = workdir / f"{kernel_name}.spv"
    spv_path.write_bytes(spv)
    dump = workdir / "igc_dump"
    dump.mkdir(exist_ok=True)
    env = dict(os.environ, IGC_ShaderDumpEnable="1", IGC_DumpToCustomDir=str(dump))
    cmd = ["ocloc", "compile", "-file", str(spv_path), "-spirv_input", "-device", "pvc",
           "-options", build_flags, "-out_dir", str(workdir / "bin"), "-output_no_suffix"]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=workdir)
    log = (proc.stdout + proc.stderr).strip()
    ok = proc.returncode == 0 and "Build succeeded" in log
    out: dict[str, Any] = {"ocloc_ok": ok, "ocloc_log": log}
    asm = [p for p in sorted(dump.glob("*.asm")) if "Symbol_Table" not in p.name]
    mine = [p for p in asm if re.search(rf"^//\.kernel {re.escape(kernel_name)}\s*$",
                                         p.read_text(errors="replace"), re.M)]
    if mine:
        # Several SIMD widths would each have a file; report the worst.
        parsed = [parse_igc_asm(p.read_text(errors="replace")) for p in mine]
        out.update(max(parsed, key=lambda d: d["spill_bytes"]))
    elif ok:
        out["ocloc_ok"] = False
        out["ocloc_log"] = log + f"\n(no IGC .asm dump for kernel {kernel_name} in {dump})"
    return out


# ---------------------------------------------------------------------------------------------
# Compiling specs


def require_intel_triton() -> None:
    if importlib.util.find_spec("triton") is None or importlib.util.find_spec("triton.backends.intel") is None:
        raise RuntimeError(
            "Intel's Triton build (triton-xpu) is not importable from this interpreter; build .venv-xpu with "
            "scripts/setup_xpu_venv.sh and run .venv-xpu/bin/python -m fastmoe_xpu.tools.compile_check --target xpu"
        )
    if shutil.which("ocloc") is None:
        raise RuntimeError("ocloc not found: scripts/setup_xpu_venv.sh installs it (Debian package intel-opencl-icd)")
    # The backend compiles a small C++ helper with $CC; plain gcc misses libstdc++ symbols.
    os.environ.setdefault("CC", "g++")


def pvc_target() -> Any:
    from triton.backends.compiler import GPUTarget

    return GPUTarget("xpu", dict(PVC_PROPERTIES), PVC_WARP_SIZE)


def _attrs(spec: Any) -> dict[tuple[int, ...], list[list[Any]]]:
    """Divisibility facts the runtime would specialise on. ``spec.attrs`` wins when present;
    otherwise ``spec.divisible_by_16`` names them; otherwise every pointer argument (torch
    allocations are aligned). Intel's backend emits 2D block IO only for 16-divisible pointers and
    leading strides."""
    explicit = getattr(spec, "attrs", None)
    if explicit:
        return dict(explicit)
    names = list(spec.fn.arg_names)
    div = getattr(spec, "divisible_by_16", None)
    if div is None:
        div = [n for n, ty in spec.signature.items() if ty.startswith("*")]
    return {(names.index(n),): [["tt.divisibility", 16]] for n in div}


def compile_spec(spec: Any, workdir: Path, target: Any = None) -> XpuResult:
    import triton
    from triton.compiler import ASTSource

    t0 = time.perf_counter()
    res = XpuResult(kernel=spec.name, config=spec.config_name, is_default=bool(spec.is_default),
                    expect_dpas=bool(getattr(spec, "expect_dpas", True)))
    options = {"num_warps": spec.num_warps, "num_stages": spec.num_stages, **(spec.extra_options or {})}
    try:
        src = ASTSource(spec.fn, dict(spec.signature), constexprs=dict(spec.constexprs), attrs=_attrs(spec))
        kernel = triton.compile(src, target=target or pvc_target(), options=options)
    except Exception as exc:  # a compile failure is a result of the gate, not a crash of it
        res.error = f"{type(exc).__name__}: {str(exc).strip().splitlines()[-1] if str(exc).strip() else ''}"
        res.seconds = time.perf_counter() - t0
        return res
    res.compiled = True
    ttir, ttgir = kernel.asm["ttir"], kernel.asm["ttgir"]
    res.dots = count_dots(ttir)
    for k, v in analyse_ttgir(ttgir).items():
        setattr(res, k, v)
    res.build_flags = kernel.metadata.build_flags
    kdir = workdir / f"{spec.name}__{spec.config_name}"
    kdir.mkdir(parents=True, exist_ok=True)
    (kdir / "kernel.ttir").write_text(ttir)
    (kdir / "kernel.ttgir").write_text(ttgir)
    for k, v in run_ocloc(kernel.asm["spv"], kernel.metadata.name, res.build_flags, kdir).items():
        setattr(res, k, v)
    res.seconds = time.perf_counter() - t0
    return res


def _build_backend_helper(target: Any) -> None:
    """Instantiate the Intel backend once with stderr captured: it compiles a small C++ helper
    against SYCL's headers, which warn at length when not compiled with -fsycl. The text is shown
    only if that build fails."""
    from triton.compiler.compiler import make_backend

    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile(mode="w+b") as log:
        os.dup2(log.fileno(), 2)
        try:
            make_backend(target)
        except Exception:
            os.dup2(saved, 2)
            log.seek(0)
            sys.stderr.write(log.read().decode(errors="replace")[-4000:])
            raise
        finally:
            os.dup2(saved, 2)
            os.close(saved)


def check_specs(specs: Iterable[Any], workdir: Path, progress: bool = True) -> list[XpuResult]:
    target = pvc_target()
    _build_backend_helper(target)
    results = []
    for spec in specs:
        if progress:
            print(f"  compiling {spec.name} [{spec.config_name}] for pvc ...", file=sys.stderr, flush=True)
        results.append(compile_spec(spec, workdir, target))
    return results


# ---------------------------------------------------------------------------------------------
# Report


def least_spilling(results: Sequence[XpuResult]) -> dict[str, list[str]]:
    """Per kernel, the passing configs with the fewest spill bytes (ties all listed)."""
    best: dict[str, list[str]] = {}
    for kernel in dict.fromkeys(r.kernel for r in results):
        ok = [r for r in results if r.kernel == kernel and r.passed and r.spill_bytes is not None]
        if ok:
            low = min(r.spill_bytes for r in ok)
            best[kernel] = [r.config for r in ok if r.spill_bytes == low]
    return best


def _verdict(r: XpuResult) -> str:
    if not r.compiled:
        return "FAIL triton: " + r.error[:60]
    if not r.ocloc_ok:
        return "FAIL ocloc"
    if not r.dpas_ok:
        return "no DPAS (expected)" if not r.expect_dpas else "FAIL no DPAS"
    return "ok"


def format_table(results: Sequence[XpuResult]) -> str:
    head = ["kernel", "config", "dflt", "dots", "DPAS every dot", "2D block IO", "GRF", "spill B", "calls", "ocloc"]
    rows = []
    for r in results:
        if r.compiled:
            dpas = "-" if r.dots == 0 else f"{'yes' if r.dpas_ok else 'NO'} ({r.dpas_dots}/{r.ttgir_dots}, {r.native_dpas or 0} dpas)"
            bio = "-" if r.operand_loads == 0 else f"{r.block_io_loads}/{r.operand_loads} operands"
        else:
            dpas = bio = "?"
        grf = "?" if r.grf is None else f"{r.grf} ({'large' if r.grf >= 256 else 'small'})"
        rows.append([r.kernel, r.config, "*" if r.is_default else "", str(r.dots), dpas, bio, grf,
                     "?" if r.spill_bytes is None else str(r.spill_bytes),
                     "?" if r.calls is None else str(r.calls), _verdict(r)])
    widths = [max(len(x) for x in col) for col in zip(head, *rows)]
    line = lambda cells: " | ".join(c.ljust(w) for c, w in zip(cells, widths)).rstrip()  # noqa: E731
    out = [line(head), "-+-".join("-" * w for w in widths)]
    out += [line(row) for row in rows]
    return "\n".join(out)


def report(results: Sequence[XpuResult], elapsed: float) -> str:
    lines = [f"Intel XPU compile check: target pvc (GPUTarget('xpu', architecture=0x{PVC_ARCHITECTURE:010x}, "
             f"warp 16)), {len(results)} kernel configs, {elapsed:.1f} s", "", format_table(results), ""]
    lines.append("dots: tt.dot in TTIR; DPAS: (dots with a DPAS encoding in TTGIR / dots in TTGIR, dpas "
                 "instructions in native code); 2D block IO: dot operands loaded with 2D block loads / dot "
                 "operands traced to a load; GRF: registers per thread in the native code; spill B: scratch "
                 "bytes of spilled values; calls: call instructions in the native code.")
    best = least_spilling(results)
    for kernel, configs in best.items():
        default = [r.config for r in results if r.kernel == kernel and r.is_default]
        if default and default[0] not in configs:
            lines.append(f"NOTE {kernel}: default config {default[0]} is not among the least-spilling "
                         f"({', '.join(configs)})")
    lines.append("")
    lines.append("Caveat: " + IGC_CAVEAT)
    return "\n".join(lines)


def load_specs(probe: bool) -> list[Any]:
    if probe:
        from .xpu_probe import probe_specs

        return probe_specs()
    from .kernel_specs import kernel_specs

    return list(kernel_specs("xpu"))


def main(argv: Sequence[str] | None = None, specs: Sequence[Any] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="compile_check --target xpu", description=__doc__.split("\n")[0])
    ap.add_argument("--probe", action="store_true",
                    help="compile the probe kernels instead (a DPAS GEMM and an fp32 IEEE dot that must miss DPAS); "
                         "exit 0 when each verdict is the expected one")
    ap.add_argument("--kernel", action="append", default=[], help="only this kernel (repeatable)")
    ap.add_argument("--json", type=Path, help="also write the results as JSON here")
    ap.add_argument("--keep", type=Path, help="keep TTIR/TTGIR/SPIR-V and IGC's dump under this folder")
    args = ap.parse_args(argv)
    try:
        require_intel_triton()
    except RuntimeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if specs is None:
        specs = load_specs(args.probe)
    if args.kernel:
        specs = [s for s in specs if s.name in args.kernel]
    if not specs:
        print("no kernel specs to compile", file=sys.stderr)
        return 1
    t0 = time.perf_counter()
    if args.keep:
        args.keep.mkdir(parents=True, exist_ok=True)
        results = check_specs(specs, args.keep)
    else:
        with tempfile.TemporaryDirectory(prefix="fastmoe_xpu_ocloc_") as tmp:
            results = check_specs(specs, Path(tmp))
    elapsed = time.perf_counter() - t0
    print(report(results, elapsed))
    if args.json:
        payload = [dict(asdict(r), passed=r.passed, dpas_ok=r.dpas_ok, as_expected=r.as_expected) for r in results]
        args.json.write_text(json.dumps({"elapsed_s": elapsed, "least_spilling": least_spilling(results),
                                         "caveat": IGC_CAVEAT, "results": payload}, indent=1))
    failed = [r for r in results if not r.as_expected]
    for r in failed:
        detail = r.error or ("" if r.ocloc_ok else r.ocloc_log[-400:])
        print(f"FAILED {r.kernel} [{r.config}]: {_verdict(r)} {detail}".rstrip(), file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
