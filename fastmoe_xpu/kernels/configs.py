"""Block sizes, warps and pipeline stages of every Triton kernel, per config table (one per kind of device), in one place.

Backends: ``"cuda"`` (NVIDIA, tuned for sm_90), ``"sm100"`` (NVIDIA Blackwell data-center GPUs,
compute capability 10.x: B200, GB200; see below), ``"hip"`` (AMD, gfx942), ``"xpu"`` (Intel Data Center
GPU Max, PVC) and ``"interpreter"`` (``TRITON_INTERPRET=1`` on the CPU: small tiles so that tests
exercise multi-tile paths quickly). The first config of each list is the one the launchers use;
the others are alternatives that ``compile_check`` also compiles. On GPUs the grouped GEMMs
(``gate_up_fwd``, ``grouped_mm_fwd``, ``grouped_mm_bwd``) take the config of the package's kept
table for the device (``kernels/tuned/``, :mod:`.kept_configs`), else time every config of their list
once per dtype, N, K and rows-per-expert bucket and keep the fastest (``triton/autotune.py``).

Intel notes (from the Intel XPU backend's performance guidance): ``tl.dot`` operands that are
plain strided tiles are loaded through block pointers so that the backend emits 2D block loads and
DPAS; a gathered operand cannot be described by a block pointer and uses pointer loads.
``grf_mode="large"`` gives each hardware thread 256 registers (the 3.3-era spelling; newer Intel
builds also accept ``"256"``); with it, 32 warps (sub-groups of 16 lanes) per work-group and
256-row tiles are the backend's usual GEMM shape.

Blackwell notes (``sm100``; chosen from the hardware's shape and the sm_100a compile gate, **not
timed on a B200**: the lists are candidates that the autotuner times on the device, first the
default). Triton lowers ``tl.dot`` there to tcgen05 MMAs whose fp32 accumulator lives in tensor
memory (128 lanes x 512 columns of 32 bits per SM), not in registers: a 128 x 256 accumulator takes
half of it, and registers hold it only in the epilogue. So the row GEMMs take 128-row tiles (the
MMA's native M) and wider N tiles than on sm_90 where the epilogue fits the registers of 8 warps
without spilling; shared memory (227 KiB per block, as on sm_90) bounds the stages. The gate/up
forward keeps two accumulators (gate and up), so half the N tile. Kernels without a matrix product
(counting, indices, the row-wise kernels, the combine) keep the ``cuda`` tiles: they are bound by
memory bandwidth, not by the MMA. Kernels absent from the ``sm100`` table use the ``cuda`` table's
configs (also compiled for sm_100a by ``compile_check --target sm100``).
"""
from __future__ import annotations

import collections
import contextlib
import functools
import inspect
import re
from dataclasses import dataclass, field
from typing import Any, Mapping

import torch

from .. import settings

#: The quantized weight-gradient codes stored by column (``quantized.core.quantize_cols_grouped_t``, read
#: by the fp8 weight-gradient kernel) start each expert's rows at a multiple of this: 16 one-byte codes,
#: the width of an aligned asynchronous copy.
QUANTIZED_ROW_ALIGN = 16
#: The config tables (one per kind of device, plus the interpreter's).
TABLES = settings.CONFIG_TABLES

#: Kernel families; each launcher picks its config by one of these names.
KERNELS = (
    "count_tokens",
    "cumsum_counts",
    "build_indices",
    "gate_up_fwd",
    "grouped_mm_fwd",
    "grouped_mm_bwd",
    "silu_mul_bwd",
    "row_dot_scale",
    "combine_fwd",
    "combine_bwd",
    "router_weights_bwd",
    "tma_gate_up_fwd",
    "tma_grouped_mm",
    "tma_grouped_mm_bwd",
    "int8_grouped_mm",
    "int8_grouped_wgrad",
    "fp8_grouped_mm",
    "fp8_grouped_wgrad",
    "fp8q_rows",
    "fp8q_wcols",
    "fp8q_cols",
    "fp8q_silu_mul",
    "fp8q_row_dot",
    "fp8b_grouped_mm",
    "fp8b_grouped_wgrad",
    "fp8b_weight",
)


@dataclass(frozen=True)
class KernelConfig:
    """One launch configuration: tile constexprs, ``num_warps``, ``num_stages`` and backend options."""

    name: str
    meta: Mapping[str, int]
    num_warps: int = 4
    num_stages: int = 2
    extra_options: Mapping[str, Any] = field(default_factory=dict)


def _c(name: str, warps: int, stages: int, extra: Mapping[str, Any] | None = None, **meta: int) -> KernelConfig:
    return KernelConfig(name=name, meta=dict(meta), num_warps=warps, num_stages=stages, extra_options=dict(extra or {}))


def _mm(name: str, warps: int, stages: int, extra: Mapping[str, Any] | None = None) -> KernelConfig:
    """A GEMM config named by its tile: ``m128n64k32`` is ``BLOCK_M=128, BLOCK_N=64, BLOCK_K=32``."""
    m, n, k = (int(v) for v in re.fullmatch(r"m(\d+)n(\d+)k(\d+)", name).groups())  # type: ignore[union-attr]
    return _c(name, warps, stages, extra, BLOCK_M=m, BLOCK_N=n, BLOCK_K=k)


def _fp8mm(name: str, warps: int, stages: int, overlap: bool = False) -> KernelConfig:
    """An fp8 GEMM config: :func:`_mm`'s tile and its ``OVERLAP`` form (named ``<tile>+overlap``)."""
    cfg = _mm(name, warps, stages)
    return KernelConfig(name=name + ("+overlap" if overlap else ""), meta={**cfg.meta, "OVERLAP": overlap},
                        num_warps=warps, num_stages=stages)


def _counting(warps: int, extra: Mapping[str, Any] | None = None) -> dict[str, list[KernelConfig]]:
    """Stages 2 and 3 on a GPU: ``warps`` for the token count and the indices, 8 for the prefix sums."""
    return {
        "count_tokens": [_c("e64", warps, 1, extra, BLOCK_E=64)],
        "cumsum_counts": [_c("b2048", 8, 1, extra, BLOCK=2048, BLOCK_E=256)],
        "build_indices": [_c("default", warps, 1, extra)],
    }


def _row_kernels(extra: Mapping[str, Any] | None = None) -> dict[str, list[KernelConfig]]:
    """The row-wise kernels (SiLU backward, row dots, combine, router-weight gradient) on a GPU: the
    same tiles on every vendor's table."""
    return {
        "silu_mul_bwd": [_c("r16i128", 4, 1, extra, BLOCK_R=16, BLOCK_I=128)],
        "row_dot_scale": [_c("r16i128", 4, 1, extra, BLOCK_R=16, BLOCK_I=128)],
        "combine_fwd": [_c("t16h128", 4, 1, extra, BLOCK_T=16, BLOCK_H=128)],
        "combine_bwd": [_c("t16h128", 4, 1, extra, BLOCK_T=16, BLOCK_H=128)],
        "router_weights_bwd": [_c("t64", 4, 1, extra, BLOCK_T=64)],
    }


_XPU = {"grf_mode": "large"}

CONFIGS: dict[str, dict[str, list[KernelConfig]]] = {
    "cuda": {
        **_counting(4),
        # Two fp32 accumulators (gate and up) per program, so half the N tile of the plain GEMM.
        "gate_up_fwd": [_mm("m128n64k64", 8, 3), _mm("m64n64k64", 4, 3)],
        "grouped_mm_fwd": [_mm("m128n128k64", 8, 3), _mm("m64n128k64", 4, 3)],
        "grouped_mm_bwd": [_mm("m128n128k64", 8, 3), _mm("m64n128k32", 4, 3)],
        **_row_kernels(),
        # The int8 grouped GEMM (triton/int8_gemm.py): int8 operands are half as wide as bf16, so
        # twice the K tile for the same bytes per stage; an int32 accumulator like fp32's.
        "int8_grouped_mm": [_mm("m128n128k128", 8, 3), _mm("m64n128k128", 4, 3)],
        # Its weight gradient (a contraction over each expert's rows): the same tiles.
        "int8_grouped_wgrad": [_mm("m128n128k128", 8, 3), _mm("m64n128k128", 4, 3)],
        # The fp8 grouped GEMMs (triton/fp8_gemm.py, sm_89+): one-byte operands as int8's, an fp32
        # accumulator beside each k-step's partial product (the fp32 promotion of every BLOCK_K).
        # m128n256k128: half the A tile re-reads (the gathered rows) per output, 144 KiB of shared
        # memory in 3 stages, 255 registers without spills on sm_90. "+overlap" (OVERLAP): each
        # k-step's partial product is added to the fp32 accumulator while the next k-step's MMAs run
        # (a second partial accumulator), where the plain form waits for the MMAs, then adds: the same
        # sums in the same order, so the autotuner may pick either.
        "fp8_grouped_mm": [_fp8mm("m128n128k128", 8, 3), _fp8mm("m64n128k128", 4, 3), _fp8mm("m128n256k128", 8, 3),
                           _fp8mm("m128n128k128", 8, 3, overlap=True)],
        "fp8_grouped_wgrad": [_fp8mm("m128n128k128", 8, 3), _fp8mm("m64n128k128", 4, 3),
                              _fp8mm("m128n256k128", 8, 3), _fp8mm("m128n128k128", 8, 3, overlap=True)],
        # The fp8 path's quantization and row passes (memory-bound, no matrix product): per-row codes
        # (16 rows of 256 values per step), per-column codes of a transposed weight (256 columns of
        # 16 rows), the weight gradients' column codes (64 rows x 64 columns, stored transposed: 64
        # contiguous bytes per column), SiLU*up and the router-weight dots.
        "fp8q_rows": [_c("c16l256", 4, 1, BLOCK_C=16, BLOCK_L=256, BLOCK_E=128)],
        "fp8q_wcols": [_c("c256l16", 4, 1, BLOCK_C=256, BLOCK_L=16, BLOCK_E=16)],
        "fp8q_cols": [_c("r64n64", 4, 1, BLOCK_R=64, BLOCK_N=64, BLOCK_E=128)],
        "fp8q_silu_mul": [_c("r16i256", 4, 1, BLOCK_R=16, BLOCK_I=256)],
        "fp8q_row_dot": [_c("r16i256", 4, 1, BLOCK_R=16, BLOCK_I=256)],
        # The block-scaled fp8 GEMMs (triton/fp8_block_gemm.py, sm_89+): the k-step is the recipe's
        # 128-wide scale block (not a config choice), the activation or gradient tile loaded in its own
        # dtype and quantized in registers, each k-step's partial product scaled into the fp32
        # accumulator; the weights' 128 x 128 blocks quantized one program each. A program quantizes
        # its A tiles once per column tile, so the 256-wide candidates do that work half as often
        # (no spills on sm_90 and sm_100a either; the autotuner times them against the default).
        "fp8b_grouped_mm": [_c("m128n128", 8, 3, BLOCK_M=128, BLOCK_N=128), _c("m64n128", 4, 3, BLOCK_M=64, BLOCK_N=128),
                            _c("m128n64", 4, 3, BLOCK_M=128, BLOCK_N=64), _c("m128n256", 8, 2, BLOCK_M=128, BLOCK_N=256),
                            _c("m64n256", 8, 3, BLOCK_M=64, BLOCK_N=256)],
        "fp8b_grouped_wgrad": [_c("m128n128", 8, 3, BLOCK_M=128, BLOCK_N=128),
                               _c("m64n128", 4, 3, BLOCK_M=64, BLOCK_N=128)],
        "fp8b_weight": [_c("default", 8, 1)],
        # The persistent TMA kernels (triton/tma_gemm.py, sm_90+): one program per SM, so the tile is
        # the whole parallelism; 8 warps = two warpgroups sharing the 128-row tile's wgmma.
        "tma_gate_up_fwd": [_mm("m128n64k64", 8, 4), _mm("m128n128k64", 8, 3), _mm("m64n64k64", 4, 4)],
        "tma_grouped_mm": [_mm("m128n128k64", 8, 4), _mm("m128n256k64", 8, 3), _mm("m64n128k64", 4, 4)],
        "tma_grouped_mm_bwd": [_mm("m128n128k64", 8, 4), _mm("m128n256k64", 8, 3), _mm("m64n128k64", 4, 4)],
    },
    "hip": {
        # 8 warps: with 4, the all-pairs block reductions run out of scalar registers on gfx942.
        **_counting(8),
        "gate_up_fwd": [_mm("m128n64k64", 8, 2), _mm("m64n64k64", 4, 2)],
        "grouped_mm_fwd": [_mm("m128n128k64", 8, 2), _mm("m128n128k32", 4, 2)],
        "grouped_mm_bwd": [_mm("m128n128k64", 8, 2), _mm("m128n128k32", 4, 2)],
        **_row_kernels(),
        "int8_grouped_mm": [_mm("m128n128k64", 8, 2), _mm("m128n128k128", 8, 2)],
        "int8_grouped_wgrad": [_mm("m128n128k64", 8, 2), _mm("m128n128k128", 8, 2)],
    },
    "xpu": {
        **_counting(4, _XPU),
        # Defaults: the least-spilling config of each GEMM in the PVC compile gate (docs/xpu.md);
        # 256x256 tiles and two 256x128 fp32 accumulators spill there.
        "gate_up_fwd": [_mm("m128n64k32", 16, 2, _XPU), _mm("m256n128k32", 32, 2, _XPU)],
        "grouped_mm_fwd": [_mm("m128n256k32", 32, 2, _XPU), _mm("m256n256k32", 32, 2, _XPU)],
        "grouped_mm_bwd": [_mm("m256n128k32", 32, 2, _XPU), _mm("m256n256k32", 32, 2, _XPU)],
        **_row_kernels(_XPU),
        # The int8 GEMMs (pointer loads, no block pointers): at 16 dpas per thread and k-step
        # (m128n128k64 with 16 warps, m128n64k64 with 8, m256n128k64 with 32) PVC spills 8-13 KB;
        # at 8 or fewer (these) nothing (docs/xpu.md).
        "int8_grouped_mm": [_mm("m128n64k32", 16, 2, _XPU), _mm("m64n64k64", 8, 2, _XPU)],
        "int8_grouped_wgrad": [_mm("m128n64k32", 16, 2, _XPU), _mm("m64n64k64", 8, 2, _XPU)],
    },
    "interpreter": {
        "count_tokens": [_c("e4", 1, 1, BLOCK_E=4)],
        "cumsum_counts": [_c("b16", 1, 1, BLOCK=16, BLOCK_E=4)],
        "build_indices": [_c("default", 1, 1)],
        # Every GEMM on one small tile, so that tests exercise multi-tile paths quickly.
        **{kernel: [_mm("m16n16k16", 1, 1)] for kernel in (
            "gate_up_fwd", "grouped_mm_fwd", "grouped_mm_bwd", "tma_gate_up_fwd",
            "tma_grouped_mm", "tma_grouped_mm_bwd", "int8_grouped_mm",
            "int8_grouped_wgrad", "fp8_grouped_mm", "fp8_grouped_wgrad")},
        "fp8q_rows": [_c("c4l16", 1, 1, BLOCK_C=4, BLOCK_L=16, BLOCK_E=4)],
        "fp8q_wcols": [_c("c4l8", 1, 1, BLOCK_C=4, BLOCK_L=8, BLOCK_E=4)],
        "fp8q_cols": [_c("r8n16", 1, 1, BLOCK_R=8, BLOCK_N=16, BLOCK_E=4)],
        "fp8q_silu_mul": [_c("r4i16", 1, 1, BLOCK_R=4, BLOCK_I=16)],
        "fp8q_row_dot": [_c("r4i16", 1, 1, BLOCK_R=4, BLOCK_I=16)],
        "fp8b_grouped_mm": [_c("m16n16", 1, 1, BLOCK_M=16, BLOCK_N=16)],
        "fp8b_grouped_wgrad": [_c("m16n16", 1, 1, BLOCK_M=16, BLOCK_N=16)],
        "fp8b_weight": [_c("default", 1, 1)],
        "silu_mul_bwd": [_c("r8i16", 1, 1, BLOCK_R=8, BLOCK_I=16)],
        "row_dot_scale": [_c("r8i16", 1, 1, BLOCK_R=8, BLOCK_I=16)],
        "combine_fwd": [_c("t4h16", 1, 1, BLOCK_T=4, BLOCK_H=16)],
        "combine_bwd": [_c("t4h16", 1, 1, BLOCK_T=4, BLOCK_H=16)],
        "router_weights_bwd": [_c("t4", 1, 1, BLOCK_T=4)],
    },
}


@functools.lru_cache(maxsize=None)
def _cuda_table(index: int | None) -> str:
    """``sm100`` for an NVIDIA GPU of compute capability 10.x (B200, GB200, B300), ``cuda`` for the
    others (sm_120 consumer Blackwell has neither tcgen05 nor the data-center shared memory)."""
    major, _ = torch.cuda.get_device_capability(index)
    return "sm100" if major == 10 else "cuda"


#: Blackwell (sm_100a) configs of the matrix-product kernels; see the module's notes (untimed).
_SM100: dict[str, list[KernelConfig]] = {
    # Two accumulators (gate and up): 2 x 128 x 128 fp32 is half the tensor memory.
    "gate_up_fwd": [_mm("m128n128k64", 8, 3), _mm("m128n64k64", 8, 4), _mm("m128n128k64", 4, 3)],
    # One 128 x 256 accumulator; 3 stages of a 128 x 64 and a 64 x 256 bf16 tile are 144 KiB.
    "grouped_mm_fwd": [_mm("m128n256k64", 8, 3), _mm("m128n128k64", 8, 4), _mm("m64n128k64", 4, 4)],
    "grouped_mm_bwd": [_mm("m128n256k64", 8, 3), _mm("m128n128k64", 8, 4), _mm("m128n128k64", 4, 4)],
    # int8 (tcgen05's i8 form): twice the K tile for the bytes of a bf16 stage.
    "int8_grouped_mm": [_mm("m128n256k128", 8, 3), _mm("m128n128k128", 8, 4), _mm("m128n128k128", 4, 4)],
    "int8_grouped_wgrad": [_mm("m128n256k128", 8, 3), _mm("m128n128k128", 8, 4), _mm("m128n128k128", 4, 4)],
    # The persistent TMA kernels: one program per SM, so the tile is the whole parallelism.
    "tma_gate_up_fwd": [_mm("m128n128k64", 8, 4), _mm("m128n64k64", 4, 4), _mm("m128n128k64", 4, 4)],
    "tma_grouped_mm": [_mm("m128n256k64", 8, 3), _mm("m128n128k64", 4, 4)],
    "tma_grouped_mm_bwd": [_mm("m128n256k64", 8, 3), _mm("m128n128k64", 8, 4), _mm("m128n128k64", 4, 4)],
}
#: The ``sm100`` table: :data:`_SM100`'s lists, else ``cuda``'s (looked up when asked, so a kernel added
#: to the ``cuda`` table later is in this one too).
CONFIGS["sm100"] = collections.ChainMap(_SM100, CONFIGS["cuda"])  # type: ignore[assignment]


def table_for(device: torch.device | str) -> str:
    """The config table for Triton kernels on ``device``: ``FASTMOE_TRITON_CONFIGS`` (or :func:`use`)
    if set, else the device's own (``xpu``, ``sm100`` on compute capability 10.x, ``cuda`` on other
    NVIDIA GPUs, ``hip`` on ROCm, ``interpreter`` on the CPU)."""
    table = settings.get().triton_configs
    if table is None:
        dev = torch.device(device)
        if dev.type == "xpu":
            table = "xpu"
        elif dev.type == "cuda":
            table = "hip" if getattr(torch.version, "hip", None) else _cuda_table(dev.index)
        else:
            table = "interpreter"
    if table not in TABLES:
        raise ValueError(f"unknown Triton config table {table!r} (expected one of {TABLES})")
    return table


def use(table: str) -> contextlib.AbstractContextManager[Any]:
    """Run launchers with ``table``'s configs (tests run every table under the interpreter)."""
    if table not in TABLES:
        raise ValueError(f"unknown Triton config table {table!r} (expected one of {TABLES})")
    return settings.override(triton_configs=table)


def configs(table: str, kernel: str) -> list[KernelConfig]:
    """Every config of ``kernel`` in config table ``table``, the default first."""
    if table not in CONFIGS:
        raise ValueError(f"unknown Triton config table {table!r} (expected one of {TABLES})")
    if kernel not in CONFIGS[table]:
        raise ValueError(f"unknown kernel {kernel!r} (expected one of {KERNELS})")
    return CONFIGS[table][kernel]


def get_config(table: str, kernel: str) -> KernelConfig:
    return configs(table, kernel)[0]


def block_ptr_available() -> bool:
    """Block pointers exist up to the Triton releases that still take ``boundary_check`` in
    ``tl.load`` (Intel's XPU builds keep them; upstream removed them in favour of descriptors)."""
    try:
        import triton.language as tl
    except ImportError:
        return False
    return "boundary_check" in inspect.signature(tl.load).parameters


def uses_block_ptr(table: str) -> bool:
    """Whether launchers using config table ``table`` pass ``BLOCK_PTR=True``: on for xpu
    (``FASTMOE_TRITON_BLOCK_PTR=0|1`` overrides), never where this Triton has no block pointers."""
    wanted = settings.get().triton_block_ptr
    if wanted is None:
        wanted = table == "xpu"
    return wanted and block_ptr_available()


def dot_precision(table: str, dtype: torch.dtype) -> str:
    """``tl.dot``'s ``input_precision``: TF32 for fp32 operands only where PyTorch itself allows it
    for matmuls (so fp32 results match ``torch.mm``), and never on AMD, which lacks TF32 in Triton."""
    if dtype != torch.float32 or table == "hip":
        return "ieee"
    if table in ("cuda", "sm100") and torch.backends.cuda.matmul.allow_tf32:
        return "tf32"
    if table == "xpu" and torch.get_float32_matmul_precision() != "highest":
        return "tf32"
    return "ieee"
