"""Launchers of stages 2-5: one typed contract (:mod:`.contract`), implementations in one registry.

:func:`kernels` (from :mod:`.registry`) returns a kernel set by name: ``"torch"``
(:mod:`fastmoe_xpu.kernels.torch`, plain PyTorch, the CPU's kernels), ``"triton"``
(:mod:`fastmoe_xpu.kernels.triton`: xpu/cuda, or the CPU under ``TRITON_INTERPRET=1``), or a base
with another stage-4 implementation (``"torch+grouped_mm"``). Each is typed as
:class:`.contract.KernelBackend`, whose methods list every launcher:

========================  ======================================================================
``count_tokens``          stage 2: per-block counts of local experts and their prefix sums
                          (:class:`.contract.TokenCounts`)
``build_indices``         stage 3: rows and slots (:class:`.contract.RowIndices`)
``gate_up_fwd``           stage 4: gathered grouped GEMM with ``gate_up_proj``, then SiLU*up
``down_fwd``              stage 4: grouped GEMM with ``down_proj`` (``transposed=True``: a weight
                          stored ``[NR, in, out]``, read in place)
``down_bwd``              stage 4 backward: input and weight gradients of a plain grouped GEMM
                          (``transposed=True``: the weight gradient in that stored layout)
``down_weighted_bwd``     stage 4 backward of the row-weighted down GEMM: h recomputed from gate/up,
                          and the router-weight gradient per row
``silu_mul_bwd``          stage 4 backward: gradient of SiLU*up
``gate_up_bwd``           stage 4 backward: row gradients and weight gradient of the gate/up GEMM
``combine_fwd``           stage 5: weighted (or plain) reduction of expert rows back to tokens
``combine_bwd``           stage 5 backward: unweighted row gradients and each row's weight
``router_weights_bwd``    stage 5 backward: the per-row router-weight gradients back to ``[T, K]``
========================  ======================================================================

``configs.py`` holds the Triton tiles per config table; ``timing.py`` the timer and cache of the
measured choices.
"""
from __future__ import annotations

from .contract import KernelBackend
from .registry import kernels

__all__ = ["KernelBackend", "kernels"]
