"""One ``torch.autograd.Function`` per differentiable stage; they call launchers only."""
from .combine import CombineFunction
from .expert_mlp import ExpertMLPFunction

__all__ = ["CombineFunction", "ExpertMLPFunction"]
