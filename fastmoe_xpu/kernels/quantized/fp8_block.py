"""The ``fp8-block`` stage-4 implementation: block-scaled fp8 GEMMs that quantize inside their loads.

Next to the Triton base on GPUs with fp8 tensor cores (sm_89+) and under the interpreter. Every
expert GEMM is one Triton kernel of :mod:`..triton.fp8_block_gemm`; the scales follow DeepSeek-V3's
recipe (blocks of 128 along the contracted axis) and make the quantization part of the GEMMs:

* activations (x, h) and output gradients: per row and 128 columns, made from the tile the GEMM
  loads (x's rows gathered by token, h as SiLU*up of ``gate_up``, the output gradient's rows
  ``dout[input_indices[r]]`` gathered by token): no quantization pass, no codes in memory, no h;
* weights: per 128 x 128 block, quantized once per forward (one kernel) and found again by the
  backward; the same codes and scales serve the forward and the input-gradient GEMMs;
* the weight gradients' operands: per column and block of 128 rows of each expert, made in the
  weight-gradient kernel's loads (the down projection's ``w * h`` from ``gate_up``).

So an F+B runs the quantizer of each weight once and otherwise only GEMMs and the row passes of the
full-precision path (SiLU*up, the router-weight dots): where the per-channel ``fp8`` recipe reads
each operand to find its scale, writes its codes and reads them again, here each operand is read
once, by its GEMM, in its own dtype.

The maths, GEMM by GEMM, is :mod:`.block_reference`'s (the tests hold these launchers and the
layer to it). Accumulation is fp32 with each 128-block's partial product promoted; SiLU*up, its
backward and the router-weight products in fp32. Rows past RT are left unwritten (the contract's
"unspecified").
"""
from __future__ import annotations

import torch

from ..contract import check_gemm_inputs, check_stored_gemm_inputs
from .core import quantized_weight

FORMAT = "fp8-block"
#: The launchers this engine provides (the rest of stage 4 comes from the kernel base).
LAUNCHERS = ("gate_up_fwd", "down_fwd", "down_bwd", "down_weighted_bwd", "gate_up_bwd", "gate_up_down_fwd",
             "down_silu_bwd")
__all__ = ["FORMAT", "LAUNCHERS", "unsupported_reason", *LAUNCHERS]


def _k():  # noqa: ANN202
    from ..triton import fp8_block_gemm

    return fp8_block_gemm


def _rows():  # noqa: ANN202
    from ..triton import fp8_gemm

    return fp8_gemm


def unsupported_reason(device: torch.device | str, dtype: torch.dtype, base: str | None = None) -> str | None:
    """None when the recipe runs next to kernel base ``base`` on ``device``; else why not."""
    dev = torch.device(device)
    if base != "triton":
        return f"{FORMAT} runs next to the triton kernel base only, not {base!r}"
    if dev.type == "cuda" and torch.cuda.get_device_capability(dev) < (8, 9):
        return f"{FORMAT} needs fp8 tensor cores (sm_89 or newer), {torch.cuda.get_device_name(dev)} is sm_" + "".join(
            map(str, torch.cuda.get_device_capability(dev)))
    try:
        k = _k()
    except ImportError:
        return f"{FORMAT} needs triton"
    if not k.available(dev):
        return f"{FORMAT}'s Triton kernels have no configs for {dev.type} (they run on cuda sm_89+ and the interpreter)"
    return None


def _weight(w: torch.Tensor, transposed: bool, reuse: bool):  # noqa: ANN202
    """The weight's e4m3 codes (its stored layout) and 128 x 128 block scales, once per forward."""
    qb = _k().BLOCK
    return quantized_weight(w, torch.float8_e4m3fn, transposed, reuse=reuse,
                            quantize=lambda v, _dtype, _t: _k().quantize_weight_blocks(v, qb), recipe=f"block{qb}")


def gate_up_fwd(x_TH: torch.Tensor, input_indices: torch.Tensor, cum_token_counts: torch.Tensor,
                w_gate_up_N2IH: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``gate_up [R, 2I] = Q(x[input_indices]) @ Q(w_gate_up[e])^T`` per expert, ``h = silu(gate) * up``."""
    check_gemm_inputs(x_TH, w_gate_up_N2IH, cum_token_counts, "gate_up_fwd")
    R, two_i = input_indices.shape[0], w_gate_up_N2IH.shape[1]
    qw = _weight(w_gate_up_N2IH, False, False)
    gate_up, h = x_TH.new_empty(R, two_i), x_TH.new_empty(R, two_i // 2)
    if x_TH.shape[0] and R:
        k = _k()
        k.fp8b_grouped_mm(x_TH, input_indices, qw.codes, qw.scales, cum_token_counts, gate_up, trans_w=True,
                             a_mode="gather", qb=k.BLOCK)
        _rows().silu_mul(gate_up, cum_token_counts, h)
    return gate_up, h


def down_fwd(h_RI: torch.Tensor, cum_token_counts: torch.Tensor, w_down_NHI: torch.Tensor,
             transposed: bool = False) -> torch.Tensor:
    """``y [R, O] = Q(h) @ Q(w[e])^T`` per expert (``transposed``: ``w`` stored ``[NR, In, O]``)."""
    check_stored_gemm_inputs(h_RI, w_down_NHI, cum_token_counts, "down_fwd", transposed)
    qw = _weight(w_down_NHI, transposed, False)
    y = h_RI.new_empty(h_RI.shape[0], w_down_NHI.shape[2] if transposed else w_down_NHI.shape[1])
    k = _k()
    return k.fp8b_grouped_mm(h_RI, None, qw.codes, qw.scales, cum_token_counts, y, trans_w=not transposed, qb=k.BLOCK)


def gate_up_down_fwd(x_TH: torch.Tensor, input_indices: torch.Tensor, cum_token_counts: torch.Tensor,
                     w_gate_up_N2IH: torch.Tensor, w_down_NHI: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The fused forward (``contract.FUSED_LAUNCHERS``): ``(gate_up [R, 2I], y [R, H])`` with ``h`` never
    written: the down GEMM makes SiLU*up of each ``gate_up`` tile it loads (rounded to the activations'
    dtype, as ``h`` would be stored) and quantizes it there."""
    check_gemm_inputs(x_TH, w_gate_up_N2IH, cum_token_counts, "gate_up_fwd")
    check_stored_gemm_inputs(x_TH.new_empty(0, w_down_NHI.shape[2]), w_down_NHI, cum_token_counts, "down_fwd", False)
    R, two_i = input_indices.shape[0], w_gate_up_N2IH.shape[1]
    if two_i != 2 * w_down_NHI.shape[2]:
        raise ValueError(f"gate_up_down_fwd: gate_up_proj {tuple(w_gate_up_N2IH.shape)} and down_proj "
                         f"{tuple(w_down_NHI.shape)} disagree on I")
    qw_gu, qw_d = _weight(w_gate_up_N2IH, False, False), _weight(w_down_NHI, False, False)
    gate_up, y = x_TH.new_empty(R, two_i), x_TH.new_empty(R, w_down_NHI.shape[1])
    if x_TH.shape[0] == 0 or R == 0:
        return gate_up, y
    k = _k()
    k.fp8b_grouped_mm(x_TH, input_indices, qw_gu.codes, qw_gu.scales, cum_token_counts, gate_up, trans_w=True,
                      a_mode="gather", qb=k.BLOCK)
    k.fp8b_grouped_mm(gate_up, None, qw_d.codes, qw_d.scales, cum_token_counts, y, trans_w=True, a_mode="silu", qb=k.BLOCK)
    return gate_up, y


def down_bwd(dy_RH: torch.Tensor, h_RI: torch.Tensor, cum_token_counts: torch.Tensor, w_down_NHI: torch.Tensor,
             transposed: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """``(dh [R, In], dw)``: ``dh = Q(dy) @ Q(W)`` through the forward's codes and ``dw = Q(dy_e)^T @
    Q(h_e)`` over each expert's 128-row blocks, ``dw`` in ``w``'s stored layout."""
    check_stored_gemm_inputs(dy_RH, w_down_NHI, cum_token_counts, "down_bwd", not transposed)
    k = _k()
    qw = _weight(w_down_NHI, transposed, True)
    dh = dy_RH.new_empty(dy_RH.shape[0], w_down_NHI.shape[1] if transposed else w_down_NHI.shape[2])
    k.fp8b_grouped_mm(dy_RH, None, qw.codes, qw.scales, cum_token_counts, dh, trans_w=transposed, grad=True, qb=k.BLOCK)
    dw = torch.empty_like(w_down_NHI)
    if transposed:  # dW_e^T [In, O] = h_e^T dy_e
        k.fp8b_grouped_wgrad(h_RI, dy_RH, cum_token_counts, dw, left_grad=False, qb=k.BLOCK)
    else:
        k.fp8b_grouped_wgrad(dy_RH, h_RI, cum_token_counts, dw, qb=k.BLOCK)
    return dh, dw


def down_weighted_bwd(dy_RH: torch.Tensor, gate_up_R2I: torch.Tensor, row_weights_R: torch.Tensor,
                      cum_token_counts: torch.Tensor, w_down_NHI: torch.Tensor,
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The weighted down backward: ``g = Q(dy) @ Q(W)`` (unweighted, fp32), ``d_row_weights = <g, h>``,
    ``dh = w * g`` and ``dw_down = Q(dy_e)^T @ Q(w * h)_e``; ``h`` recomputed from ``gate_up`` in fp32."""
    check_stored_gemm_inputs(dy_RH, w_down_NHI, cum_token_counts, "down_weighted_bwd", True)
    k = _k()
    R, inter = dy_RH.shape[0], w_down_NHI.shape[2]
    qw = _weight(w_down_NHI, False, True)
    g = torch.empty(R, inter, dtype=torch.float32, device=dy_RH.device)
    k.fp8b_grouped_mm(dy_RH, None, qw.codes, qw.scales, cum_token_counts, g, trans_w=False, grad=True, qb=k.BLOCK)
    dw = torch.empty_like(w_down_NHI)
    k.fp8b_grouped_wgrad(dy_RH, gate_up_R2I, cum_token_counts, dw, right_silu_weights=row_weights_R, qb=k.BLOCK)
    dh = dy_RH.new_empty(R, inter)
    d_row_w = torch.empty(R, dtype=torch.float32, device=dy_RH.device)
    _rows().row_dot_scale(g, gate_up_R2I, row_weights_R, cum_token_counts, dh, d_row_w)
    return dh, dw, d_row_w


def down_silu_bwd(dout_TH: torch.Tensor, weights_TK: torch.Tensor, output_indices: torch.Tensor,
                  selected_expert_indices: torch.Tensor, cum_expert_counts: torch.Tensor, input_indices: torch.Tensor,
                  gate_up_R2I: torch.Tensor, cum_token_counts: torch.Tensor, w_down_NHI: torch.Tensor,
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The fused down backward (``contract.FUSED_LAUNCHERS``): ``(d_gate_up [R, 2I], dw_down, d_row_weights
    [R] fp32)``, what ``combine_bwd``, :func:`down_weighted_bwd` and ``silu_mul_bwd`` give in turn, with
    the output gradient's rows ``dout[input_indices[r]]`` read by index in both GEMMs' loads (no ``[R,
    H]`` copy) and the router-weight pass writing the SiLU*up gradient (no ``dh`` round trip)."""
    from ..triton import combine as tcombine

    k = _k()
    R, inter = input_indices.shape[0], w_down_NHI.shape[2]
    row_w = tcombine.row_weights(weights_TK, output_indices, selected_expert_indices, cum_expert_counts, R)
    qw = _weight(w_down_NHI, False, True)
    g = torch.empty(R, inter, dtype=torch.float32, device=dout_TH.device)
    k.fp8b_grouped_mm(dout_TH, input_indices, qw.codes, qw.scales, cum_token_counts, g, trans_w=False,
                      a_mode="gather", grad=True, qb=k.BLOCK)
    dw = torch.empty_like(w_down_NHI)
    k.fp8b_grouped_wgrad(dout_TH, gate_up_R2I, cum_token_counts, dw, left_idx=input_indices,
                         right_silu_weights=row_w, qb=k.BLOCK)
    d_gate_up = dout_TH.new_empty(R, 2 * inter)
    d_row_w = torch.empty(R, dtype=torch.float32, device=dout_TH.device)
    _rows().row_dot_scale(g, gate_up_R2I, row_w, cum_token_counts, d_gate_up, d_row_w, silu_bwd=True)
    return d_gate_up, dw, d_row_w


def gate_up_bwd(d_gate_up_R2I: torch.Tensor, x_TH: torch.Tensor, input_indices: torch.Tensor,
                cum_token_counts: torch.Tensor, w_gate_up_N2IH: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``dx_rows [R, H] = Q(d) @ Q(W)`` and ``dw_gate_up[e] = Q(d_e)^T @ Q(x[rows_e])`` (the token rows
    gathered in the weight-gradient kernel's loads)."""
    check_gemm_inputs(x_TH, w_gate_up_N2IH, cum_token_counts, "gate_up_bwd")
    k = _k()
    qw = _weight(w_gate_up_N2IH, False, True)
    dx_rows = x_TH.new_empty(d_gate_up_R2I.shape[0], x_TH.shape[1])
    k.fp8b_grouped_mm(d_gate_up_R2I, None, qw.codes, qw.scales, cum_token_counts, dx_rows, trans_w=False, grad=True, qb=k.BLOCK)
    dw = torch.empty_like(w_gate_up_N2IH)
    k.fp8b_grouped_wgrad(d_gate_up_R2I, x_TH, cum_token_counts, dw, right_idx=input_indices, qb=k.BLOCK)
    return dx_rows, dw
