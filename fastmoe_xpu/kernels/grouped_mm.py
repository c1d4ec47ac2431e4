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


def _aligned(t: torch.Tensor) -> torch.Tensor:
    """``t`` itself when its strides suit grouped_mm (one unit stride, the other a multiple of 16
    bytes, a 16-byte-aligned start); else a copy with the same values in padded storage."""
    align = max(1, _ALIGN_BYTES // t.element_size())
    s_row, s_col = t.stride(-2), t.stride(-1)
    ok_ptr = t.data_ptr() % _ALIGN_BYTES == 0
    if ok_ptr and s_col == 1 and s_row % align == 0 and s_row >= t.shape[-1]:
        return t
    if ok_ptr and s_row == 1 and s_col % align == 0 and s_col >= t.shape[-2]:
        return t
    # Pad the contiguous dimension of the copy: transposed views (the weights read as W^T) stay
    # column-major, so the copy keeps the memory order grouped_mm prefers for them.
    col_major = s_row == 1 and s_col != 1
    src = t.transpose(-2, -1) if col_major else t
    width = src.shape[-1]
    padded = -(-max(width, 1) // align) * align
    buf = src.new_empty((*src.shape[:-1], padded))[..., :width]
    buf.copy_(src)
    return buf.transpose(-2, -1) if col_major else buf


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
