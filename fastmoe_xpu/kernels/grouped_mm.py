"""Stage 4 on PyTorch's own grouped GEMM (``torch.nn.functional.grouped_mm`` / ``torch._grouped_mm``).

The ``grouped_mm`` engine of :mod:`fastmoe_xpu.kernels.registry`: the four GEMM launchers of the
contract (``gate_up_fwd``, ``down_fwd``, ``down_bwd``, ``gate_up_bwd``) as grouped GEMMs over the
merged expert weights, with the gather (``index_select``) and SiLU*up in plain torch around them.
``silu_mul_bwd`` and stages 2, 3 and 5 stay with the kernel backend the engine is combined with.

What PyTorch provides (read from torch 2.13's ``nn/functional.py``, ``_meta_registrations.py`` and
measured on the CPU): ``offs`` are int32 *cumulative ends* of the groups, so ``cum_token_counts[1:]``
is exactly the argument; rows past ``offs[-1]`` are ignored on input and unspecified on output,
which is this contract's rule for rows past RT; a 2-D x 2-D call with ``offs`` groups the
contraction dimension (weight gradients; empty groups give zeros); float32, bfloat16 and float16
run on the CPU, CUDA's fast path is bfloat16 on sm_90+. Every operand stride that is not the unit
one must be a multiple of 16 bytes: awkward widths (H=33) are copied into padded storage first,
which real model widths never need. Whether a device and dtype work is probed once with a tiny call
(:func:`unsupported_reason`), so the answer follows the installed torch instead of a version table.

Legend: T tokens, H hidden, I intermediate, NR local experts, R rows allocated (>= RT routed rows).
"""
from __future__ import annotations

import functools

import torch

from .contract import check_gemm_inputs, check_stored_gemm_inputs
from .torch import rounding

_ALIGN_BYTES = 16


def _op():
    fn = getattr(torch.nn.functional, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)
    if fn is None:
        raise RuntimeError(f"torch {torch.__version__} has no grouped_mm (needs torch >= 2.8)")
    return fn


@functools.lru_cache(maxsize=None)
def _probe(device_type: str, device_index: int | None, dtype: torch.dtype) -> str | None:
    if getattr(torch.nn.functional, "grouped_mm", None) is None and getattr(torch, "_grouped_mm", None) is None:
        return f"torch {torch.__version__} has no grouped_mm"
    dev = torch.device(device_type, device_index) if device_index is not None else torch.device(device_type)
    try:
        a = torch.arange(32 * 8, device=dev).reshape(32, 8).to(dtype) / 64
        w = torch.ones(2, 16, 8, device=dev, dtype=dtype)
        offs = torch.tensor([16, 32], dtype=torch.int32, device=dev)
        out = _op()(a, w.transpose(-2, -1), offs=offs)
        want = (a.float() @ w[0].float().t())
        if not torch.allclose(out.float(), want, rtol=1e-2, atol=1e-2):
            return f"grouped_mm gives wrong results for {dtype} on {dev}"
    except Exception as exc:  # an unsupported device/dtype raises; any reason means "not here"
        return f"grouped_mm does not run for {dtype} on {dev}: {str(exc).splitlines()[0][:200]}"
    return None


def unsupported_reason(device: torch.device | str, dtype: torch.dtype) -> str | None:
    """None when grouped_mm runs for ``dtype`` on ``device`` with this torch; else why not."""
    dev = torch.device(device)
    if dev.type == "meta":
        return "grouped_mm is not probed on the meta device"
    return _probe(dev.type, dev.index, dtype)


def _aligned_as_is(t: torch.Tensor) -> bool:
    align = max(1, _ALIGN_BYTES // t.element_size())
    s_row, s_col = t.stride(-2), t.stride(-1)
    if t.data_ptr() % _ALIGN_BYTES:
        return False
    return ((s_col == 1 and s_row % align == 0 and s_row >= t.shape[-1])
            or (s_row == 1 and s_col % align == 0 and s_col >= t.shape[-2]))


def _aligned(t: torch.Tensor) -> torch.Tensor:
    """``t`` itself when its strides suit grouped_mm (one unit stride, the other a multiple of 16
    bytes, a 16-byte-aligned start); else a copy with the same values in padded storage."""
    if _aligned_as_is(t):
        return t
    align = max(1, _ALIGN_BYTES // t.element_size())
    s_row, s_col = t.stride(-2), t.stride(-1)
    # Pad the contiguous dimension of the copy: transposed views (the weights read as W^T) stay
    # column-major, so the copy keeps the memory order grouped_mm prefers for them.
    col_major = s_row == 1 and s_col != 1
    src = t.transpose(-2, -1) if col_major else t
    width = src.shape[-1]
    padded = -(-max(width, 1) // align) * align
    buf = src.new_empty((*src.shape[:-1], padded))[..., :width]
    buf.copy_(src)
    return buf.transpose(-2, -1) if col_major else buf


def aligned(t: torch.Tensor) -> bool:
    """Whether grouped_mm takes ``t`` as it is (:func:`_aligned` would return it unchanged)."""
    return _aligned_as_is(t)


def grouped_mm_op():  # noqa: ANN201
    """``torch.nn.functional.grouped_mm`` (or ``torch._grouped_mm`` before it was public): differentiable."""
    return _op()


def _gmm(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    out = _op()(_aligned(a), _aligned(b), offs=offs)
    # CUDA pads the output's row stride for unaligned widths; the contract's row buffers are contiguous.
    return out if out.is_contiguous() else out.contiguous()


def _ends(cum_token_counts: torch.Tensor) -> torch.Tensor:
    """grouped_mm's ``offs``: the cumulative group ends, ``cum_token_counts[1:]`` (int32)."""
    return cum_token_counts[1:]


def _gather_rows(x_TH: torch.Tensor, input_indices: torch.Tensor, cum_token_counts: torch.Tensor) -> torch.Tensor:
    """``x[input_indices]``; rows past RT (whose indices are unspecified on the Triton backend) read
    token 0 instead, decided on the device so that nothing synchronises."""
    R = input_indices.shape[0]
    if R == 0 or x_TH.shape[0] == 0:
        return x_TH.new_zeros(R, x_TH.shape[1])
    if input_indices.device.type == "cpu" and R <= int(cum_token_counts[-1]):
        # Every row is routed (the torch backend sizes rows exactly; a host read is free on the
        # CPU): no mask, three ops fewer, about 4 us of a 45 us gate_up_fwd at T=48 H=64 E=8 K=2.
        return x_TH.index_select(0, input_indices)
    valid = torch.arange(R, device=input_indices.device, dtype=input_indices.dtype) < cum_token_counts[-1]
    safe = torch.where(valid, input_indices, torch.zeros((), dtype=input_indices.dtype, device=input_indices.device))
    return x_TH.index_select(0, safe)


def gate_up_fwd(x_TH: torch.Tensor, input_indices: torch.Tensor, cum_token_counts: torch.Tensor,
                w_gate_up_N2IH: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``gate_up [R, 2I] = x[input_indices] @ w_gate_up[e]^T`` per expert group (one grouped GEMM)
    and ``h [R, I] = silu(gate) * up``; rows past RT unspecified."""
    check_gemm_inputs(x_TH, w_gate_up_N2IH, cum_token_counts, "gate_up_fwd")
    inter = w_gate_up_N2IH.shape[1] // 2
    rows_RH = _gather_rows(x_TH, input_indices, cum_token_counts)
    gate_up_R2I = _gmm(rows_RH, w_gate_up_N2IH.transpose(-2, -1), _ends(cum_token_counts))
    h_RI = torch._C._nn.silu(gate_up_R2I[:, :inter]).mul_(gate_up_R2I[:, inter:])
    return gate_up_R2I, h_RI


def down_fwd(
    h_RI: torch.Tensor, cum_token_counts: torch.Tensor, w_down_NHI: torch.Tensor, transposed: bool = False
) -> torch.Tensor:
    """``y [R, H] = h @ w_down[e]^T`` per expert group; ``transposed`` (``w_down`` stored
    ``[NR, I, H]``): ``y = h @ w_down[e]``, the weight passed to grouped_mm as stored."""
    check_stored_gemm_inputs(h_RI, w_down_NHI, cum_token_counts, "down_fwd", transposed)
    return _gmm(h_RI, w_down_NHI if transposed else w_down_NHI.transpose(-2, -1), _ends(cum_token_counts))


def down_bwd(
    dy_RH: torch.Tensor, h_RI: torch.Tensor, cum_token_counts: torch.Tensor, w_down_NHI: torch.Tensor,
    transposed: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``dh [R, I] = dy @ w_down[e]`` and ``dw_down [NR, H, I] = dy_e^T @ h_e`` (zero for empty experts);
    ``transposed`` (stored ``[NR, I, H]``): ``dh = dy @ w_down[e]^T``, ``dw_down [NR, I, H] = h_e^T @ dy_e``."""
    check_stored_gemm_inputs(dy_RH, w_down_NHI, cum_token_counts, "down_bwd", not transposed)
    offs = _ends(cum_token_counts)
    if transposed:
        return _gmm(dy_RH, w_down_NHI.transpose(-2, -1), offs), _gmm(h_RI.t(), dy_RH, offs)
    dh_RI = _gmm(dy_RH, w_down_NHI, offs)
    dw_NHI = _gmm(dy_RH.t(), h_RI, offs)
    return dh_RI, dw_NHI


def down_weighted_bwd(dy_RH: torch.Tensor, gate_up_R2I: torch.Tensor, row_weights_R: torch.Tensor,
                      cum_token_counts: torch.Tensor,
                      w_down_NHI: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The weighted down backward of the contract on this engine's GEMMs: ``down_bwd(dy, w * h)``
    gives the unweighted ``dy @ W_e`` and ``dW = dy^T (w * h)``; ``h = silu(gate) * up`` is
    recomputed from ``gate_up`` as a temporary, the row dot products and scaling run in fp32."""
    R, inter = dy_RH.shape[0], w_down_NHI.shape[2]
    gate, up = gate_up_R2I[:R, :inter].float(), gate_up_R2I[:R, inter:].float()
    h = torch._C._nn.silu(gate).mul_(up)
    w = row_weights_R[:R, None]
    g_RI, dw_NHI = down_bwd(dy_RH, (h * w).to(dy_RH.dtype), cum_token_counts, w_down_NHI)
    d_row_weights_R = torch.linalg.vecdot(g_RI.float(), h)
    if g_RI.dtype == torch.float32:  # scaled in place: g is this call's own fresh output
        return g_RI.mul_(w), dw_NHI, d_row_weights_R
    return (g_RI.float() * w).to(dy_RH.dtype), dw_NHI, d_row_weights_R


def gate_up_bwd(d_gate_up_R2I: torch.Tensor, x_TH: torch.Tensor, input_indices: torch.Tensor,
                cum_token_counts: torch.Tensor, w_gate_up_N2IH: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``dx_rows [R, H] = d_gate_up @ w_gate_up[e]`` and ``dw_gate_up [NR, 2I, H] = d_e^T @ x[rows_e]``
    (the input rows gathered again, as the other engines do: they are never saved)."""
    check_gemm_inputs(x_TH, w_gate_up_N2IH, cum_token_counts, "gate_up_bwd")
    offs = _ends(cum_token_counts)
    if d_gate_up_R2I.shape[0] > input_indices.shape[0]:
        raise ValueError(f"gate_up_bwd: d_gate_up has {d_gate_up_R2I.shape[0]} rows but only "
                         f"{input_indices.shape[0]} input indices")
    rows_RH = _gather_rows(x_TH, input_indices[: d_gate_up_R2I.shape[0]], cum_token_counts)
    dx_rows_RH = _gmm(d_gate_up_R2I, w_gate_up_N2IH, offs)
    dw_N2IH = _gmm(d_gate_up_R2I.t(), rows_RH, offs)
    return dx_rows_RH, dw_N2IH


#: The launchers this engine provides (the rest of stage 4 comes from the kernel backend).
LAUNCHERS = ("gate_up_fwd", "down_fwd", "down_bwd", "down_weighted_bwd", "gate_up_bwd")


# ---------------------------------------------------------------- a small layer in one piece
#: Whether ``moe_experts_forward`` runs a small layer that ``auto`` gives this engine untimed in one
#: piece (:func:`small_layer`) where it can; False: the staged chain on this engine's launchers.
ONE_PIECE = True
#: Below this many columns an elementwise pass over a column slice of ``[R, 2I]`` runs row by row in
#: ATen; :class:`_SmallLayer` copies gate (and up) out first there, as the torch base's
#: ``silu_mul_bwd`` does (``kernels/torch/grouped_gemm.py``, ``SHORT_ROWS``).
_SHORT_ROWS = 64


def _gate(gate_up_R2I: torch.Tensor, inter: int) -> torch.Tensor:
    gate = gate_up_R2I[:, :inter]
    return gate.contiguous() if inter < _SHORT_ROWS else gate


def _bag_sums(y_RH: torch.Tensor, row_of_slot: torch.Tensor, bags: torch.Tensor) -> torch.Tensor:
    """``out[t] = sum of y[row_of_slot[i]]`` over token t's slots ``[bags[t], bags[t+1])`` (aten's
    ``embedding_bag``, mode sum, the last offset included)."""
    return torch.embedding_bag(y_RH, row_of_slot, bags, False, 0, False, None, True)[0]


#: Per (slots, K, device): ``arange(0, slots + 1, K)``, the token bags' offsets (read only).
_BAGS: dict[tuple[int, int, torch.device], torch.Tensor] = {}


def _bags(n: int, k: int, device: torch.device) -> torch.Tensor:
    key = (n, k, device)
    bags = _BAGS.get(key)
    if bags is None:
        if len(_BAGS) >= 1024:  # one entry per token count seen: bounded for long generations
            _BAGS.clear()
        bags = _BAGS[key] = torch.arange(0, n + 1, k, device=device)
    return bags


def _expert_order(topk_idx_TK: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``(order [T*K], offs [NR])`` of the slots sorted by expert (row r holds slot ``order[r] = t*K +
    k``; ``offs``: int32 group ends), or None where an id is outside ``[0, NR)``: ``bincount``
    refuses a negative id and gives an id past the last expert a bin of its own, so the check costs
    no op of its own (an ``aminmax`` and its reads were a twentieth of a small decode call)."""
    flat = topk_idx_TK.reshape(-1)
    try:
        counts = torch.bincount(flat, minlength=num_experts)
    except RuntimeError:  # a negative id
        return None
    if counts.shape[0] != num_experts:
        return None
    return torch.argsort(flat, stable=True), counts.cumsum(0, dtype=torch.int32)


def _ordered(topk_idx_TK: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`_expert_order` of ids the caller found local."""
    layout = _expert_order(topk_idx_TK, num_experts)
    if layout is None:
        raise ValueError(f"top_k_index holds ids outside [0, {num_experts})")
    return layout


def _small_forward(x_TH: torch.Tensor, w_gate_up_N2IH: torch.Tensor, w_down_NHI: torch.Tensor,
                   weights_TK: torch.Tensor, topk_idx_TK: torch.Tensor,
                   layout: tuple[torch.Tensor, torch.Tensor] | None = None) -> tuple[torch.Tensor, tuple]:
    """:class:`_SmallLayer`'s forward: ``(out [T, H], what its backward keeps)``; ``layout``: the ids'
    :func:`_expert_order`, if found already."""
    K = topk_idx_TK.shape[1]
    inter = w_down_NHI.shape[2]
    order_R, offs = layout if layout is not None else _ordered(topk_idx_TK, w_gate_up_N2IH.shape[0])
    token_R = order_R if K == 1 else order_R.div(K, rounding_mode="floor")
    rows_RH = x_TH.index_select(0, token_R)
    gate_up_R2I = _gmm(rows_RH, w_gate_up_N2IH.transpose(-2, -1), offs)
    h_RI = torch._C._nn.silu(_gate(gate_up_R2I, inter)).mul_(gate_up_R2I[:, inter:])
    w_R1 = weights_TK.reshape(-1).index_select(0, order_R).unsqueeze(1)
    y_RH = _gmm(h_RI * w_R1, w_down_NHI.transpose(-2, -1), offs)
    # Each token's K rows summed in slot order by one embedding_bag (a bag per token over the rows
    # of its slots): half the time of zeros + index_add_ at 512 rows of 128.
    row_of_slot = torch.argsort(order_R)  # the inverse permutation, one op (a small layer's step is a few dozen)
    bags = _bags(order_R.numel(), K, order_R.device)
    out_TH = _bag_sums(y_RH, row_of_slot, bags)
    return out_TH, (rows_RH, w_gate_up_N2IH, w_down_NHI, token_R, row_of_slot, bags, offs, gate_up_R2I, h_RI, w_R1)


class _SmallLayer(torch.autograd.Function):
    """Stages 2-5 of a small fused fp32 layer whose ids are all local: the rows sorted by expert
    (one stable ``argsort``, one ``bincount`` for the group ends), one grouped GEMM per projection
    and direction, the routing weight applied to ``h`` (``[R, I]``, narrower than the ``[R, H]``
    output at every family's shape), each token's rows summed by one ``embedding_bag``. Its backward is
    written out: the weights' gradients from the saved gathered rows and ``h``, the router weights'
    as the row dot products ``<dy @ W_down[e], h>``. Fewer ops than the staged chain
    (``fastmoe::route`` and ``fastmoe::mlp_combine``) it replaces at these sizes, and none of the op
    and engine-choice layers around them (docs/small_shapes.md); the same numbers up to the order of
    fp32 sums."""

    @staticmethod
    def forward(ctx, x_TH, w_gate_up_N2IH, w_down_NHI, weights_TK, topk_idx_TK):  # noqa: ANN001, ANN205
        out_TH, saved = _small_forward(x_TH, w_gate_up_N2IH, w_down_NHI, weights_TK, topk_idx_TK)
        ctx.save_for_backward(*saved)
        ctx.tokens = x_TH.shape[0]
        return out_TH

    @staticmethod
    def backward(ctx, dout_TH):  # noqa: ANN001, ANN205
        (rows_RH, w_gate_up_N2IH, w_down_NHI, token_R, row_of_slot, bags, offs, gate_up_R2I, h_RI,
         w_R1) = ctx.saved_tensors
        need_x, need_gu, need_d, need_w = ctx.needs_input_grad[:4]
        inter = h_RI.shape[1]
        dy_RH = dout_TH.index_select(0, token_R)
        dw_down = _gmm(dy_RH.t(), h_RI * w_R1, offs) if need_d else None
        g_RI = _gmm(dy_RH, w_down_NHI, offs)  # d(h * w) / w: unweighted, its dot with h is the weight's gradient
        dweights_TK = None
        if need_w:
            d_w_R = torch.linalg.vecdot(g_RI, h_RI)
            dweights_TK = d_w_R.index_select(0, row_of_slot).view(ctx.tokens, -1)
        dx_TH = dw_gate_up = None
        if need_x or need_gu:
            dh_RI = g_RI.mul_(w_R1)
            gate = _gate(gate_up_R2I, inter)
            up = gate_up_R2I[:, inter:]
            if inter < _SHORT_ROWS:
                up = up.contiguous()
            d_gate_up_R2I = torch.cat([torch.ops.aten.silu_backward(dh_RI * up, gate),
                                       torch._C._nn.silu(gate).mul_(dh_RI)], 1)
            if need_gu:
                dw_gate_up = _gmm(d_gate_up_R2I.t(), rows_RH, offs)
            if need_x:
                dx_rows_RH = _gmm(d_gate_up_R2I, w_gate_up_N2IH, offs)
                dx_TH = _bag_sums(dx_rows_RH, row_of_slot, bags)
        return dx_TH, dw_gate_up, dw_down, dweights_TK, None


def small_layer_runs(x_TH: torch.Tensor, w_gate_up_N2IH: torch.Tensor, w_down_NHI: torch.Tensor,
                     weights_TK: torch.Tensor) -> bool:
    """Whether :func:`small_layer` takes these tensors: fp32 on the CPU, plain tensors (no subclass,
    no dispatch mode: a traced program keeps the staged chain's ops), at least one row."""
    return x_TH.dtype == torch.float32 and small_inference_runs(x_TH, w_gate_up_N2IH, w_down_NHI, weights_TK)


def small_inference_runs(x_TH: torch.Tensor, w_gate_up_N2IH: torch.Tensor, w_down_NHI: torch.Tensor,
                         weights_TK: torch.Tensor) -> bool:
    """Whether :func:`small_inference` takes these tensors: :func:`small_layer_runs`' (fp32), or bf16 /
    fp16 activations and expert weights of one dtype on the CPU with floating router weights, plain
    tensors, at least one row. (One expression: asked on every call without grad of a small layer.)"""
    dtype = x_TH.dtype
    plain = _PLAIN
    return (x_TH.is_cpu and w_gate_up_N2IH.dtype == dtype and w_down_NHI.dtype == dtype
            and (weights_TK.dtype == dtype if dtype == torch.float32
                 else (dtype == torch.bfloat16 or dtype == torch.float16) and weights_TK.is_floating_point())
            and weights_TK.numel() > 0 and type(x_TH) in plain and type(w_gate_up_N2IH) in plain
            and type(w_down_NHI) in plain and type(weights_TK) in plain and not torch._C._len_torch_dispatch_stack())


_PLAIN = (torch.Tensor, torch.nn.Parameter)


def _small_forward_rounded(x_TH: torch.Tensor, w_gate_up_N2IH: torch.Tensor, w_down_NHI: torch.Tensor,
                           weights_TK: torch.Tensor, topk_idx_TK: torch.Tensor,
                           layout: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """``[T, H]`` of a bf16/fp16 layer that no backward follows, rounded at each step as transformers'
    experts round (``kernels/torch/rounding.py``): the rows sorted by expert, one grouped GEMM per
    projection, SiLU and its product with up in the weights' dtype, the routing-weight product in the
    promoted dtype, each token's K rows summed and rounded once."""
    T, K = topk_idx_TK.shape
    order_R, offs = layout if layout is not None else _ordered(topk_idx_TK, w_gate_up_N2IH.shape[0])
    token_R = order_R if K == 1 else order_R.div(K, rounding_mode="floor")
    gate_up_R2I = _gmm(x_TH.index_select(0, token_R), w_gate_up_N2IH.transpose(-2, -1), offs)
    y_RH = _gmm(rounding.silu_mul(gate_up_R2I, True), w_down_NHI.transpose(-2, -1), offs)
    y_TKH = y_RH.index_select(0, torch.argsort(order_R)).view(T, K, -1)
    return rounding.weighted_sum(y_TKH, weights_TK)


def small_inference(x_TH: torch.Tensor, w_gate_up_N2IH: torch.Tensor, w_down_NHI: torch.Tensor,
                    weights_TK: torch.Tensor, topk_idx_TK: torch.Tensor) -> torch.Tensor | None:
    """``[T, H]``: :func:`small_layer`'s forward for a call no backward follows, for
    :func:`small_inference_runs` tensors (bf16/fp16 rounded as transformers' experts round); None,
    having computed nothing else, where an id is outside ``[0, NR)`` (the caller's staged chain then
    checks and reports them)."""
    layout = _expert_order(topk_idx_TK, w_gate_up_N2IH.shape[0])
    if layout is None:
        return None
    if x_TH.dtype == torch.float32:
        return _small_forward(x_TH, w_gate_up_N2IH, w_down_NHI, weights_TK, topk_idx_TK, layout)[0]
    return _small_forward_rounded(x_TH, w_gate_up_N2IH, w_down_NHI, weights_TK, topk_idx_TK, layout)


def small_layer(x_TH: torch.Tensor, w_gate_up_N2IH: torch.Tensor, w_down_NHI: torch.Tensor,
                weights_TK: torch.Tensor, topk_idx_TK: torch.Tensor) -> torch.Tensor:
    """``[T, H]``: the fused layer (gate/up GEMM, SiLU*up, down GEMM, weighted sum of each token's
    rows) over ``w_gate_up [NR, 2I, H]`` and ``w_down [NR, H, I]`` as one autograd node
    (:class:`_SmallLayer`). Every id in ``topk_idx`` must name one of the NR experts (the caller
    checks); for :func:`small_layer_runs` tensors."""
    if not torch.is_grad_enabled() or not any(t.requires_grad for t in (x_TH, w_gate_up_N2IH, w_down_NHI, weights_TK)):
        # No backward follows (generation, evaluation): the forward alone, without the Function around it.
        return _small_forward(x_TH, w_gate_up_N2IH, w_down_NHI, weights_TK, topk_idx_TK)[0]
    return _SmallLayer.apply(x_TH, w_gate_up_N2IH, w_down_NHI, weights_TK, topk_idx_TK)
