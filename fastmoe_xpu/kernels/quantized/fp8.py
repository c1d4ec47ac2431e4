"""The ``fp8`` stage-4 implementation: the quantized launchers (:mod:`.launchers`) with the ``fp8`` format
(next to the Triton base, on GPUs with fp8 tensor cores and under the interpreter:
:mod:`..triton.fp8_gemm` for every expert GEMM)."""
from __future__ import annotations

import functools

from .launchers import LAUNCHERS, bind, launchers_for as _launchers_for

FORMAT = "fp8"
globals().update(bind(FORMAT))
#: The launchers next to a kernel base (the registry asks): with the Triton base, the forward,
#: input-gradient and weight-gradient GEMMs run as the Triton fp8 grouped kernels.
launchers_for = functools.partial(_launchers_for, FORMAT)

__all__ = ["FORMAT", "LAUNCHERS", "launchers_for", *LAUNCHERS]
