"""FastSparseMoeBlock: a drop-in for transformers' ``OlmoeSparseMoeBlock``, in five stages.

(1) router (softmax, top-k); (2) token counting with prefix sums; (3) index generation; (4) grouped
GEMMs over the merged expert weights (gate/up, SiLU*up, down); (5) weighted output reduction.

With an expert-parallel group of size EP, rank r holds experts ``[r*NR, (r+1)*NR)`` (NR = E/EP)
and tokens reach them by allgather or all-to-all dispatch (:mod:`fastmoe_xpu.dist.dispatch`); the
router is replicated.

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
from .dist.collectives import agree_on_inputs, assert_same_tokens_on_device
from .dist.dispatch import allgather_dispatch, alltoall_dispatch, token_offset
from .dist.env import check_group_device
from .dist.sharding import EXPERT_IDS_NAME, expert_range
from .integrations.experts import when_interface_imported
from .integrations.v4_keys import merge_v4_expert_keys
from .kernels.registry import check_choice
from .routing import TopKRouter, forced_uniform_routing

#: Token dispatch modes under expert parallelism.
DISPATCH_MODES = ("allgather", "alltoall")

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
        self.register_load_state_dict_pre_hook(merge_v4_expert_keys)
        # What transformers' @use_experts_implementation sets, so that its MoE tooling (expert and
        # tensor parallel plans, exporters) and its experts functions recognise these experts.
        self.has_gate = True
        self.has_bias = False
        self.is_concatenated = True
        self.is_transposed = False
        self.has_post_expert_norm = False
        self._is_expert_parallel = False
        self.act_fn = nn.SiLU()
        #: The model config whose ``_experts_implementation`` the block follows (set by patch_olmoe).
        self.config: Any = None

    def _apply_gate(self, gate_up_R2I: torch.Tensor) -> torch.Tensor:
        """transformers' default gate: ``act_fn(gate) * up`` over the concatenated halves."""
        gate, up = gate_up_R2I.chunk(2, dim=-1)
        return self.act_fn(gate) * up

    def extra_repr(self) -> str:
        return f"num_experts={self.num_experts}, hidden={self.hidden_dim}, intermediate={self.intermediate_dim}"


def _adopt_default_gate(moe: Any) -> None:
    """The very default gate function, so that transformers (and describe_layout) see the default gate;
    without v5's experts interface the identical method above stays."""
    fn = getattr(moe, "_default_apply_gate", None)
    if fn is not None:
        Experts._apply_gate = fn


# when transformers' MoE module is imported (now, or later: importing it costs ~2 s, see
# fastmoe_xpu/__init__.py); nothing happens without transformers
when_interface_imported(_adopt_default_gate)


def _slice_full_experts(module, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs):
    """On an expert-parallel shard: cut a full (all-expert) state dict to this shard's experts, and
    refuse a shard saved for other experts."""
    ids_key = prefix + EXPERT_IDS_NAME
    mine = module.expert_ids
    if ids_key in state_dict:
        theirs = state_dict[ids_key]
        if theirs.shape != mine.shape or not torch.equal(theirs.cpu(), mine.cpu()):
            error_msgs.append(
                f"{prefix}: the state dict holds experts {theirs.tolist()} but this expert-parallel shard holds "
                f"{mine.tolist()}; gather a full state dict (gather_full_state_dict) and load that instead"
            )
        return
    total = module.global_num_experts
    full = [prefix + n for n in ("gate_up_proj", "down_proj") if prefix + n in state_dict]
    if full and all(state_dict[k].shape[0] == total for k in full) and total != module.num_experts:
        index = mine.to(device=state_dict[full[0]].device)
        for k in full:
            state_dict[k] = state_dict[k].index_select(0, index)
        state_dict[ids_key] = mine.clone()


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
    ) -> None:
        super().__init__()
        validate_config(config)
        self.gemm_engine = check_choice(gemm_engine)
        if backend not in ("auto", "torch", "triton"):
            raise ValueError(f"backend must be 'auto', 'torch' or 'triton', got {backend!r}")
        if dispatch not in DISPATCH_MODES:
            raise ValueError(f"dispatch must be one of {DISPATCH_MODES}, got {dispatch!r}")
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
        self.ep_rank, self.ep_size = _ep_position(ep_group)
        local_ids = expert_range(config.num_experts, self.ep_size, self.ep_rank)
        self.num_local_experts = len(local_ids)
        self.expert_start = local_ids.start
        self.gate = make_router(config)
        self.experts = Experts(self.num_local_experts, config.hidden_size, config.intermediate_size)
        if ep_group is not None:
            self.experts.global_num_experts = config.num_experts
            self.experts.register_buffer(
                EXPERT_IDS_NAME, torch.arange(local_ids.start, local_ids.stop, dtype=torch.int64)
            )
            self.experts.register_load_state_dict_pre_hook(_slice_full_experts)
        self.reset_parameters(getattr(config, "initializer_range", 0.02))

    def reset_parameters(self, std: float = 0.02) -> None:
        with torch.no_grad():
            for p in (self.gate.weight, self.experts.gate_up_proj, self.experts.down_proj):
                p.normal_(0.0, std)

    def extra_repr(self) -> str:
        text = (
            f"hidden={self.hidden_size}, intermediate={self.intermediate_size}, experts={self.num_experts}, "
            f"top_k={self.top_k}, backend={self.backend!r}, gemm_engine={self.gemm_engine!r}, forced_uniform_routing={self.forced_uniform_routing}"
        )
        if self.ep_group is not None:
            text += (
                f", ep_rank={self.ep_rank}/{self.ep_size}, local_experts=[{self.expert_start}, "
                f"{self.expert_start + self.num_local_experts}), dispatch={self.dispatch!r}"
            )
        return text

    # ---------------------------------------------------------------- construction from HF
    @classmethod
    def from_hf(
        cls,
        block: nn.Module,
        *,
        backend: str = "auto",
        forced_uniform_routing: bool = False,
        ep_group: dist.ProcessGroup | None = None,
        dispatch: str = "allgather",
        check_inputs: bool = True,
        gemm_engine: str = "auto",
    ) -> "FastSparseMoeBlock":
        """Build from a transformers ``OlmoeSparseMoeBlock`` (v5 merged or v4 per-expert layout),
        with the same weights. v5 parameters (and the router module itself) are shared, not copied;
        with ``ep_group`` the block copies only this rank's experts (the full tensors can then be freed)."""
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
            new = cls(
                cfg, backend=backend, forced_uniform_routing=forced_uniform_routing, ep_group=ep_group,
                dispatch=dispatch, check_inputs=check_inputs, gemm_engine=gemm_engine,
            )
        if hasattr(gate, "top_k") and not isinstance(gate, nn.Linear):
            new.gate = gate  # v5 router: keep the very module (and any hooks on it)
        else:
            new.gate = TopKRouter(cfg).to(device=gate.weight.device)
            new.gate.weight = gate.weight
        if ep_group is None:
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
        if self.ep_group is not None and self.ep_size > 1:
            return self._forward_expert_parallel(hidden_states)
        self._check_input(hidden_states)
        shape = hidden_states.shape
        x_TH = hidden_states.reshape(-1, self.hidden_size)
        _, weights_TK, idx_TK = self.route(x_TH)
        other = dispatch_experts_implementation(self.experts)
        if other is not None:  # the model was switched to another experts implementation
            return other(self.experts, x_TH, idx_TK, weights_TK).view(shape)
        backend = kernel_backend(self.backend, x_TH.device)
        out_TH = moe_experts_forward(
            x_TH.contiguous(), weights_TK, idx_TK, self.experts.gate_up_proj, self.experts.down_proj,
            backend=backend, expert_start=self.expert_start, gemm_engine=self.gemm_engine,
        )
        return out_TH.view(shape)

    def _forward_expert_parallel(self, hidden_states: torch.Tensor) -> torch.Tensor:
        if dispatch_experts_implementation(self.experts) is not None:
            raise ValueError(
                f"experts_implementation={self.experts.config._experts_implementation!r} cannot run on a "
                "FastSparseMoeBlock sharded over an expert-parallel group (its experts hold only this rank's "
                "slice); use 'fastmoe' or rebuild the model unsharded"
            )
        group = self.ep_group
        device = self.experts.gate_up_proj.device
        # Checks that come out the same on every rank raise at once; a check that may fail on one
        # rank only is shared through agree_on_inputs, so no rank is left waiting in a collective.
        check_group_device(group, device)
        backend = kernel_backend(self.backend, device)
        local_error: Exception | None = None
        try:
            self._check_input(hidden_states)
        except (TypeError, ValueError) as err:
            local_error = err
        num_tokens = hidden_states.numel() // self.hidden_size if local_error is None else -1
        # The agreement reads every rank's count on the host, which a graph cannot. Traced, allgather
        # compares the counts on the device instead (an assertion in the graph, no host read);
        # all-to-all needs no equal counts, only the offset of forced routing needs the others'.
        traced = torch.compiler.is_compiling() and (self.dispatch == "allgather" or not self.forced_uniform_routing)
        if traced:
            if local_error is not None:
                raise local_error
            if self.check_inputs and self.dispatch == "allgather":
                assert_same_tokens_on_device(group, num_tokens, device)
            sizes = [num_tokens] * self.ep_size
        elif self.check_inputs or self.dispatch == "alltoall":
            sizes = agree_on_inputs(group, num_tokens, local_error, device)
        elif local_error is not None:
            raise local_error
        else:
            sizes = [num_tokens] * self.ep_size
        # (Traced, the sizes are all this rank's symbolic count: comparing them would only add a guard.)
        if not traced and self.dispatch == "allgather" and len(set(sizes)) > 1:
            raise ValueError(
                f"allgather dispatch needs the same number of tokens on every EP rank, got {sizes} "
                "(batch*sequence per rank); pad the batches to one length or use dispatch='alltoall'"
            )
        shape = hidden_states.shape
        x_TH = hidden_states.reshape(-1, self.hidden_size).contiguous()
        _, weights_TK, idx_TK = self.route(x_TH, token_offset(sizes, group))

        def local_experts(x_NH: torch.Tensor, w_NK: torch.Tensor, idx_NK: torch.Tensor) -> torch.Tensor:
            return moe_experts_forward(
                x_NH, w_NK, idx_NK, self.experts.gate_up_proj, self.experts.down_proj,
                backend=backend, expert_start=self.expert_start, gemm_engine=self.gemm_engine, ep_group=group,
            )

        if self.dispatch == "allgather":
            out_TH = allgather_dispatch(x_TH, weights_TK, idx_TK, local_experts, group)
        else:
            out_TH = alltoall_dispatch(x_TH, weights_TK, idx_TK, local_experts, group, self.num_local_experts)
        return out_TH.view(shape)


def dispatch_experts_implementation(experts: Experts) -> Any:
    """The experts function of transformers' ``ExpertsInterface`` that ``experts.config`` selects
    when it selects anything but ``"fastmoe"`` (None: run our stages). ``"eager"`` is the per-expert
    loop of transformers' ``OlmoeExperts``, the class these experts stand in for."""
    name = getattr(getattr(experts, "config", None), "_experts_implementation", None)
    if name is None or name == "fastmoe":
        return None
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    if name == "eager":
        from transformers.models.olmoe.modeling_olmoe import OlmoeExperts

        return OlmoeExperts.forward.__wrapped__
    if name not in ALL_EXPERTS_FUNCTIONS:
        raise ValueError(f"experts_implementation={name!r} is not registered in transformers' ExpertsInterface")
    return ALL_EXPERTS_FUNCTIONS[name]


def _ep_position(ep_group: dist.ProcessGroup | None) -> tuple[int, int]:
    """``(rank, size)`` of this process in ``ep_group``; ``(0, 1)`` without one."""
    if ep_group is None:
        return 0, 1
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError("ep_group given but torch.distributed is not initialised (see fastmoe_xpu.dist.init_distributed)")
    rank = dist.get_rank(ep_group)
    if rank < 0:
        raise ValueError(
            f"this process (global rank {dist.get_rank()}) is not a member of ep_group "
            f"{dist.get_process_group_ranks(ep_group)}"
        )
    return rank, dist.get_world_size(ep_group)
