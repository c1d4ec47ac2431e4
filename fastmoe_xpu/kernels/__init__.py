"""Launchers of stages 2-5, one contract for two backends.

``get_ops("torch")`` returns :mod:`fastmoe_xpu.kernels.torch_ops` (plain PyTorch, the CPU backend);
``get_ops("triton")`` returns :mod:`fastmoe_xpu.kernels.triton_ops` (Triton kernels, xpu/cuda, or
the CPU under ``TRITON_INTERPRET=1``). Both modules export the same functions:

========================  ======================================================================
``count_tokens``          stage 2: per-block counts of local experts and their prefix sums
``build_indices``         stage 3: ``input_indices``, ``output_indices``, ``selected_expert_indices``
``gate_up_fwd``           stage 4: gathered grouped GEMM with ``gate_up_proj``, then SiLU*up
``down_fwd``              stage 4: grouped GEMM with ``down_proj``
``down_bwd``              stage 4 backward: input and weight gradients of the down GEMM
``silu_mul_bwd``          stage 4 backward: gradient of SiLU*up
``gate_up_bwd``           stage 4 backward: row gradients and weight gradient of the gate/up GEMM
``combine_fwd``           stage 5: weighted (or plain) reduction of expert rows back to tokens
``combine_bwd``           stage 5 backward: row gradients and router-weight gradients
========================  ======================================================================

Metadata is int32. Row buffers have ``R >= RT`` rows, RT = ``cum_token_counts[-1]``; rows past RT
are unspecified and never read.
"""
from __future__ import annotations

import importlib
from types import ModuleType


def get_ops(backend: str) -> ModuleType:
    if backend == "torch":
        return importlib.import_module(".torch_ops", __name__)
    if backend == "triton":
        return importlib.import_module(".triton_ops", __name__)
    raise ValueError(f"unknown kernel backend {backend!r} (expected 'torch' or 'triton')")
