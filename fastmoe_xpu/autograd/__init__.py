"""One ``torch.autograd.Function`` per differentiable stage; they call launchers only. Their
forward and backward bodies are plain functions, shared with the custom ops of :mod:`fastmoe_xpu.ops`.

The layer trains eagerly with :class:`GateUpFunction` and :class:`DownCombineFunction` (``fused.py``:
no ``h`` or expert outputs kept); :class:`ExpertMLPFunction` and :class:`CombineFunction` are
stage 4 and stage 5 alone, for callers that need the expert outputs as a tensor.
"""
from .combine import CombineFunction, combine_backward
from .expert_mlp import ExpertMLPFunction, expert_mlp_backward, expert_mlp_forward
from .fused import DownCombineFunction, GateUpFunction, down_combine_backward, gate_up_backward

__all__ = [
    "CombineFunction", "DownCombineFunction", "ExpertMLPFunction", "GateUpFunction", "combine_backward",
    "down_combine_backward", "expert_mlp_backward", "expert_mlp_forward", "gate_up_backward",
]
