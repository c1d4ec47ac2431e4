"""fastmoe_xpu: fast Mixture-of-Experts blocks for OLMoE-style models on XPU, CUDA and the CPU."""
from .block import FastSparseMoeBlock
from .integrations.experts import NAME as EXPERTS_IMPLEMENTATION
from .integrations.experts import fastmoe_experts_forward
from .integrations.registration import register_lazily as _register_experts
from .integrations.transformers import patch_olmoe
from .kernels.quantized.core import forget_weights as forget_quantized_weights
from .kernels.quantized.core import frozen_weights as frozen_expert_weights
from .kernels.torch.buffers import release_buffers
from .routing import OLMOE_LOAD_BALANCING_COEF, OLMOE_Z_LOSS_COEF, load_balancing_loss, router_z_loss

__all__ = [
    "FastSparseMoeBlock",
    "patch_olmoe",
    "EXPERTS_IMPLEMENTATION",
    "fastmoe_experts_forward",
    "release_buffers",
    "frozen_expert_weights",
    "forget_quantized_weights",
    "load_balancing_loss",
    "router_z_loss",
    "OLMOE_LOAD_BALANCING_COEF",
    "OLMOE_Z_LOSS_COEF",
]
__version__ = "0.1.0"

# transformers models then accept experts_implementation="fastmoe": registered now when transformers'
# experts interface is already imported, else right after it is (it is ~2 s to import, and every use of
# the name imports it first); a no-op without transformers; an ImportError naming the version when
# transformers predates the experts interface.
_register_experts()
