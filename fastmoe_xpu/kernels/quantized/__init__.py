"""Quantized stage 4: the ``int8`` and ``fp8`` expert-GEMM implementations of the registry.

``core`` holds the formats, the per-row / per-column quantizers, the quantized GEMM with its
dequantizing epilogue and the per-call weight codes; ``launchers`` the contract's stage-4
launchers on them; ``int8`` and ``fp8`` bind a format (the registry's launcher modules);
``reference`` states the same maths in plain PyTorch, expert by expert.
"""
