"""FastSparseMoeBlock: a drop-in for transformers' ``OlmoeSparseMoeBlock``, in five stages.

(1) router (softmax, top-k); (2) token counting with prefix sums; (3) index generation; (4) grouped
GEMMs over the merged expert weights (gate/up, SiLU*up, down); (5) weighted output reduction.

With an expert-parallel group of size EP, rank r holds experts ``[r*NR, (r+1)*NR)`` (NR = E/EP)
and tokens reach them through the block's token dispatcher (allgather or all-to-all,
:mod:`fastmoe_xpu.dist.dispatch`; without expert parallelism the local one, which moves nothing);
the router is replicated. The experts module, config checks and router factory live in
:mod:`fastmoe_xpu.expert_weights`, :mod:`fastmoe_xpu.block_config` and :mod:`fastmoe_xpu.routing`.

Legend: B batch, S sequence, T = B*S tokens, H hidden, I intermediate, E experts, K experts per
token, NR local experts, R routed rows.
"""
from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from .autograd.moe_experts import kernel_backend, moe_experts_forward
from .block_config import check_backend, validate_config
from .dist.dispatch import DISPATCH_MODES, check_dispatch_mode, make_dispatcher
from .dist.groups import member_position
from .dist.sharding import EXPERT_IDS_NAME, expert_range, slice_full_experts
from .expert_weights import Experts, dispatch_experts_implementation, experts_implementation_name
from .integrations.peft_lora import unwrap_experts
from .integrations.v4_keys import V4_NAMES, stack_v4_experts
from .kernels.registry import check_choice, check_precision
from .routing import TopKRouter, forced_uniform_routing, make_router

__all__ = [
    "DISPATCH_MODES",
    "Experts",
    "FastSparseMoeBlock",
    "dispatch_experts_implementation",
    "make_router",
    "validate_config",
]


class FastSparseMoeBlock(nn.Module):
    """Drop-in replacement for transformers' ``OlmoeSparseMoeBlock``.

    Args:
        config: an ``OlmoeConfig`` or any object with ``hidden_size``, ``intermediate_size``,
            ``num_experts``, ``num_experts_per_tok``, ``norm_topk_prob`` and ``hidden_act``.
        backend: ``"auto"`` (Triton on xpu/cuda, torch on the CPU; ``FASTMOE_BACKEND`` overrides),
            ``"torch"`` or ``"triton"``.
        forced_uniform_routing: route every token to a fixed pattern that gives each expert the
            same number of tokens (for benchmarks free of routing imbalance).
        ep_group: expert-parallel process group. Rank r of EP holds experts ``[r*NR, (r+1)*NR)``:
            ``experts.gate_up_proj [NR, 2I, H]``, ``experts.down_proj [NR, H, I]`` and their global
            ids in the buffer ``experts.expert_ids``; ``gate.weight [E, H]`` is replicated (keep it
            identical across the group). Loading a full Hugging Face state dict keeps this rank's
            slice. None: all experts here, no communication.
        dispatch: ``"allgather"`` (every rank gathers all tokens, runs its experts on them, the
            partial outputs are reduce-scattered; equal token counts per rank; no host
            synchronisation besides the input check) or ``"alltoall"`` (tokens travel only to the
            ranks holding their experts; counts are exchanged and read on the host; token counts
            may differ). Both give the same numbers.
        gemm_engine: who runs the grouped GEMMs of stage 4: ``"auto"`` (default: the fastest
            available engine, timed once per device, dtype and shape bucket on first use and cached
            on disk; rank 0's choice under expert parallelism; ``FASTMOE_GEMM_ENGINE`` overrides),
            ``"native"`` (the backend's own), ``"triton"``, ``"grouped_mm"`` or ``"loop"``
            (``fastmoe_xpu/kernels/registry.py``).
        check_inputs: under expert parallelism, agree on every rank's token count and input
            validity with one all-gather of two integers per rank before communicating, so that a
            bad or mismatched input raises on every rank instead of hanging. It reads the result on
            the host; allgather-dispatch training with fixed shapes may turn it off to save that
            synchronisation (then mismatched inputs are the caller's problem).
        expert_precision: ``None`` (default: the expert GEMMs in the weights' dtype), ``"int8"``
            (every stage-4 GEMM, forward and both backward, quantized to int8 with per-row
            activation and per-output-channel weight scales, int32 accumulation) or ``"fp8"``
            (e4m3 forward, e5m2 gradients); see docs/precision.md. Raises at the first forward
            where the device cannot run it.
    """

    def __init__(
        self,
        config: Any,
        *,
        backend: str = "auto",
        forced_uniform_routing: bool = False,
        ep_group: dist.ProcessGroup | None = None,
        dispatch: str = "allgather",
        check_inputs: bool = True,
        gemm_engine: str = "auto",
        expert_precision: str | None = None,
    ) -> None:
        super().__init__()
        validate_config(config)
        self.gemm_engine = check_choice(gemm_engine)
        self.expert_precision = check_precision(expert_precision)
        check_backend(backend)
        check_dispatch_mode(dispatch)
        self.hidden_size = config.hidden_size
        self.intermediate_size = config.intermediate_size
        self.num_experts = config.num_experts
        self.top_k = config.num_experts_per_tok
        self.norm_topk_prob = bool(config.norm_topk_prob)
        self.backend = backend
        self.forced_uniform_routing = bool(forced_uniform_routing)
        self.ep_group = ep_group
        self.dispatch = dispatch
        self.check_inputs = bool(check_inputs)
        self.ep_rank, self.ep_size = member_position(ep_group)
        local_ids = expert_range(config.num_experts, self.ep_size, self.ep_rank)
        #: How tokens reach this rank's experts: locally, or over ``ep_group`` in mode ``dispatch``.
        self.dispatcher = make_dispatcher(ep_group, dispatch, config.num_experts, check_inputs=check_inputs)
        self.num_local_experts = len(local_ids)
        self.expert_start = local_ids.start
        self.gate = make_router(config)
        self.experts = Experts(self.num_local_experts, config.hidden_size, config.intermediate_size)
        if ep_group is not None:
            self.experts.global_num_experts = config.num_experts
            self.experts.register_buffer(
                EXPERT_IDS_NAME, torch.arange(local_ids.start, local_ids.stop, dtype=torch.int64)
            )
            self.experts.register_load_state_dict_pre_hook(slice_full_experts)
        self.reset_parameters(getattr(config, "initializer_range", 0.02))

    def reset_parameters(self, std: float = 0.02) -> None:
        with torch.no_grad():
            for p in (self.gate.weight, self.experts.gate_up_proj, self.experts.down_proj):
                p.normal_(0.0, std)

    def extra_repr(self) -> str:
        text = (
            f"hidden={self.hidden_size}, intermediate={self.intermediate_size}, experts={self.num_experts}, "
            f"top_k={self.top_k}, backend={self.backend!r}, gemm_engine={self.gemm_engine!r}, "
            f"expert_precision={self.expert_precision!r}, forced_uniform_routing={self.forced_uniform_routing}"
        )
        if self.ep_group is not None:
            text += (
                f", ep_rank={self.ep_rank}/{self.ep_size}, local_experts=[{self.expert_start}, "
                f"{self.expert_start + self.num_local_experts}), dispatch={self.dispatch!r}"
            )
        return text

    # ---------------------------------------------------------------- construction from HF
    @classmethod
    def from_hf(cls, block: nn.Module, **options: Any) -> "FastSparseMoeBlock":
        """Build from a transformers ``OlmoeSparseMoeBlock`` (v5 merged or v4 per-expert layout),
        with the same weights; ``options`` are the block's keyword arguments (``backend``,
        ``ep_group``, ``dispatch``, ...). v5 parameters (and the router module itself) are shared,
        not copied; with ``ep_group`` the block copies only this rank's experts (the full tensors
        can then be freed)."""
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
                gate_up, down = stack_v4_experts(
                    {e: {n: getattr(m, n).weight for n in V4_NAMES} for e, m in enumerate(experts)}, "experts."
                )
            w_gate_up, w_down = nn.Parameter(gate_up), nn.Parameter(down)
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
            new = cls(cfg, **options)
        if hasattr(gate, "top_k") and not isinstance(gate, nn.Linear):
            new.gate = gate  # v5 router: keep the very module (and any hooks on it)
        else:
            new.gate = TopKRouter(cfg).to(device=gate.weight.device)
            new.gate.weight = gate.weight
        if new.ep_group is None:
            new.experts.gate_up_proj = w_gate_up
            new.experts.down_proj = w_down
            return new
        lo, hi = new.expert_start, new.expert_start + new.num_local_experts
        for name, full in (("gate_up_proj", w_gate_up), ("down_proj", w_down)):
            local = nn.Parameter(full.detach()[lo:hi].clone(), requires_grad=full.requires_grad)
            setattr(new.experts, name, local)
        setattr(new.experts, EXPERT_IDS_NAME, torch.arange(lo, hi, dtype=torch.int64, device=w_gate_up.device))
        return new

    # ---------------------------------------------------------------- forward
    def _check_input(self, hidden_states: torch.Tensor) -> int:
        """The token count of ``hidden_states``; TypeError or ValueError when the block cannot take it."""
        if not isinstance(hidden_states, torch.Tensor):
            raise TypeError(f"hidden_states must be a tensor, got {type(hidden_states).__name__}")
        if not hidden_states.dtype.is_floating_point:
            raise TypeError(f"hidden_states must be floating point, got {hidden_states.dtype}")
        if hidden_states.dim() < 2 or hidden_states.shape[-1] != self.hidden_size:
            raise ValueError(
                f"hidden_states must be [..., {self.hidden_size}] (hidden_size), got {tuple(hidden_states.shape)}"
            )
        w = unwrap_experts(self.experts)[0].gate_up_proj
        if hidden_states.device != w.device:
            raise ValueError(f"hidden_states on {hidden_states.device} but the block's weights on {w.device}")
        if hidden_states.dtype != w.dtype:
            raise TypeError(f"hidden_states dtype {hidden_states.dtype} differs from the block's weights {w.dtype}")
        return hidden_states.numel() // self.hidden_size

    def route(
        self, x_TH: torch.Tensor, token_offset: int = 0
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Stage 1: ``(router_logits [T, E], top_k_weights [T, K], top_k_index [T, K])``.
        ``token_offset``: where these tokens start in the EP group's batch (forced routing only)."""
        logits_TE, weights_TK, idx_TK = self.gate(x_TH)
        if self.forced_uniform_routing:
            weights_TK, idx_TK = forced_uniform_routing(logits_TE, self.top_k, self.norm_topk_prob, token_offset)
        return logits_TE, weights_TK, idx_TK

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """Check (agreed over the EP group) -> route -> dispatch -> stages 2-5 -> combine."""
        # PEFT's LoRA on the expert weights (target_parameters) wraps the experts module: its adapters
        # run inside our grouped GEMMs.
        experts, lora = unwrap_experts(self.experts)
        other = dispatch_experts_implementation(experts)
        if other is not None:  # the model was switched to another experts implementation
            if lora:
                raise ValueError("error: LoRA adapters on FastSparseMoeBlock experts run with the 'fastmoe' experts "
                                 f"implementation only, not {experts_implementation_name(experts)!r}")
            self.dispatcher.check_experts_implementation(experts_implementation_name(experts))
        device = experts.gate_up_proj.device
        offset = self.dispatcher.prepare(
            hidden_states, self._check_input, device=device, need_offset=self.forced_uniform_routing
        )
        shape = hidden_states.shape
        x_TH = hidden_states.reshape(-1, self.hidden_size).contiguous()
        _, weights_TK, idx_TK = self.route(x_TH, offset)
        if other is not None:
            return other(experts, x_TH, idx_TK, weights_TK).view(shape)
        x_NH, weights_NK, idx_NK, state = self.dispatcher.dispatch(x_TH, weights_TK, idx_TK)
        partial_NH = moe_experts_forward(
            x_NH, weights_NK, idx_NK, experts.gate_up_proj, experts.down_proj,
            backend=kernel_backend(self.backend, device), expert_start=self.expert_start,
            gemm_engine=self.gemm_engine, ep_group=self.dispatcher.ep_group, lora=lora or None,
            expert_precision=self.expert_precision,
            routed_rows=self.dispatcher.local_rows(x_NH.shape[0], idx_NK.shape[1], state) if x_NH.is_meta else None,
        )
        return self.dispatcher.combine(partial_NH, state).view(shape)
