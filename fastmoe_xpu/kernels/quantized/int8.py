"""The ``int8`` stage-4 implementation: the quantized launchers (:mod:`.launchers`) with the ``int8`` format
(next to the Triton base: :mod:`..triton.int8_gemm` for every expert GEMM)."""
from __future__ import annotations

import functools

from .launchers import LAUNCHERS, bind, launchers_for as _launchers_for

FORMAT = "int8"
globals().update(bind(FORMAT))
#: The launchers next to a kernel base (the registry asks): with the Triton base, the forward,
#: input-gradient and weight-gradient GEMMs run as the Triton int8 grouped kernels.
launchers_for = functools.partial(_launchers_for, FORMAT)

__all__ = ["FORMAT", "LAUNCHERS", "launchers_for", *LAUNCHERS]
