"""The ``int8`` stage-4 implementation: the quantized launchers (:mod:`.launchers`) with the ``int8`` format."""
from __future__ import annotations

from .launchers import LAUNCHERS, bind

FORMAT = "int8"
globals().update(bind(FORMAT))

__all__ = ["FORMAT", "LAUNCHERS", *LAUNCHERS]
