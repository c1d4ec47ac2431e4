"""Probe kernels for the Intel XPU compile gate (:mod:`fastmoe_xpu.tools.compile_xpu`).

They are not part of the MoE pipeline. ``compile_xpu --probe`` compiles them to show that the
toolchain works and that the gate tells a GEMM that reaches DPAS from one that does not:

- ``_probe_gemm_kernel`` (bf16 block pointers, fp32 accumulation) must lower to DPAS with 2D
  block loads, the pattern the project's grouped GEMMs follow on XPU.
- ``_probe_fma_dot_kernel`` with fp32 inputs and ``input_precision="ieee"`` must *not* lower to
  DPAS (PVC's matrix engine has no IEEE fp32 mode, so Intel's backend falls back to FMA); it is
  the negative control, expected to fail the gate.

Legend: M, N, K = GEMM sizes; BM, BN, BK = block sizes.
"""
from __future__ import annotations

from dataclasses import dataclass
import triton
import triton.language as tl

from .kernel_specs import KernelSpec


@triton.jit
def _probe_gemm_kernel(
    a_ptr, b_ptr, c_ptr, M, N, K,
    stride_am, stride_ak, stride_bk, stride_bn, stride_cm, stride_cn,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
):
    """C[M, N] = A[M, K] @ B[K, N]. Grid (cdiv(M, BM), cdiv(N, BN)); one program owns one
    BM x BN tile of C."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    a_blk = tl.make_block_ptr(a_ptr, (M, K), (stride_am, stride_ak), (pid_m * BM, 0), (BM, BK), (1, 0))
    b_blk = tl.make_block_ptr(b_ptr, (K, N), (stride_bk, stride_bn), (0, pid_n * BN), (BK, BN), (1, 0))
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for _ in range(0, tl.cdiv(K, BK)):
        a = tl.load(a_blk, boundary_check=(0, 1))
        b = tl.load(b_blk, boundary_check=(0, 1))
        acc += tl.dot(a, b)
        a_blk = tl.advance(a_blk, (0, BK))
        b_blk = tl.advance(b_blk, (BK, 0))
    c_blk = tl.make_block_ptr(c_ptr, (M, N), (stride_cm, stride_cn), (pid_m * BM, pid_n * BN), (BM, BN), (1, 0))
    tl.store(c_blk, acc.to(c_ptr.dtype.element_ty), boundary_check=(0, 1))


@triton.jit
def _probe_fma_dot_kernel(a_ptr, b_ptr, c_ptr, B: tl.constexpr, PRECISION: tl.constexpr):
    """C[B, B] = A[B, B] @ B[B, B] with plain pointer loads. Grid (1,)."""
    r = tl.arange(0, B)
    offs = r[:, None] * B + r[None, :]
    a = tl.load(a_ptr + offs)
    b = tl.load(b_ptr + offs)
    tl.store(c_ptr + offs, tl.dot(a, b, input_precision=PRECISION))


@dataclass
class ProbeSpec(KernelSpec):
    """A :class:`KernelSpec` with the gate's expected verdict: the negative control expects no DPAS."""

    expect_dpas: bool = True


def probe_specs() -> list[ProbeSpec]:
    gemm_sig = {
        "a_ptr": "*bf16", "b_ptr": "*bf16", "c_ptr": "*bf16", "M": "i32", "N": "i32", "K": "i32",
        # Unit strides are constexpr 1: Triton's launcher specialises an int argument equal to 1.
        "stride_am": "i32", "stride_ak": "constexpr", "stride_bk": "i32", "stride_bn": "constexpr",
        "stride_cm": "i32", "stride_cn": "constexpr", "BM": "constexpr", "BN": "constexpr", "BK": "constexpr",
    }
    aligned = ("a_ptr", "b_ptr", "c_ptr", "stride_am", "stride_bk", "stride_cm")
    specs = []
    for cfg, (bm, bn, bk, warps, grf) in {
        "128x128x32_w16_large": (128, 128, 32, 16, "large"),
        "256x256x32_w32_small": (256, 256, 32, 32, "small"),
    }.items():
        specs.append(ProbeSpec(
            name="probe_gemm", fn=_probe_gemm_kernel, signature=gemm_sig,
            constexprs={"BM": bm, "BN": bn, "BK": bk, "stride_ak": 1, "stride_bn": 1, "stride_cn": 1},
            config_name=cfg, num_warps=warps, num_stages=2, is_default=grf == "large",
            extra_options={"grf_mode": grf}, divisible_by_16=aligned,
        ))
    specs.append(ProbeSpec(
        name="probe_fma_dot", fn=_probe_fma_dot_kernel,
        signature={"a_ptr": "*fp32", "b_ptr": "*fp32", "c_ptr": "*fp32", "B": "constexpr", "PRECISION": "constexpr"},
        constexprs={"B": 32, "PRECISION": "ieee"}, config_name="fp32_ieee_w4", num_warps=4, num_stages=2,
        is_default=True, extra_options={}, divisible_by_16=("a_ptr", "b_ptr", "c_ptr"), expect_dpas=False,
    ))
    return specs
