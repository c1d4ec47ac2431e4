"""One ``torch.autograd.Function`` per differentiable stage; they call launchers only.

The layer trains with :class:`GateUpFunction` and :class:`DownCombineFunction` (``fused.py``: no
``h`` or expert outputs kept); :class:`ExpertMLPFunction` and :class:`CombineFunction` are stage 4
and stage 5 alone, for callers that need the expert outputs as a tensor.
"""
from .combine import CombineFunction
from .expert_mlp import ExpertMLPFunction
from .fused import DownCombineFunction, GateUpFunction

__all__ = ["CombineFunction", "DownCombineFunction", "ExpertMLPFunction", "GateUpFunction"]
