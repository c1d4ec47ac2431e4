"""Stages 2-5 with their gradients: the ``fastmoe`` custom ops (:mod:`.ops`, each differentiable op
with an ``autograd.Function`` as its Autograd kernel) and the one experts op that chains them (:mod:`.moe_experts`), for
eager runs, ``torch.compile`` and ``torch.export`` alike."""
from .moe_experts import moe_experts_forward
from .ops import OP_NAMES

__all__ = ["OP_NAMES", "moe_experts_forward"]
