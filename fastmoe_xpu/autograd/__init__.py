"""Stages 2-5 with their gradients: the ``fastmoe`` custom ops (:mod:`.ops`, each differentiable op
with ``register_autograd``) and the one experts op that chains them (:mod:`.moe_experts`), for
eager runs, ``torch.compile`` and ``torch.export`` alike."""
from .moe_experts import moe_experts_forward
from .ops import OP_NAMES

__all__ = ["OP_NAMES", "moe_experts_forward"]
