"""The ``fp8`` stage-4 implementation: the quantized launchers (:mod:`.launchers`) with the ``fp8`` format."""
from __future__ import annotations

from .launchers import LAUNCHERS, bind

FORMAT = "fp8"
globals().update(bind(FORMAT))

__all__ = ["FORMAT", "LAUNCHERS", *LAUNCHERS]
