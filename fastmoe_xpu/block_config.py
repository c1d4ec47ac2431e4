"""What a FastSparseMoeBlock is built from: the config fields it reads, checked with clear errors."""
from __future__ import annotations

from typing import Any

_REQUIRED_FIELDS = (
    "hidden_size", "intermediate_size", "num_experts", "num_experts_per_tok", "norm_topk_prob", "hidden_act",
)
_SUPPORTED_ACTS = ("silu", "swish")
#: Stages 2-5's kernel backends (``"auto"``: Triton on xpu/cuda, torch on the CPU).
BACKENDS = ("auto", "torch", "triton")


def validate_config(config: Any) -> None:
    """Raise a clear error for a config the block cannot be built from."""
    missing = [f for f in _REQUIRED_FIELDS if not hasattr(config, f)]
    if missing:
        raise ValueError(f"config is missing field(s) {missing}; FastSparseMoeBlock needs {list(_REQUIRED_FIELDS)}")
    for f in ("hidden_size", "intermediate_size", "num_experts", "num_experts_per_tok"):
        v = getattr(config, f)
        if not isinstance(v, int) or isinstance(v, bool):
            raise TypeError(f"config.{f} must be an int, got {type(v).__name__}")
        if v < 1:
            raise ValueError(f"config.{f} must be >= 1, got {v}")
    if config.num_experts_per_tok > config.num_experts:
        raise ValueError(
            f"num_experts_per_tok={config.num_experts_per_tok} exceeds num_experts={config.num_experts}"
        )
    if config.hidden_act not in _SUPPORTED_ACTS:
        raise ValueError(f"hidden_act={config.hidden_act!r} is not supported (the fused kernels use SiLU)")


def check_backend(backend: str) -> str:
    if backend not in BACKENDS:
        raise ValueError(f"backend must be 'auto', 'torch' or 'triton', got {backend!r}")
    return backend
