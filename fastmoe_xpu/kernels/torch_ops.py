"""Plain-PyTorch launchers of stages 2-5: the CPU backend.

Every function here has the same name and signature as its Triton counterpart in
``fastmoe_xpu.kernels`` (see ``kernels/__init__.py`` for the contract). The CPU pays nothing for a
device-to-host read, so this backend sizes its outputs exactly (RT routed rows) where the Triton
backend allocates the worst case (T*K rows) and leaves rows past RT unspecified.

Written for the CPU's memory system: each pass over routed rows happens once, a piece of rows at a
time while it is in cache (gather + GEMM + SiLU*up together, the elementwise backward in pieces,
the reductions as one sparse-CSR product or ``embedding_bag``); big buffers come from a cache that keeps them mapped
between training steps (:class:`_CpuBufferCache`); weight gradients are never zero-filled.

Legend: T tokens, H hidden, I intermediate, K experts per token, NR local experts, TH token blocks,
RT routed rows on this rank (sum of the local experts' token counts), R >= RT rows allocated.
"""
from __future__ import annotations

import math
import os
import threading
import warnings

import torch
import torch.nn.functional as F

from ._contract import check_count_inputs, check_gemm_inputs, num_blocks

NAME = "torch"
INDEX_DTYPE = torch.int32


# ---------------------------------------------------------------- stage 2: token counting
def count_tokens(
    topk_idx_TK: torch.Tensor, expert_start: int, num_local: int, block_size: int = 8
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Returns ``(partial_token_counts [NR*TH], partial_cum_token_counts [NR*TH+1],
    expert_counts [T], cum_expert_counts [T+1], cum_token_counts [NR+1])``, all int32."""
    check_count_inputs(topk_idx_TK, expert_start, num_local, block_size)
    T, K = topk_idx_TK.shape
    TH = num_blocks(T, block_size)
    dev = topk_idx_TK.device
    local_TK = topk_idx_TK.to(torch.int64) - expert_start
    is_local_TK = (local_TK >= 0) & (local_TK < num_local)
    expert_counts_T = is_local_TK.sum(1, dtype=torch.int32)
    block_TK = (torch.arange(T, device=dev) // block_size)[:, None].expand(T, K)
    keys = (local_TK * TH + block_TK)[is_local_TK]
    partial = torch.bincount(keys, minlength=num_local * TH).to(INDEX_DTYPE)
    zero = torch.zeros(1, dtype=INDEX_DTYPE, device=dev)
    partial_cum = torch.cat([zero, partial.cumsum(0, dtype=INDEX_DTYPE)])
    cum_expert = torch.cat([zero, expert_counts_T.cumsum(0, dtype=INDEX_DTYPE)])
    cum_token = partial_cum[torch.arange(num_local + 1, device=dev) * TH]
    return partial, partial_cum, expert_counts_T, cum_expert, cum_token


# ---------------------------------------------------------------- stage 3: index generation
def build_indices(
    topk_idx_TK: torch.Tensor,
    partial_cum_token_counts: torch.Tensor,
    cum_expert_counts: torch.Tensor,
    expert_start: int,
    num_local: int,
    block_size: int = 8,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Returns ``(input_indices [R], output_indices [R], selected_expert_indices [R])``, int32.

    Rows are grouped by local expert, tokens in order within an expert (a stable sort by expert
    gives exactly the block-wise layout of the counting stage, since blocks are contiguous runs
    of tokens). Slots are token-major, k order within a token.
    """
    check_count_inputs(topk_idx_TK, expert_start, num_local, block_size)
    T, K = topk_idx_TK.shape
    dev = topk_idx_TK.device
    local = topk_idx_TK.reshape(-1).to(torch.int64) - expert_start
    is_local = (local >= 0) & (local < num_local)
    # Non-local entries sort after every local expert.
    key = torch.where(is_local, local, torch.full_like(local, num_local))
    order = torch.sort(key, stable=True).indices
    rt = int(is_local.sum())
    input_indices = (order[:rt] // K).to(INDEX_DTYPE)
    row_of_entry = torch.empty_like(order)
    row_of_entry[order] = torch.arange(order.numel(), device=dev)
    output_indices = row_of_entry[is_local].to(INDEX_DTYPE)
    selected = (torch.arange(T * K, device=dev) % K)[is_local].to(INDEX_DTYPE)
    return input_indices, output_indices, selected


# ---------------------------------------------------------------- buffers
class _CpuBufferCache:
    """Keeps the big CPU buffers of stages 4-5 mapped between calls.

    glibc serves every allocation over 32 MiB with a fresh ``mmap`` and unmaps it at free, so each
    training step would fault the layer's row buffers and weight gradients in again page by page,
    each page zeroed by the kernel: that costs more than a full pass over the memory. Like the CUDA
    caching allocator, this cache hands a storage out again once nothing but the cache refers to it
    (storage use count 1), so a storage is never shared with a live tensor. Storages are grouped in
    size classes (8 per power of two); idle storages beyond ``FASTMOE_CPU_CACHE_IDLE_MB`` (default
    4096) are released. ``FASTMOE_CPU_CACHE=0`` turns the cache off; :func:`release_cached_buffers`
    empties it.
    """

    MIN_BYTES = 1 << 20  # smaller blocks come from glibc's heap, which recycles them already

    def __init__(self) -> None:
        # The use count is what makes reuse safe; without it (an older torch) nothing is cached.
        self.enabled = hasattr(torch._C, "_storage_Use_Count") and os.environ.get(
            "FASTMOE_CPU_CACHE", "1").strip().lower() not in ("0", "false", "off")
        self.max_idle = int(float(os.environ.get("FASTMOE_CPU_CACHE_IDLE_MB", "4096")) * 2**20)
        self.pool: dict[int, list[torch.UntypedStorage]] = {}
        self.lock = threading.Lock()

    @staticmethod
    def _size_class(nbytes: int) -> int:
        step = max(1 << 16, 1 << max(0, nbytes.bit_length() - 4))
        return -(-nbytes // step) * step

    @staticmethod
    def _idle(st: torch.UntypedStorage) -> bool:
        return torch._C._storage_Use_Count(st._cdata) == 1

    def empty(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        numel = math.prod(shape)
        nbytes = numel * dtype.itemsize
        if not self.enabled or device.type != "cpu" or nbytes < self.MIN_BYTES:
            return torch.empty(shape, dtype=dtype, device=device)
        cls = self._size_class(nbytes)
        with self.lock:
            storage = next((st for st in self.pool.get(cls, ()) if self._idle(st)), None)
            if storage is None:
                self._trim(keep=cls)
                storage = torch.empty(cls, dtype=torch.uint8, device=device).untyped_storage()
                self.pool.setdefault(cls, []).append(storage)
        return torch.empty(0, dtype=dtype, device=device).set_(storage, 0, shape)

    def _trim(self, keep: int) -> None:
        idle = [(c, st) for c, sts in self.pool.items() for st in sts if self._idle(st)]
        total = sum(c for c, _ in idle)
        for c, st in sorted(idle, key=lambda cs: cs[0] == keep):
            if total <= self.max_idle:
                break
            self.pool[c].remove(st)
            total -= c

    def clear(self) -> None:
        with self.lock:
            self.pool.clear()


_CACHE = _CpuBufferCache()


def release_cached_buffers() -> None:
    """Return the torch backend's cached CPU buffers to the allocator (see :class:`_CpuBufferCache`)."""
    _CACHE.clear()


def _empty(shape: tuple[int, ...], like: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    return _CACHE.empty(tuple(shape), dtype or like.dtype, like.device)


# ---------------------------------------------------------------- stage 4: grouped GEMMs
def _bounds(cum_token_counts: torch.Tensor) -> list[int]:
    return cum_token_counts.tolist()


def _groups(bounds: list[int]) -> list[tuple[int, int, int]]:
    """``(expert, first row, end row)`` of every local expert, empty ones included."""
    return [(e, bounds[e], bounds[e + 1]) for e in range(len(bounds) - 1)]


#: Bytes of the widest operand of one piece of a gather or elementwise pass. A piece stays in the
#: last-level cache between the op that writes it and the ops that read it, and pieces are few:
#: every op is a parallel region, and on a loaded machine each one can cost a scheduler time slice.
_PIECE_BYTES = int(os.environ.get("FASTMOE_CPU_PIECE_MB", "4")) << 20


def _piece_rows(width: int) -> int:
    return max(8, _PIECE_BYTES // (4 * max(1, width)))


def _expert_pieces(bounds: list[int], min_rows: int) -> list[list[tuple[int, int, int]]]:
    """Consecutive experts grouped into pieces of at least ``min_rows`` rows (the last may be short)."""
    pieces: list[list[tuple[int, int, int]]] = [[]]
    rows = 0
    for g in _groups(bounds):
        if rows >= min_rows:
            pieces.append([])
            rows = 0
        pieces[-1].append(g)
        rows += g[2] - g[1]
    return pieces


def _silu_mul(gate_up_R2I: torch.Tensor, out_RI: torch.Tensor) -> None:
    inter = out_RI.shape[1]
    torch._C._nn.silu(gate_up_R2I[:, :inter], out=out_RI)
    out_RI.mul_(gate_up_R2I[:, inter:])


def gate_up_fwd(
    x_TH: torch.Tensor,
    input_indices: torch.Tensor,
    cum_token_counts: torch.Tensor,
    w_gate_up_N2IH: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``gate_up [R, 2I] = x[input_indices] @ w_gate_up[e]^T`` per expert group, and
    ``h [R, I] = silu(gate) * up``.

    A piece of consecutive experts at a time: their rows are gathered into a cached buffer, each
    expert's GEMM reads its part, and SiLU*up runs on the piece's fresh GEMM output, so the gathered
    ``[R, H]`` input never exists whole and ``gate_up`` is not read back from memory.
    """
    check_gemm_inputs(x_TH, w_gate_up_N2IH, cum_token_counts, "gate_up_fwd")
    bounds = _bounds(cum_token_counts)
    rt = bounds[-1]
    two_i = w_gate_up_N2IH.shape[1]
    gate_up_R2I = _empty((rt, two_i), x_TH)
    h_RI = _empty((rt, two_i // 2), x_TH)
    pieces = _expert_pieces(bounds, _piece_rows(x_TH.shape[1]))
    buf = _empty((max(p[-1][2] - p[0][1] for p in pieces), x_TH.shape[1]), x_TH)
    for piece in pieces:
        p0, p1 = piece[0][1], piece[-1][2]
        if p1 == p0:
            continue
        rows = torch.index_select(x_TH, 0, input_indices[p0:p1], out=buf[: p1 - p0])
        for e, s, t in piece:
            if t > s:
                torch.mm(rows[s - p0:t - p0], w_gate_up_N2IH[e].t(), out=gate_up_R2I[s:t])
        _silu_mul(gate_up_R2I[p0:p1], h_RI[p0:p1])
    return gate_up_R2I, h_RI


def down_fwd(h_RI: torch.Tensor, cum_token_counts: torch.Tensor, w_down_NHI: torch.Tensor) -> torch.Tensor:
    """``y [R, H] = h @ w_down[e]^T`` per expert group."""
    check_gemm_inputs(h_RI, w_down_NHI, cum_token_counts, "down_fwd")
    bounds = _bounds(cum_token_counts)
    y_RH = _empty((bounds[-1], w_down_NHI.shape[1]), h_RI)
    for e, s, t in _groups(bounds):
        if t > s:
            torch.mm(h_RI[s:t], w_down_NHI[e].t(), out=y_RH[s:t])
    return y_RH


def down_bwd(
    dy_RH: torch.Tensor, h_RI: torch.Tensor, cum_token_counts: torch.Tensor, w_down_NHI: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``dh [R, I] = dy @ w_down[e]`` and ``dw_down [NR, H, I] = dy_e^T @ h_e`` (zero for empty experts)."""
    bounds = _bounds(cum_token_counts)
    dh_RI = _empty((bounds[-1], w_down_NHI.shape[2]), dy_RH)
    dw_NHI = _empty(w_down_NHI.shape, w_down_NHI)
    for e, s, t in _groups(bounds):
        if t == s:
            dw_NHI[e].zero_()
            continue
        torch.mm(dy_RH[s:t], w_down_NHI[e], out=dh_RI[s:t])
        torch.mm(dy_RH[s:t].t(), h_RI[s:t], out=dw_NHI[e])
    return dh_RI, dw_NHI


def silu_mul_bwd(
    gate_up_R2I: torch.Tensor, dh_RI: torch.Tensor, cum_token_counts: torch.Tensor | None = None
) -> torch.Tensor:
    """Gradient of ``silu(gate) * up`` with respect to ``[gate, up]``: ``[R, 2I]``. This backend's
    row buffers hold exactly the RT routed rows, so ``cum_token_counts`` changes nothing here.

    ``d_gate = silu'(gate) * (dh * up)`` (ATen's fused ``silu_backward``), ``d_up = dh * silu(gate)``:
    four passes, a piece of rows at a time so that they hit the cache; bf16 is computed in fp32.
    """
    rt, inter = dh_RI.shape
    out_R2I = _empty((rt, 2 * inter), dh_RI)
    exact = dh_RI.dtype == torch.float32
    step = max(1, min(rt, _piece_rows(inter)))
    tmp_buf = _empty((step, inter), dh_RI, torch.float32)
    low_buf = None if exact else _empty((step, 2 * inter), dh_RI, torch.float32)
    for s in range(0, rt, step):
        t = min(rt, s + step)
        gate = gate_up_R2I[s:t, :inter].float()
        up = gate_up_R2I[s:t, inter:].float()
        dh = dh_RI[s:t].float()
        tmp = tmp_buf[: t - s]
        res = out_R2I[s:t] if exact else low_buf[: t - s]
        torch.mul(dh, up, out=tmp)
        torch.ops.aten.silu_backward.grad_input(tmp, gate, grad_input=res[:, :inter])
        torch._C._nn.silu(gate, out=tmp)
        torch.mul(tmp, dh, out=res[:, inter:])
        if not exact:
            out_R2I[s:t].copy_(res)
    return out_R2I


def gate_up_bwd(
    d_gate_up_R2I: torch.Tensor,
    x_TH: torch.Tensor,
    input_indices: torch.Tensor,
    cum_token_counts: torch.Tensor,
    w_gate_up_N2IH: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``dx_rows [R, H] = d_gate_up @ w_gate_up[e]`` and ``dw_gate_up [NR, 2I, H] = d_e^T @ x[rows_e]``;
    the expert's input rows are gathered again into a small cached buffer, never stored."""
    bounds = _bounds(cum_token_counts)
    dx_rows_RH = _empty((bounds[-1], x_TH.shape[1]), x_TH)
    dw_N2IH = _empty(w_gate_up_N2IH.shape, w_gate_up_N2IH)
    pieces = _expert_pieces(bounds, _piece_rows(x_TH.shape[1]))
    buf = _empty((max(p[-1][2] - p[0][1] for p in pieces), x_TH.shape[1]), x_TH)
    for piece in pieces:
        p0, p1 = piece[0][1], piece[-1][2]
        rows = torch.index_select(x_TH, 0, input_indices[p0:p1], out=buf[: p1 - p0]) if p1 > p0 else None
        for e, s, t in piece:
            if t == s:
                dw_N2IH[e].zero_()
                continue
            torch.mm(d_gate_up_R2I[s:t], w_gate_up_N2IH[e], out=dx_rows_RH[s:t])
            torch.mm(d_gate_up_R2I[s:t].t(), rows[s - p0:t - p0], out=dw_N2IH[e])
    return dx_rows_RH, dw_N2IH


# ---------------------------------------------------------------- stage 5: output reduction
def _slot_tokens(cum_expert_counts: torch.Tensor) -> torch.Tensor:
    T = cum_expert_counts.numel() - 1
    counts = (cum_expert_counts[1:] - cum_expert_counts[:-1]).to(torch.int64)
    return torch.repeat_interleave(torch.arange(T, device=cum_expert_counts.device), counts)


#: Dtypes whose weighted row sums run as a sparse CSR x dense product into a cached buffer
#: (MKL's sparse BLAS on x86); others use ``embedding_bag``, which allocates its output.
_CSR_DTYPES = (torch.float32, torch.float64)
#: ``FASTMOE_CPU_CSR=0`` (or a torch without MKL) keeps every dtype on ``embedding_bag``.
_CSR_ENABLED = torch.backends.mkl.is_available() and os.environ.get(
    "FASTMOE_CPU_CSR", "1").strip().lower() not in ("0", "false", "off")


def _csr_row_sums(y_RH: torch.Tensor, crow: torch.Tensor, col: torch.Tensor, values: torch.Tensor,
                  T: int) -> torch.Tensor:
    """``out [T, H]``, ``out[t] = sum over i in [crow[t], crow[t+1]) of values[i] * y[col[i]]``.

    ``torch.addmm(out, S, y, beta=0, out=out)`` with ``S`` the ``[T, R]`` CSR matrix of the slots:
    one pass over ``y``, written into a buffer from the cache. At the EP slices' [T, H] outputs
    (hundreds of MB, most tokens without a local row), a fresh output cost more in page faults
    than the sums themselves.
    """
    out = _empty((T, y_RH.shape[1]), y_RH)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "sparse CSR support is in beta state"
        S = torch.sparse_csr_tensor(crow, col, values, size=(T, y_RH.shape[0]), check_invariants=False)
    return torch.addmm(out, S, y_RH, beta=0, out=out)


def _use_csr(y_RH: torch.Tensor) -> bool:
    return y_RH.device.type == "cpu" and y_RH.dtype in _CSR_DTYPES and _CSR_ENABLED


def combine_fwd(
    y_RH: torch.Tensor,
    weights_TK: torch.Tensor | None,
    output_indices: torch.Tensor,
    selected_expert_indices: torch.Tensor,
    cum_expert_counts: torch.Tensor,
) -> torch.Tensor:
    """``out[t] = sum over slots i of t of weights[t, sel[i]] * y[output_indices[i]]`` (``[T, H]``);
    ``weights_TK=None`` sums unweighted (the input gradient's reduction).

    The slots of token t are ``[cum_expert_counts[t], cum_expert_counts[t+1])``: a CSR matrix
    (rows: tokens, columns: rows of ``y``, values: routing weights) times ``y`` for fp32/fp64 on
    the CPU (:func:`_csr_row_sums`), otherwise one ``embedding_bag`` (a bag per token, the weights
    as per-sample weights). Either way the rows are read once, with no gathered copy.
    """
    T = cum_expert_counts.numel() - 1
    H = y_RH.shape[1]
    n_slots = int(cum_expert_counts[-1]) if T else 0
    if n_slots == 0:
        return y_RH.new_zeros(T, H)
    out_idx = output_indices[:n_slots]
    K = weights_TK.shape[1] if weights_TK is not None else 0
    all_local = weights_TK is not None and n_slots == weights_TK.numel()
    slot_w = None
    if weights_TK is not None:
        if all_local:  # no expert parallelism: a fixed [T, K] layout, slots in k order
            slot_w = weights_TK.reshape(-1).to(y_RH.dtype)
        else:
            flat = _slot_tokens(cum_expert_counts) * K + selected_expert_indices[:n_slots].to(torch.int64)
            slot_w = weights_TK.reshape(-1)[flat].to(y_RH.dtype)
    if _use_csr(y_RH):
        if slot_w is None:
            slot_w = torch.ones(n_slots, dtype=y_RH.dtype, device=y_RH.device)
        return _csr_row_sums(y_RH, cum_expert_counts.to(out_idx.dtype), out_idx, slot_w.contiguous(), T)
    if all_local:
        return F.embedding_bag(out_idx.view(T, K), y_RH, mode="sum", per_sample_weights=slot_w.view(T, K))
    offsets = cum_expert_counts[:-1].to(out_idx.dtype)
    return F.embedding_bag(out_idx, y_RH, offsets, mode="sum", per_sample_weights=slot_w)


def combine_bwd(
    dout_TH: torch.Tensor,
    y_RH: torch.Tensor,
    weights_TK: torch.Tensor,
    output_indices: torch.Tensor,
    selected_expert_indices: torch.Tensor,
    cum_expert_counts: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``dy[row] = weights[t, k] * dout[t]`` and ``dweights[t, k] = dot(y[row], dout[t])`` for each
    slot (t, k, row); weights of non-local slots get zero gradient here.

    Walks the rows in order (each row's token and weight found through the inverse of
    ``output_indices``), a piece at a time: the piece's ``dout`` rows are gathered into cache once
    and serve both the dot products and the scaled copy into ``dy``.
    """
    T, K = weights_TK.shape
    H = dout_TH.shape[1]
    n_slots = int(cum_expert_counts[-1]) if T else 0
    dy_RH = _empty((y_RH.shape[0], H), dout_TH)
    dweights_TK = torch.zeros(T, K, dtype=weights_TK.dtype, device=weights_TK.device)
    if n_slots == 0:
        return dy_RH, dweights_TK
    out_idx = output_indices[:n_slots].to(torch.int64)
    flat = _slot_tokens(cum_expert_counts) * K + selected_expert_indices[:n_slots].to(torch.int64)
    token_of_row = torch.empty_like(flat)
    token_of_row[out_idx] = flat // K
    w_row = torch.empty(n_slots, dtype=torch.float32, device=dout_TH.device)
    w_row[out_idx] = weights_TK.reshape(-1)[flat].float()
    dw_row = torch.empty(n_slots, dtype=torch.float32, device=dout_TH.device)
    step = _piece_rows(H)
    buf = _empty((min(step, n_slots), H), dout_TH)
    exact = dout_TH.dtype == torch.float32 and y_RH.dtype == torch.float32
    for s in range(0, n_slots, step):
        t = min(n_slots, s + step)
        g = torch.index_select(dout_TH, 0, token_of_row[s:t], out=buf[: t - s])
        y = y_RH[s:t]
        if exact:
            torch.linalg.vecdot(y, g, out=dw_row[s:t])
            torch.mul(g, w_row[s:t, None], out=dy_RH[s:t])
        else:
            torch.linalg.vecdot(y.float(), g.float(), out=dw_row[s:t])
            dy_RH[s:t] = (g.float() * w_row[s:t, None]).to(dy_RH.dtype)
    dweights_TK.view(-1)[flat] = dw_row[out_idx].to(weights_TK.dtype)
    return dy_RH, dweights_TK
