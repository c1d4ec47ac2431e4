"""Stage 5 in plain PyTorch: weighted row sums as one sparse-CSR product or ``embedding_bag``.

Legend: T tokens, H hidden, I intermediate, K experts per token, NR local experts, TH token blocks,
RT routed rows on this rank (sum of the local experts' token counts), R >= RT rows allocated.
"""
from __future__ import annotations

import warnings

import torch

from ... import settings
from .buffers import cached_empty, piece_rows
from .rounding import per_step_told, weighted_sum


def _slot_tokens(cum_expert_counts: torch.Tensor) -> torch.Tensor:
    T = cum_expert_counts.numel() - 1
    counts = (cum_expert_counts[1:] - cum_expert_counts[:-1]).to(torch.int64)
    return torch.repeat_interleave(torch.arange(T, device=cum_expert_counts.device), counts)


#: Dtypes whose weighted row sums run as a sparse CSR x dense product into a cached buffer
#: (MKL's sparse BLAS on x86); others use ``embedding_bag``, which allocates its output.
_CSR_DTYPES = (torch.float32, torch.float64)
#: Without MKL (or with ``FASTMOE_CPU_CSR=0``, ``settings.cpu_csr``) every dtype stays on ``embedding_bag``.
_MKL = torch.backends.mkl.is_available()


def _csr_row_sums(y_RH: torch.Tensor, crow: torch.Tensor, col: torch.Tensor, values: torch.Tensor,
                  T: int) -> torch.Tensor:
    """``out [T, H]``, ``out[t] = sum over i in [crow[t], crow[t+1]) of values[i] * y[col[i]]``.

    ``torch.addmm(out, S, y, beta=0, out=out)`` with ``S`` the ``[T, R]`` CSR matrix of the slots:
    one pass over ``y``, written into a buffer from the cache. At the EP slices' [T, H] outputs
    (hundreds of MB, most tokens without a local row), a fresh output cost more in page faults
    than the sums themselves.
    """
    out = cached_empty((T, y_RH.shape[1]), y_RH)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "sparse CSR support is in beta state"
        S = torch.sparse_csr_tensor(crow, col, values, size=(T, y_RH.shape[0]), check_invariants=False)
    return torch.addmm(out, S, y_RH, beta=0, out=out)


#: Largest ``[T, H]`` output (bytes) that :func:`combine_fwd` sums with ``embedding_bag``, which
#: allocates its output; bigger ones take the CSR product into a pooled buffer, which spares the page
#: faults of a fresh mapping (glibc maps allocations over 32 MiB anew on every call). Measured
#: (launcher, fp32, two threads, K=8 of E=64, H=2048, every slot local), weighted bag / CSR, us:
#: T=1 10.0 / 13.8, T=8 12.3 / 18.7, T=64 40.5 / 66.5, T=256 141 / 254, T=1024 1490 / 2650,
#: T=2048 3080 / 13200; tiny (T=48 H=64 K=2) 10.7 / 13.1: the bag wins at every size up to 16 MiB.
_BAG_MAX_BYTES = 32 << 20


def _use_csr(y_RH: torch.Tensor) -> bool:
    return y_RH.device.type == "cpu" and y_RH.dtype in _CSR_DTYPES and _MKL and settings.get().cpu_csr


def combine_fwd(y_RH: torch.Tensor, weights_TK: torch.Tensor | None, output_indices: torch.Tensor,
                selected_expert_indices: torch.Tensor, cum_expert_counts: torch.Tensor) -> torch.Tensor:
    """``out[t] = sum over slots i of t of weights[t, sel[i]] * y[output_indices[i]]`` (``[T, H]``);
    ``weights_TK=None`` sums unweighted (the input gradient's reduction).

    The slots of token t are ``[cum_expert_counts[t], cum_expert_counts[t+1])``: one ``embedding_bag``
    with those prefix sums as its offsets (a bag per token, the weights as per-sample weights), or,
    for a ``[T, H]`` output over :data:`_BAG_MAX_BYTES` in fp32/fp64 on the CPU, a CSR matrix (rows:
    tokens, columns: rows of ``y``, values: routing weights) times ``y`` into a pooled buffer
    (:func:`_csr_row_sums`). Either way the rows are read once, with no gathered copy.
    """
    T = cum_expert_counts.numel() - 1
    H = y_RH.shape[1]
    n_slots = int(cum_expert_counts[-1]) if T else 0
    if n_slots == 0:
        return y_RH.new_zeros(T, H)
    out_idx = output_indices[:n_slots]
    slot_w = None
    if weights_TK is not None and n_slots == weights_TK.numel() and per_step_told(y_RH):
        # no backward follows: each product and the sum over K rounded as transformers rounds them
        return weighted_sum(y_RH.index_select(0, out_idx).view(T, weights_TK.shape[1], H), weights_TK)
    if weights_TK is not None:
        if n_slots == weights_TK.numel():  # every token has K local slots: slot i is entry i of [T, K]
            slot_w = weights_TK.reshape(-1).to(y_RH.dtype)
        else:
            flat = _slot_flat(weights_TK, selected_expert_indices, cum_expert_counts, n_slots)
            slot_w = weights_TK.reshape(-1)[flat].to(y_RH.dtype)
    if _use_csr(y_RH) and T * H * y_RH.element_size() > _BAG_MAX_BYTES:
        if slot_w is None:
            slot_w = torch.ones(n_slots, dtype=y_RH.dtype, device=y_RH.device)
        return _csr_row_sums(y_RH, cum_expert_counts.to(out_idx.dtype), out_idx, slot_w.contiguous(), T)
    offsets = cum_expert_counts.to(out_idx.dtype)
    # aten's embedding_bag (not F.embedding_bag, whose argument checks cost as much as the sums at
    # small T): mode 0 is "sum"; include_last_offset, so the T+1 prefix sums are the offsets as they are.
    return torch.embedding_bag(y_RH, out_idx, offsets, False, 0, False, slot_w, True)[0]


def _slot_flat(weights_TK: torch.Tensor, selected_expert_indices: torch.Tensor, cum_expert_counts: torch.Tensor,
               n_slots: int) -> torch.Tensor:
    """``t*K + k`` of every slot: where its weight sits in ``weights_TK``."""
    K = weights_TK.shape[1]
    return _slot_tokens(cum_expert_counts) * K + selected_expert_indices[:n_slots].to(torch.int64)


def combine_bwd(dout_TH: torch.Tensor, weights_TK: torch.Tensor, output_indices: torch.Tensor,
                selected_expert_indices: torch.Tensor,
                cum_expert_counts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``dy[row] = dout[t]`` (unweighted) and ``row_weights[row] = weights[t, k]`` (fp32) for each
    slot (t, k, row): the weights and the indices are all this needs, the expert outputs are not
    kept. The weight is applied by ``down_bwd``, where the router-weight gradient is formed.

    One gather of ``dout`` in row order (each row's token through the inverse of
    ``output_indices``) into a cached buffer.
    """
    T, K = weights_TK.shape
    H = dout_TH.shape[1]
    n_slots = int(cum_expert_counts[-1]) if T else 0
    dy_RH = cached_empty((n_slots, H), dout_TH)
    row_w = torch.empty(n_slots, dtype=torch.float32, device=dout_TH.device)
    if n_slots == 0:
        return dy_RH, row_w
    if n_slots == weights_TK.numel():
        # Every token has K local slots: slot i is entry i of [T, K], no slot -> (t, k) search.
        out_idx = output_indices[:n_slots]
        slot_of_row = torch.empty(n_slots, dtype=torch.int64, device=dout_TH.device)
        slot_of_row.index_put_((out_idx,), torch.arange(n_slots, device=dout_TH.device))
        row_w.index_put_((out_idx,), weights_TK.reshape(-1).float())
        torch.index_select(dout_TH, 0, slot_of_row.div_(K, rounding_mode="floor"), out=dy_RH)
        return dy_RH, row_w
    out_idx = output_indices[:n_slots].to(torch.int64)
    flat = _slot_flat(weights_TK, selected_expert_indices, cum_expert_counts, n_slots)
    token_of_row = torch.empty_like(flat)
    token_of_row[out_idx] = flat // K
    row_w[out_idx] = weights_TK.reshape(-1)[flat].float()
    torch.index_select(dout_TH, 0, token_of_row, out=dy_RH)
    return dy_RH, row_w


def router_weights_bwd(d_row_weights_R: torch.Tensor, weights_TK: torch.Tensor, output_indices: torch.Tensor,
                       selected_expert_indices: torch.Tensor, cum_expert_counts: torch.Tensor) -> torch.Tensor:
    """``dweights[t, k] = d_row_weights[row]`` for each slot (t, k, row); zero for non-local choices."""
    T = weights_TK.shape[0]
    n_slots = int(cum_expert_counts[-1]) if T else 0
    if n_slots and n_slots == weights_TK.numel():  # every token has K local slots: slot i is entry i
        rows = d_row_weights_R.index_select(0, output_indices[:n_slots])
        return rows.to(weights_TK.dtype).view(weights_TK.shape)
    dweights_TK = torch.zeros(weights_TK.shape, dtype=weights_TK.dtype, device=weights_TK.device)
    if n_slots == 0:
        return dweights_TK
    flat = _slot_flat(weights_TK, selected_expert_indices, cum_expert_counts, n_slots)
    rows = d_row_weights_R[output_indices[:n_slots].to(torch.int64)]
    dweights_TK.view(-1)[flat] = rows.to(weights_TK.dtype)
    return dweights_TK
