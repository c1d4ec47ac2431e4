"""The launcher contract of stages 2-5: what both kernel backends provide, and their shared checks.

:class:`KernelBackend` lists every launcher with its signature; ``kernels/triton`` (xpu, cuda, the CPU
under ``TRITON_INTERPRET=1``) and ``kernels/torch`` (the CPU) implement it, and
``tests/kernels/test_contract.py`` checks that both do with the same parameter names.

Metadata is :data:`INDEX_DTYPE`. Row buffers have ``R >= RT`` rows, RT = ``cum_token_counts[-1]``;
rows past RT are unspecified and never read: the torch backend sizes them exactly (a host read is
free on the CPU), the Triton backend for the worst case (R = T*K) so that nothing synchronises.

Raise, never assert, on bad input: asserts vanish under ``python -O``.

Legend: T tokens, H hidden, I intermediate, K experts per token, NR local experts, TH token blocks,
RT routed rows on this rank, R >= RT rows allocated.
"""
from __future__ import annotations

from typing import NamedTuple, Protocol

import torch

#: dtype of every metadata tensor (counts, prefix sums, row and slot indices).
INDEX_DTYPE = torch.int32
#: Token block size of the counting stage (TBS in the paper): tokens per block of the per-block counts.
TOKEN_BLOCK_SIZE = 8
#: Activation and weight dtypes the Triton kernels accept.
FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


class TokenCounts(NamedTuple):
    """Stage 2's counts and prefix sums, all :data:`INDEX_DTYPE`."""

    partial_token_counts: torch.Tensor
    """``[NR*TH]``: tokens of token block b routed to local expert e, at ``e*TH + b``."""
    partial_cum_token_counts: torch.Tensor
    """``[NR*TH+1]``: exclusive prefix sum of ``partial_token_counts`` (where each block's rows start)."""
    expert_counts: torch.Tensor
    """``[T]``: how many of token t's K experts are local."""
    cum_expert_counts: torch.Tensor
    """``[T+1]``: exclusive prefix sum of ``expert_counts`` (token t's slots)."""
    cum_token_counts: torch.Tensor
    """``[NR+1]``: where each local expert's rows start; the last entry is RT."""


class RowIndices(NamedTuple):
    """Stage 3's indices, ``[R]`` each, :data:`INDEX_DTYPE`."""

    input_indices: torch.Tensor
    """row -> the token whose hidden state it holds (rows grouped by local expert, tokens in order)."""
    output_indices: torch.Tensor
    """slot -> row (slots token-major, k order within a token)."""
    selected_expert_indices: torch.Tensor
    """slot -> k, the position of that expert in the token's top-k."""


class KernelBackend(Protocol):
    """The launchers of stages 2-5 (``fastmoe_xpu.kernels.get_ops`` returns one backend as this type)."""

    NAME: str

    def count_tokens(
        self, topk_idx_TK: torch.Tensor, expert_start: int, num_local: int, block_size: int = 8
    ) -> TokenCounts:
        """Stage 2: per-block counts of the local experts ``[expert_start, expert_start + num_local)``."""
        ...

    def build_indices(
        self, topk_idx_TK: torch.Tensor, partial_cum_token_counts: torch.Tensor, cum_expert_counts: torch.Tensor,
        expert_start: int, num_local: int, block_size: int = 8,
    ) -> RowIndices:
        """Stage 3: rows and slots of every local (token, k) choice."""
        ...

    def gate_up_fwd(
        self, x_TH: torch.Tensor, input_indices: torch.Tensor, cum_token_counts: torch.Tensor,
        w_gate_up_N2IH: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Stage 4: ``(gate_up [R, 2I], h [R, I])``, the gathered gate/up GEMM and SiLU*up."""
        ...

    def down_fwd(
        self, h_RI: torch.Tensor, cum_token_counts: torch.Tensor, w_down_NHI: torch.Tensor, transposed: bool = False
    ) -> torch.Tensor:
        """Stage 4: ``y [R, H] = h @ w_down[e]^T`` per expert group. ``transposed``: the weight is
        stored ``[NR, I, H]`` (transformers' ``is_transposed`` layout) and ``y = h @ w_down[e]``,
        read in place: no transposed copy of the weight is made."""
        ...

    def down_bwd(
        self, dy_RH: torch.Tensor, h_RI: torch.Tensor, cum_token_counts: torch.Tensor, w_down_NHI: torch.Tensor,
        transposed: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Stage 4 backward of a plain grouped GEMM: ``(dh [R, I], dw_down [NR, H, I])``; with
        ``transposed`` (weight stored ``[NR, I, H]``) the weight gradient comes in that stored
        layout, ``[NR, I, H]``, so it lands on the parameter without a copy."""
        ...

    def down_weighted_bwd(
        self, dy_RH: torch.Tensor, gate_up_R2I: torch.Tensor, row_weights_R: torch.Tensor,
        cum_token_counts: torch.Tensor, w_down_NHI: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Stage 4 backward of the weighted down GEMM ``w_r * (h_r @ w_down[e]^T)``, with ``dy`` the
        unweighted row gradients (``combine_bwd``'s) and ``h = silu(gate) * up`` recomputed from
        ``gate_up`` (never stored): ``(dh [R, I] = w_r * dy_r @ w_down[e], dw_down [NR, H, I] =
        sum_r w_r dy_r^T h_r, d_row_weights [R] fp32 = <dy_r @ w_down[e], h_r>)``; the last is the
        router-weight gradient ``<dout_t, y_r>`` formed without the expert outputs ``y``."""
        ...

    def silu_mul_bwd(
        self, gate_up_R2I: torch.Tensor, dh_RI: torch.Tensor, cum_token_counts: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Stage 4 backward: the gradient of SiLU*up, ``[R, 2I]``; pass ``cum_token_counts`` as training does."""
        ...

    def gate_up_bwd(
        self, d_gate_up_R2I: torch.Tensor, x_TH: torch.Tensor, input_indices: torch.Tensor,
        cum_token_counts: torch.Tensor, w_gate_up_N2IH: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Stage 4 backward: ``(dx_rows [R, H], dw_gate_up [NR, 2I, H])``."""
        ...

    def combine_fwd(
        self, y_RH: torch.Tensor, weights_TK: torch.Tensor | None, output_indices: torch.Tensor,
        selected_expert_indices: torch.Tensor, cum_expert_counts: torch.Tensor,
    ) -> torch.Tensor:
        """Stage 5: ``[T, H]``, the weighted (``weights_TK=None``: plain) sum of each token's rows."""
        ...

    def combine_bwd(
        self, dout_TH: torch.Tensor, weights_TK: torch.Tensor, output_indices: torch.Tensor,
        selected_expert_indices: torch.Tensor, cum_expert_counts: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Stage 5 backward, from the weights and the indices alone (no expert outputs): ``(dy [R, H],
        row_weights [R] fp32)``, each routed row's token gradient ``dout[t]`` (unweighted: the weight
        is applied in ``down_bwd``, which also forms the router-weight gradient) and its weight."""
        ...

    def router_weights_bwd(
        self, d_row_weights_R: torch.Tensor, weights_TK: torch.Tensor, output_indices: torch.Tensor,
        selected_expert_indices: torch.Tensor, cum_expert_counts: torch.Tensor,
    ) -> torch.Tensor:
        """Stage 5 backward: ``dweights [T, K]`` (weights' dtype), ``dweights[t, k] = d_row_weights[row]``
        for each local slot (t, k, row), zero for choices of experts elsewhere."""
        ...


#: The launcher names of :class:`KernelBackend`, in data-path order.
LAUNCHERS = (
    "count_tokens", "build_indices", "gate_up_fwd", "down_fwd", "down_bwd", "down_weighted_bwd", "silu_mul_bwd",
    "gate_up_bwd",
    "combine_fwd", "combine_bwd", "router_weights_bwd",
)
#: Launchers a kernel set may add to fuse work its required launchers would do in several passes;
#: callers look them up and otherwise compose the required ones. ``down_fwd_lora(h, cum_token_counts,
#: w_down, t, lora_b, transposed=False)``: :meth:`KernelBackend.down_fwd` plus a LoRA adapter's
#: ``t @ lora_b[e]^T`` (``t [R, r]``, ``lora_b [NR, out, r]``) in the same kernel (the Triton backend).
#: ``down_silu_bwd(dout, weights, output_indices, selected_expert_indices, cum_expert_counts, input_indices,
#: gate_up, cum_token_counts, w_down)``: ``combine_bwd``, ``down_weighted_bwd`` and ``silu_mul_bwd`` as one
#: launcher giving ``(d_gate_up [R, 2I], dw_down [NR, H, I], d_row_weights [R] fp32)``, the output
#: gradient's rows read in the GEMM loads (``dout[input_indices[r]]``, no ``[R, H]`` copy) and the SiLU*up
#: gradient formed in the router-weight pass (the Triton engine). A kernel set takes a fused launcher
#: from its stage-4 engine only: it runs that engine's GEMMs.
#: ``gate_up_down_fwd(x, input_indices, cum_token_counts, w_gate_up, w_down)``: ``gate_up_fwd`` then ``down_fwd``
#: as one launcher giving ``(gate_up [R, 2I], y [R, H])``, for a kernel set that can feed the down GEMM
#: without writing ``h`` (fp8 next to the Triton base: ``h``'s codes made from ``gate_up``).
FUSED_LAUNCHERS = ("down_fwd_lora", "down_silu_bwd", "gate_up_down_fwd")
#: The launchers of stage 4, which a grouped-GEMM engine may provide (``kernels/registry.py``).
STAGE4_LAUNCHERS = ("gate_up_fwd", "down_fwd", "down_bwd", "down_weighted_bwd", "silu_mul_bwd", "gate_up_bwd")


# ---------------------------------------------------------------- shared input checks
def num_blocks(num_tokens: int, block_size: int) -> int:
    return (num_tokens + block_size - 1) // block_size


def check_count_inputs(topk_idx_TK: torch.Tensor, expert_start: int, num_local: int, block_size: int) -> None:
    if not isinstance(topk_idx_TK, torch.Tensor) or topk_idx_TK.dim() != 2:
        raise ValueError(f"topk_idx must be a [T, K] tensor, got {getattr(topk_idx_TK, 'shape', type(topk_idx_TK))}")
    if topk_idx_TK.dtype.is_floating_point or topk_idx_TK.dtype == torch.bool:
        raise TypeError(f"topk_idx must be an integer tensor, got {topk_idx_TK.dtype}")
    if num_local < 1:
        raise ValueError(f"num_local must be >= 1, got {num_local}")
    if expert_start < 0:
        raise ValueError(f"expert_start must be >= 0, got {expert_start}")
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")


def check_gemm_inputs(a: torch.Tensor, w: torch.Tensor, cum_token_counts: torch.Tensor, op: str) -> None:
    if a.dim() != 2 or w.dim() != 3:
        raise ValueError(f"{op}: expected a 2-D activation and 3-D weights, got {tuple(a.shape)} and {tuple(w.shape)}")
    if a.shape[1] != w.shape[2]:
        raise ValueError(f"{op}: activation width {a.shape[1]} does not match weight shape {tuple(w.shape)}")
    if a.dtype != w.dtype:
        raise TypeError(f"{op}: activation dtype {a.dtype} differs from weight dtype {w.dtype}")
    if a.device != w.device:
        raise ValueError(f"{op}: activation on {a.device} but weights on {w.device}")
    if cum_token_counts.numel() != w.shape[0] + 1:
        raise ValueError(
            f"{op}: cum_token_counts has {cum_token_counts.numel()} entries, expected {w.shape[0] + 1} "
            f"(one more than the {w.shape[0]} local experts)"
        )


def check_stored_gemm_inputs(
    a: torch.Tensor, w: torch.Tensor, cum_token_counts: torch.Tensor, op: str, transposed: bool
) -> None:
    """:func:`check_gemm_inputs` for a weight read as ``[NR, out, in]`` (``transposed=False``) or
    stored ``[NR, in, out]`` (``transposed=True``; checked through a view, nothing is copied)."""
    if not isinstance(transposed, bool):
        raise TypeError(f"{op}: transposed must be a bool, got {transposed!r}")
    check_gemm_inputs(a, w.transpose(-2, -1) if transposed and w.dim() == 3 else w, cum_token_counts, op)


def check_float(op: str, device: torch.device | None, **tensors: torch.Tensor) -> None:
    """Each tensor is a contiguous :data:`FLOAT_DTYPES` tensor on ``device`` (None: the first one's)."""
    for name, t in tensors.items():
        if t.dtype not in FLOAT_DTYPES:
            raise TypeError(f"{op}: {name} must be float32, bfloat16 or float16, got {t.dtype}")
        if device is None:
            device = t.device
        elif t.device != device:
            raise ValueError(f"{op}: {name} on {t.device}, expected {device}")
        if not t.is_contiguous():
            raise ValueError(f"{op}: {name} {tuple(t.shape)} must be contiguous")


def check_index(op: str, device: torch.device, **tensors: torch.Tensor) -> None:
    """Each tensor is a contiguous 1-D :data:`INDEX_DTYPE` tensor on ``device``."""
    for name, t in tensors.items():
        if t.dim() != 1:
            raise ValueError(f"{op}: {name} must be 1-D, got shape {tuple(t.shape)}")
        if t.dtype != INDEX_DTYPE:
            raise TypeError(f"{op}: {name} must be int32, got {t.dtype}")
        if t.device != device:
            raise ValueError(f"{op}: {name} on {t.device}, expected {device}")
        if not t.is_contiguous():
            raise ValueError(f"{op}: {name} must be contiguous")
