"""FastSparseMoeBlock: a drop-in for transformers' ``OlmoeSparseMoeBlock``, in five stages.

(1) router (softmax, top-k); (2) token counting with prefix sums; (3) index generation; (4) grouped
GEMMs over the merged expert weights (gate/up, SiLU*up, down); (5) weighted output reduction.

Legend: B batch, S sequence, T = B*S tokens, H hidden, I intermediate, E experts, K experts per
token, NR local experts, R routed rows.
"""
from __future__ import annotations

import math
from types import SimpleNamespace
from typing import Any

import torch
import torch.nn as nn

from .autograd import CombineFunction, ExpertMLPFunction
from .device import resolve_backend
from .kernels import get_ops
from .routing import TopKRouter, forced_uniform_routing

#: Token block size of the counting stage (TBS in the paper).
TOKEN_BLOCK_SIZE = 8

_REQUIRED_FIELDS = (
    "hidden_size", "intermediate_size", "num_experts", "num_experts_per_tok", "norm_topk_prob", "hidden_act",
)
_SUPPORTED_ACTS = ("silu", "swish")


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


def make_router(config: Any) -> nn.Module:
    """transformers' own ``OlmoeTopKRouter`` when installed, so that its ``output_router_logits``
    recording hooks (which match on that class) see our router; else the identical TopKRouter."""
    try:
        from transformers.models.olmoe.modeling_olmoe import OlmoeTopKRouter
    except Exception:  # transformers missing or without v5's router
        return TopKRouter(config)
    return OlmoeTopKRouter(config)


class Experts(nn.Module):
    """The merged expert weights, named and shaped as transformers v5's ``OlmoeExperts``.

    ``gate_up_proj [NR, 2I, H]`` (gate rows first, then up) and ``down_proj [NR, H, I]``. Also
    loads transformers v4 per-expert keys (``{e}.gate_proj.weight``, ``{e}.up_proj.weight``,
    ``{e}.down_proj.weight``).
    """

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.hidden_dim = hidden_size
        self.intermediate_dim = intermediate_size
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size, hidden_size))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size))
        self.register_load_state_dict_pre_hook(_merge_v4_expert_keys)

    def extra_repr(self) -> str:
        return f"num_experts={self.num_experts}, hidden={self.hidden_dim}, intermediate={self.intermediate_dim}"


def _merge_v4_expert_keys(module, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs):
    """Turn ``{prefix}{e}.{gate,up,down}_proj.weight`` (transformers v4) into the merged tensors."""
    if prefix + "gate_up_proj" in state_dict or prefix + "0.gate_proj.weight" not in state_dict:
        return
    gate_up, down = [], []
    n = module.num_experts
    for e in range(n):
        keys = [f"{prefix}{e}.{name}.weight" for name in ("gate_proj", "up_proj", "down_proj")]
        absent = [k for k in keys if k not in state_dict]
        if absent:
            error_msgs.append(f"transformers-v4 expert keys incomplete: missing {absent}")
            return
        g, u, d = (state_dict.pop(k) for k in keys)
        gate_up.append(torch.cat([g, u], dim=0))
        down.append(d)
    state_dict[prefix + "gate_up_proj"] = torch.stack(gate_up)
    state_dict[prefix + "down_proj"] = torch.stack(down)


def moe_experts_forward(
    x_TH: torch.Tensor,
    weights_TK: torch.Tensor,
    topk_idx_TK: torch.Tensor,
    w_gate_up_N2IH: torch.Tensor,
    w_down_NHI: torch.Tensor,
    *,
    backend: str = "torch",
    expert_start: int = 0,
    block_size: int = TOKEN_BLOCK_SIZE,
) -> torch.Tensor:
    """Stages 2-5 on this rank's experts ``[expert_start, expert_start + NR)``; returns ``[T, H]``
    (partial sums when other ranks hold other experts)."""
    ops = get_ops(backend)
    num_local = w_gate_up_N2IH.shape[0]
    with torch.no_grad():
        _, partial_cum, _, cum_expert, cum_token = ops.count_tokens(topk_idx_TK, expert_start, num_local, block_size)
        input_idx, output_idx, selected = ops.build_indices(
            topk_idx_TK, partial_cum, cum_expert, expert_start, num_local, block_size
        )
    y_RH = ExpertMLPFunction.apply(
        x_TH, w_gate_up_N2IH, w_down_NHI, input_idx, output_idx, cum_token, cum_expert, ops
    )
    return CombineFunction.apply(y_RH, weights_TK, output_idx, selected, cum_expert, ops)


class FastSparseMoeBlock(nn.Module):
    """Drop-in replacement for transformers' ``OlmoeSparseMoeBlock``.

    Args:
        config: an ``OlmoeConfig`` or any object with ``hidden_size``, ``intermediate_size``,
            ``num_experts``, ``num_experts_per_tok``, ``norm_topk_prob`` and ``hidden_act``.
        backend: ``"auto"`` (Triton on xpu/cuda, torch on the CPU; ``FASTMOE_BACKEND`` overrides),
            ``"torch"`` or ``"triton"``.
        forced_uniform_routing: route every token to a fixed pattern that gives each expert the
            same number of tokens (for benchmarks free of routing imbalance).
    """

    def __init__(self, config: Any, *, backend: str = "auto", forced_uniform_routing: bool = False) -> None:
        super().__init__()
        validate_config(config)
        if backend not in ("auto", "torch", "triton"):
            raise ValueError(f"backend must be 'auto', 'torch' or 'triton', got {backend!r}")
        self.hidden_size = config.hidden_size
        self.intermediate_size = config.intermediate_size
        self.num_experts = config.num_experts
        self.top_k = config.num_experts_per_tok
        self.norm_topk_prob = bool(config.norm_topk_prob)
        self.backend = backend
        self.forced_uniform_routing = bool(forced_uniform_routing)
        self.expert_start = 0
        self.gate = make_router(config)
        self.experts = Experts(config.num_experts, config.hidden_size, config.intermediate_size)
        self.reset_parameters(getattr(config, "initializer_range", 0.02))

    def reset_parameters(self, std: float = 0.02) -> None:
        with torch.no_grad():
            for p in (self.gate.weight, self.experts.gate_up_proj, self.experts.down_proj):
                p.normal_(0.0, std)

    def extra_repr(self) -> str:
        return (
            f"hidden={self.hidden_size}, intermediate={self.intermediate_size}, experts={self.num_experts}, "
            f"top_k={self.top_k}, backend={self.backend!r}, forced_uniform_routing={self.forced_uniform_routing}"
        )

    # ---------------------------------------------------------------- construction from HF
    @classmethod
    def from_hf(cls, block: nn.Module, *, backend: str = "auto", forced_uniform_routing: bool = False) -> "FastSparseMoeBlock":
        """Build from a transformers ``OlmoeSparseMoeBlock`` (v5 merged or v4 per-expert layout),
        with the same weights. v5 parameters (and the router module itself) are shared, not copied."""
        gate = block.gate
        experts = block.experts
        if hasattr(experts, "gate_up_proj"):  # transformers v5
            E, two_i, H = experts.gate_up_proj.shape
            w_gate_up, w_down = experts.gate_up_proj, experts.down_proj
        elif isinstance(experts, nn.ModuleList):  # transformers v4
            E = len(experts)
            I, H = experts[0].gate_proj.weight.shape
            two_i = 2 * I
            with torch.no_grad():
                w_gate_up = nn.Parameter(torch.stack(
                    [torch.cat([m.gate_proj.weight, m.up_proj.weight], 0) for m in experts]))
                w_down = nn.Parameter(torch.stack([m.down_proj.weight for m in experts]))
        else:
            raise TypeError(f"from_hf expects an OlmoeSparseMoeBlock, got {type(block).__name__}")
        top_k = getattr(gate, "top_k", None) or getattr(block, "top_k", None)
        norm = getattr(gate, "norm_topk_prob", None)
        if norm is None:
            norm = getattr(block, "norm_topk_prob", False)
        cfg = SimpleNamespace(
            hidden_size=H, intermediate_size=two_i // 2, num_experts=E, num_experts_per_tok=int(top_k),
            norm_topk_prob=bool(norm), hidden_act="silu",
        )
        with torch.device("meta"):  # no memory or init work for weights replaced just below
            new = cls(cfg, backend=backend, forced_uniform_routing=forced_uniform_routing)
        if hasattr(gate, "top_k") and not isinstance(gate, nn.Linear):
            new.gate = gate  # v5 router: keep the very module (and any hooks on it)
        else:
            new.gate = TopKRouter(cfg).to(device=gate.weight.device)
            new.gate.weight = gate.weight
        new.experts.gate_up_proj = w_gate_up
        new.experts.down_proj = w_down
        return new

    # ---------------------------------------------------------------- forward
    def _check_input(self, hidden_states: torch.Tensor) -> None:
        if not isinstance(hidden_states, torch.Tensor):
            raise TypeError(f"hidden_states must be a tensor, got {type(hidden_states).__name__}")
        if not hidden_states.dtype.is_floating_point:
            raise TypeError(f"hidden_states must be floating point, got {hidden_states.dtype}")
        if hidden_states.dim() < 2 or hidden_states.shape[-1] != self.hidden_size:
            raise ValueError(
                f"hidden_states must be [..., {self.hidden_size}] (hidden_size), got {tuple(hidden_states.shape)}"
            )
        w = self.experts.gate_up_proj
        if hidden_states.device != w.device:
            raise ValueError(f"hidden_states on {hidden_states.device} but the block's weights on {w.device}")
        if hidden_states.dtype != w.dtype:
            raise TypeError(f"hidden_states dtype {hidden_states.dtype} differs from the block's weights {w.dtype}")

    def route(self, x_TH: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Stage 1: ``(router_logits [T, E], top_k_weights [T, K], top_k_index [T, K])``."""
        logits_TE, weights_TK, idx_TK = self.gate(x_TH)
        if self.forced_uniform_routing:
            weights_TK, idx_TK = forced_uniform_routing(logits_TE, self.top_k, self.norm_topk_prob)
        return logits_TE, weights_TK, idx_TK

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        self._check_input(hidden_states)
        shape = hidden_states.shape
        x_TH = hidden_states.reshape(-1, self.hidden_size)
        _, weights_TK, idx_TK = self.route(x_TH)
        backend = resolve_backend(self.backend, x_TH.device)
        out_TH = moe_experts_forward(
            x_TH.contiguous(), weights_TK, idx_TK, self.experts.gate_up_proj, self.experts.down_proj,
            backend=backend, expert_start=self.expert_start,
        )
        return out_TH.view(shape)


def _is_hf_olmoe_block(module: nn.Module) -> bool:
    return type(module).__name__ == "OlmoeSparseMoeBlock" and hasattr(module, "gate") and hasattr(module, "experts")


def patch_olmoe(model: nn.Module, *, backend: str = "auto", forced_uniform_routing: bool = False) -> int:
    """Replace every ``OlmoeSparseMoeBlock`` in ``model`` in place by a FastSparseMoeBlock with the
    same weights; returns how many were replaced."""
    targets = [(name, m) for name, m in model.named_modules() if _is_hf_olmoe_block(m)]
    for name, block in targets:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        new = FastSparseMoeBlock.from_hf(block, backend=backend, forced_uniform_routing=forced_uniform_routing)
        new.train(block.training)
        setattr(parent, child, new)
    return len(targets)
