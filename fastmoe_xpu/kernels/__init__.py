"""Launchers of stages 2-5: one typed contract (:mod:`.contract`), two backends.

``get_ops("torch")`` returns :mod:`fastmoe_xpu.kernels.torch` (plain PyTorch, the CPU backend);
``get_ops("triton")`` returns :mod:`fastmoe_xpu.kernels.triton` (Triton kernels: xpu/cuda, or the
CPU under ``TRITON_INTERPRET=1``). Both are typed as :class:`.contract.KernelBackend`, whose
methods list every launcher:

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

``configs.py`` holds the Triton tiles per device; which backend and table run is decided by
:func:`fastmoe_xpu.device.choose_kernels`.
"""
from __future__ import annotations

from .contract import KernelBackend


def get_ops(backend: str) -> KernelBackend:
    """The launchers of ``backend`` (``"torch"`` or ``"triton"``). Imported on first use, so that
    triton stays optional and is imported only where its kernels run."""
    # The imports stay inside the branches: "triton" needs the triton package, "torch" never does.
    if backend == "torch":
        from . import torch as torch_backend

        return torch_backend
    if backend == "triton":
        from . import triton as triton_backend

        return triton_backend
    raise ValueError(f"unknown kernel backend {backend!r} (expected 'torch' or 'triton')")
