"""fastmoe_xpu: fast Mixture-of-Experts blocks for OLMoE-style models on XPU, CUDA and the CPU."""
from .block import FastSparseMoeBlock
from .integrations.transformers import patch_olmoe
from .kernels.torch.buffers import release_buffers
from .routing import OLMOE_LOAD_BALANCING_COEF, OLMOE_Z_LOSS_COEF, load_balancing_loss, router_z_loss

__all__ = [
    "FastSparseMoeBlock",
    "patch_olmoe",
    "release_buffers",
    "load_balancing_loss",
    "router_z_loss",
    "OLMOE_LOAD_BALANCING_COEF",
    "OLMOE_Z_LOSS_COEF",
]
__version__ = "0.1.0"
