"""Compile every Triton kernel with every config for real GPU targets, without a GPU.

``python -m fastmoe_xpu.kernels.compile_check [--target cuda|hip|all] [--defaults-only] [--json PATH]``
(``--target xpu`` hands over to :mod:`fastmoe_xpu.kernels.compile_xpu`, run with ``.venv-xpu``).

For each kernel (and each constexpr variant the launchers use, e.g. the down GEMM's ``TRANS_W``
forward and input-gradient forms), each config of ``configs.py`` and each target it builds
``triton.compile(ASTSource(fn, signature, constexprs, attrs), target=GPUTarget(...))`` and prints
registers, spills and shared memory:

* ``cuda`` = ``GPUTarget("cuda", 90, 32)`` (H100): registers and spill bytes from
  ``cuobjdump --dump-resource-usage`` (shipped in Triton's ``backends/nvidia/bin``) on the cubin
  (``REG``, ``LOCAL``); the compiled kernel's ``n_regs``/``n_spills`` metadata where that tool is
  missing.
* ``hip`` = ``GPUTarget("hip", "gfx942", 64)`` (MI300X): ``.vgpr_count``, ``.vgpr_spill_count`` and
  ``.sgpr_spill_count`` from the amdgcn text.

:func:`kernel_specs` is the shared description of what to compile (also used for Intel XPU by a
separate compile path with Intel's Triton build). The problem it describes is an OLMoE-sized layer:
H=2048, I=1024, K=8, token block 8, bf16 activations and weights.
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
from dataclasses import dataclass, field
from typing import Any

# The specs must hold compiled-mode kernels: drop the interpreter switch before the kernel modules
# are imported by this process (``python -m``); imported as a library, kernels are re-wrapped below.
if __name__ == "__main__":
    os.environ.pop("TRITON_INTERPRET", None)

from . import combine, counting, grouped_gemm, indices  # noqa: E402
from .configs import configs  # noqa: E402

TARGETS = ("cuda", "hip")

#: Hardware limits to judge shared memory against (bytes per block / workgroup).
SHARED_LIMIT = {"cuda": 232448, "hip": 65536, "xpu": 131072}


@dataclass
class KernelSpec:
    """One kernel compile: ``triton.compile(ASTSource(fn, signature, constexprs), options)``."""

    name: str
    fn: Any
    signature: dict[str, str]
    constexprs: dict[str, Any]
    config_name: str
    num_warps: int
    num_stages: int
    is_default: bool
    extra_options: dict[str, Any]
    #: Arguments the runtime would specialise as multiples of 16 (aligned pointers, model dims).
    divisible_by_16: tuple[str, ...] = field(default_factory=tuple)

    def options(self) -> dict[str, Any]:
        return {"num_warps": self.num_warps, "num_stages": self.num_stages, **self.extra_options}


_jit_cache: dict[int, Any] = {}


def _jit(kernel: Any) -> Any:
    """A compiled-mode JITFunction of ``kernel`` even when its module was imported under the
    interpreter (the kernels call no other jit functions, so re-wrapping the Python function is
    enough)."""
    from triton.runtime.jit import JITFunction

    if isinstance(kernel, JITFunction):
        return kernel
    key = id(kernel)
    if key not in _jit_cache:
        _jit_cache[key] = JITFunction(kernel.fn)
    return _jit_cache[key]


# Representative problem: OLMoE-1B-7B-like layer on one rank.
H, I, K, TBS = 2048, 1024, 8, 8
_P32, _P64, _I32 = "*i32", "*i64", "i32"


def _variants(target: str) -> list[tuple[str, str, Any, dict[str, str], dict[str, Any], tuple[str, ...]]]:
    """``(spec name, configs key, kernel, signature, constexprs without tiles, aligned args)``."""
    block_ptr = target == "xpu"
    act = "*bf16"
    gemm_flags = {"BLOCK_PTR": block_ptr, "DOT_PRECISION": "ieee"}
    out: list = []
    out.append(("count_tokens", "count_tokens", counting._count_tokens_fwd_kernel, {
        "topk_idx_ptr": _P64, "partial_ptr": _P32, "expert_counts_ptr": _P32, "block_totals_ptr": _P32,
        "expert_totals_ptr": _P32, "T": _I32, "K": _I32, "TH": _I32, "expert_start": _I32, "num_local": _I32,
        "block_size": _I32}, {"BLOCK_T": TBS, "BLOCK_K": K},
        ("topk_idx_ptr", "partial_ptr", "expert_counts_ptr", "block_totals_ptr", "expert_totals_ptr")))
    out.append(("cumsum_counts", "cumsum_counts", counting._cumsum_counts_fwd_kernel, {
        "partial_ptr": _P32, "expert_totals_ptr": _P32, "expert_counts_ptr": _P32, "block_totals_ptr": _P32,
        "partial_cum_ptr": _P32, "cum_token_ptr": _P32, "cum_expert_ptr": _P32, "T": _I32, "TH": _I32,
        "num_local": _I32, "block_size": _I32, "tokens_per_chunk": _I32}, {},
        ("partial_ptr", "expert_totals_ptr", "expert_counts_ptr", "block_totals_ptr", "partial_cum_ptr",
         "cum_token_ptr", "cum_expert_ptr")))
    out.append(("build_indices", "build_indices", indices._build_indices_fwd_kernel, {
        "topk_idx_ptr": _P64, "partial_cum_ptr": _P32, "cum_expert_ptr": _P32, "input_idx_ptr": _P32,
        "output_idx_ptr": _P32, "selected_ptr": _P32, "T": _I32, "K": _I32, "TH": _I32, "expert_start": _I32,
        "num_local": _I32, "block_size": _I32}, {"BLOCK_K": K, "BLOCK_J": TBS * K},
        ("topk_idx_ptr", "partial_cum_ptr", "cum_expert_ptr", "input_idx_ptr", "output_idx_ptr", "selected_ptr")))
    out.append(("gate_up_fwd", "gate_up_fwd", grouped_gemm._gate_up_fwd_kernel, {
        "x_ptr": act, "input_idx_ptr": _P32, "cum_token_ptr": _P32, "w_ptr": act, "gate_up_ptr": act, "h_ptr": act,
        "H": _I32, "I": _I32}, dict(gemm_flags),
        ("x_ptr", "input_idx_ptr", "cum_token_ptr", "w_ptr", "gate_up_ptr", "h_ptr", "H", "I")))
    mm_sig = {"a_ptr": act, "w_ptr": act, "cum_token_ptr": _P32, "out_ptr": act, "N": _I32, "K": _I32}
    mm_aligned = ("a_ptr", "w_ptr", "cum_token_ptr", "out_ptr", "N", "K")
    out.append(("grouped_mm_fwd[W^T]", "grouped_mm_fwd", grouped_gemm._grouped_mm_fwd_kernel, mm_sig,
                {"TRANS_W": True, **gemm_flags}, mm_aligned))
    out.append(("grouped_mm_fwd[W]", "grouped_mm_fwd", grouped_gemm._grouped_mm_fwd_kernel, mm_sig,
                {"TRANS_W": False, **gemm_flags}, mm_aligned))
    bwd_sig = {"a_ptr": act, "b_ptr": act, "idx_ptr": _P32, "cum_token_ptr": _P32, "dw_ptr": act, "M": _I32,
               "N": _I32}
    bwd_aligned = ("a_ptr", "b_ptr", "idx_ptr", "cum_token_ptr", "dw_ptr", "M", "N")
    out.append(("grouped_mm_bwd[rows]", "grouped_mm_bwd", grouped_gemm._grouped_mm_bwd_kernel, bwd_sig,
                {"GATHER": False, **gemm_flags}, bwd_aligned))
    out.append(("grouped_mm_bwd[gather]", "grouped_mm_bwd", grouped_gemm._grouped_mm_bwd_kernel, bwd_sig,
                {"GATHER": True, **gemm_flags}, bwd_aligned))
    out.append(("silu_mul_bwd", "silu_mul_bwd", grouped_gemm._silu_mul_bwd_kernel, {
        "gate_up_ptr": act, "dh_ptr": act, "d_gate_up_ptr": act, "cum_token_ptr": _P32, "R": _I32, "I": _I32,
        "NR": _I32}, {"HAS_COUNTS": True},
        ("gate_up_ptr", "dh_ptr", "d_gate_up_ptr", "cum_token_ptr", "I")))
    comb_sig = {"y_ptr": act, "weights_ptr": act, "output_idx_ptr": _P32, "selected_ptr": _P32,
                "cum_expert_ptr": _P32, "out_ptr": act, "T": _I32, "H": _I32, "K": _I32}
    comb_aligned = ("y_ptr", "weights_ptr", "output_idx_ptr", "selected_ptr", "cum_expert_ptr", "out_ptr", "H", "K")
    out.append(("combine_fwd[weighted]", "combine_fwd", combine._combine_fwd_kernel, comb_sig, {"WEIGHTED": True},
                comb_aligned))
    out.append(("combine_fwd[sum]", "combine_fwd", combine._combine_fwd_kernel, comb_sig, {"WEIGHTED": False},
                comb_aligned))
    out.append(("combine_bwd", "combine_bwd", combine._combine_bwd_kernel, {
        "dout_ptr": act, "y_ptr": act, "weights_ptr": act, "output_idx_ptr": _P32, "selected_ptr": _P32,
        "cum_expert_ptr": _P32, "dy_ptr": act, "dweights_ptr": act, "T": _I32, "H": _I32, "K": _I32},
        {"BLOCK_K": K},
        ("dout_ptr", "y_ptr", "weights_ptr", "output_idx_ptr", "selected_ptr", "cum_expert_ptr", "dy_ptr",
         "dweights_ptr", "H", "K")))
    return out


def kernel_specs(target: str) -> list[KernelSpec]:
    """Every (kernel variant, config) to compile for ``target`` in ``"cuda"``, ``"hip"``, ``"xpu"``;
    the config lists come from ``configs.py`` for that backend (``xpu`` variants load ``tl.dot``
    operands through block pointers, as the XPU launchers do)."""
    if target not in ("cuda", "hip", "xpu"):
        raise ValueError(f"target must be 'cuda', 'hip' or 'xpu', got {target!r}")
    specs = []
    for name, key, kernel, signature, constexprs, aligned in _variants(target):
        for i, cfg in enumerate(configs(target, key)):
            cexpr = {**cfg.meta, **constexprs}
            sig = dict(signature)
            sig.update({k: "constexpr" for k in cexpr})
            specs.append(KernelSpec(
                name=name, fn=_jit(kernel), signature=sig, constexprs=cexpr, config_name=cfg.name,
                num_warps=cfg.num_warps, num_stages=cfg.num_stages, is_default=i == 0,
                extra_options=dict(cfg.extra_options), divisible_by_16=tuple(aligned),
            ))
    return specs


# ---------------------------------------------------------------- compiling and reading resources
def _gpu_target(target: str):
    from triton.backends.compiler import GPUTarget

    return GPUTarget("cuda", 90, 32) if target == "cuda" else GPUTarget("hip", "gfx942", 64)


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
    """``(registers, spill bytes)`` of an sm_90 kernel."""
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


def run_check(targets: tuple[str, ...] = TARGETS, defaults_only: bool = False) -> list[dict[str, Any]]:
    rows = []
    for target in targets:
        for spec in kernel_specs(target):
            if defaults_only and not spec.is_default:
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
            regs, spills = cuda_resources(compiled) if target == "cuda" else hip_resources(compiled)
            shared = int(getattr(compiled.metadata, "shared", 0) or 0)
            row.update(ok=True, registers=regs, spills=spills, shared=shared,
                       shared_ok=shared <= SHARED_LIMIT[target], seconds=round(time.time() - t0, 2))
            rows.append(row)
    return rows


def format_table(rows: list[dict[str, Any]]) -> str:
    head = ("kernel", "config", "target", "warps", "stages", "registers", "spills", "shared", "status")
    lines = []
    for r in rows:
        if r["ok"]:
            status = "ok" if r["spills"] in (0, None) and r["shared_ok"] else "SPILLS" if r["spills"] else "SHARED>LIMIT"
            status += " (default)" if r["default"] else ""
            vals = (r["kernel"], r["config"], r["target"], r["num_warps"], r["num_stages"], r["registers"],
                    r["spills"], r["shared"], status)
        else:
            vals = (r["kernel"], r["config"], r["target"], r["num_warps"], r["num_stages"], "-", "-", "-",
                    "FAILED: " + r["error"])
        lines.append(tuple(str(v) for v in vals))
    widths = [max(len(h), *(len(l[i]) for l in lines)) if lines else len(h) for i, h in enumerate(head)]
    fmt = " | ".join(f"{{:<{w}}}" for w in widths)
    out = [fmt.format(*head), "-+-".join("-" * w for w in widths)]
    out += [fmt.format(*l) for l in lines]
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", choices=("cuda", "hip", "all", "xpu"), default="all",
                        help="xpu: Intel PVC through kernels/compile_xpu.py (run it with .venv-xpu/bin/python)")
    parser.add_argument("--defaults-only", action="store_true", help="compile only each kernel's default config")
    parser.add_argument("--json", metavar="PATH", help="also write the rows as JSON")
    args, rest = parser.parse_known_args(argv)
    if args.target == "xpu":
        from .compile_xpu import main as xpu_main

        if args.defaults_only:
            parser.error("--defaults-only is not available for --target xpu")
        return xpu_main(rest + (["--json", args.json] if args.json else []))
    if rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    targets = TARGETS if args.target == "all" else (args.target,)
    rows = run_check(targets, args.defaults_only)
    print(format_table(rows))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(rows, f, indent=1)
    failed = [r for r in rows if not r["ok"]]
    bad_defaults = [r for r in rows if r["ok"] and r["default"] and (r["spills"] or not r["shared_ok"])]
    if failed or bad_defaults:
        print(f"\n{len(failed)} failed, {len(bad_defaults)} default configs spill or exceed shared memory",
              file=sys.stderr)
        return 1
    print(f"\n{len(rows)} kernels compiled, default configs without spills")
    return 0


if __name__ == "__main__":
    sys.exit(main())
