"""One ``torch.autograd.Function`` per differentiable stage; they call launchers only. Their
forward and backward bodies are plain functions, shared with the custom ops of :mod:`fastmoe_xpu.ops`."""
from .combine import CombineFunction, combine_backward
from .expert_mlp import ExpertMLPFunction, expert_mlp_backward, expert_mlp_forward

__all__ = ["CombineFunction", "ExpertMLPFunction", "combine_backward", "expert_mlp_backward", "expert_mlp_forward"]
