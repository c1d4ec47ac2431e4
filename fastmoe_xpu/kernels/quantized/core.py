"""The quantized GEMM building blocks shared by the ``int8`` and ``fp8`` stage-4 implementations.

A *format* fixes how an operand is stored and multiplied:

=======  ======================  ======================  =========================================
format   forward operands        gradient operands       GEMM
=======  ======================  ======================  =========================================
int8     int8, scale amax/127    int8, scale amax/127    ``torch._int_mm`` (int32 accumulation),
                                                         dequantized by the two scale vectors
fp8      float8_e4m3fn, /448     float8_e5m2, /57344     ``torch._scaled_mm``, the scale vectors
                                                         applied in its epilogue (fp32 out)
=======  ======================  ======================  =========================================

Every GEMM ``C [M, N] = A [M, K] @ B [K, N]`` quantizes its two operands symmetrically with one
scale per row of ``A`` and one per column of ``B`` (scales along the dimensions that are not
contracted, so they factor out of the sum): ``C = sA[:, None] * sB[None, :] * (qA @ qB)``. A scale is
``amax / qmax`` of its row or column, computed on the device from the data (no host read); the codes
are ``round(v * (qmax / amax))`` (int8: to nearest even; fp8: the cast's rounding), so they never
leave ``[-qmax, qmax]`` and no clamp is needed; an all-zero row gets zero codes. Quantization happens
in fp32 whatever the tensor's dtype.

Weights are quantized per output channel once per forward (:func:`quantized_weight`; once for as
long as they are unchanged inside :func:`frozen_weights`) and the backward of the same call finds
them again by object and version instead of quantizing a second time: the input gradient of
``y = x Wq^T`` is ``dy Wq = (dy * sW) qW``, so ``dy * sW`` is quantized per row and multiplied by the
same int8 weight codes (straight-through: the rounding itself is treated as identity, as AQT does).
"""
from __future__ import annotations

import contextlib
import functools
import threading
import weakref
from typing import NamedTuple

import torch

from ..configs import QUANTIZED_ROW_ALIGN

#: Largest code of each storage dtype.
_QMAX = {torch.int8: 127.0, torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}


class Format(NamedTuple):
    """How one precision stores and multiplies its operands."""

    name: str
    forward: torch.dtype
    """Storage of the forward operands (activations, weights) and of the saved-tensor side of the
    weight-gradient GEMM."""
    grad: torch.dtype
    """Storage of the gradient operands of the backward GEMMs."""


FORMATS: dict[str, Format] = {
    "int8": Format("int8", torch.int8, torch.int8),
    "fp8": Format("fp8", torch.float8_e4m3fn, torch.float8_e5m2),
}


def qmax(dtype: torch.dtype) -> float:
    return _QMAX[dtype]


def _quantize_eager(v: torch.Tensor, dtype: torch.dtype, dim: int, col_scales: torch.Tensor | None = None,
                    rows_expert: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Codes and fp32 scales of ``v`` (times ``col_scales`` along its last dimension, when given;
    ``rows_expert``: ``col_scales`` holds one set per expert, row r of ``v`` takes set
    ``rows_expert[r]``) with one scale per slice along ``dim`` (reduced). Four passes over ``v``: the
    amax, the product with ``qmax / amax``, the rounding (int8) and the narrowing cast. ``|v * (qmax /
    amax)| <= qmax (1 + 2^-23)`` (two fp32 roundings), which rounds to ``qmax``."""
    v = v if v.dtype == torch.float32 else v.float()  # asked first: the call costs a dispatch
    if col_scales is not None:
        v = v * (col_scales if rows_expert is None else col_scales[rows_expert])
    # |v| then its max: the same value as the infinity norm, which torch computes 5-12x slower at
    # every size above a few hundred elements (one thread, Xeon with AMX: 0.72 ms against 0.11 ms for
    # a 512 x 512 expert matrix, 11.6 against 2.1 ms at 2048 x 2048)
    amax = torch.amax(torch.abs(v), dim=dim, keepdim=True)
    qm = _QMAX[dtype]
    inv = torch.where(amax > 0, qm / amax, 0.0)  # a Python zero: fp32 like amax, no tensor made for it
    q = v * inv
    if dtype == torch.int8:
        q.round_()
    return q.to(dtype), (amax / qm).squeeze(dim)


def _epilogue_eager(out: torch.Tensor, acc: torch.Tensor, sa: torch.Tensor, sb: torch.Tensor | None,
                    cols_first: bool = False, rows_expert: torch.Tensor | None = None) -> None:
    if rows_expert is not None:  # sb [NR, N]: row r's column scales are sb[rows_expert[r]]
        torch.mul(acc, sa[:, None], out=out)
        out.mul_(sb[rows_expert])
        return
    if cols_first:
        torch.mul(acc, sb[None, :], out=out)
        out.mul_(sa[:, None])
        return
    torch.mul(acc, sa[:, None], out=out)
    if sb is not None:
        out.mul_(sb[None, :])


# ---------------------------------------------------------------- fused passes (int8, large tensors)
#: Tensors of at least this many elements are quantized and dequantized by the fused kernels below.
FUSED_MIN_ELEMENTS = 1 << 16
_FUSED: dict[tuple, object] = {}
#: Uses of a fused pass inside :func:`frozen_weights` that run its eager passes before it is compiled
#: (:func:`_fused`): a short ``generate`` compiles nothing, a long-lived decoder compiles what it runs.
FROZEN_COMPILE_AFTER = 256
_FROZEN_USES: dict[tuple, int] = {}
_FUSED_FAILED: list[str] = []


# The quantize passes write their codes and scales into the buffers they are given (inductor stores
# straight into them: no temporary), so that big codes (a weight's, the gathered rows') come from the
# CPU buffer pool like every other big buffer of the path instead of a fresh mapping per call, which
# the kernel faults in and zeroes page by page (a 113 MB weight code buffer: 27,000 faults, more
# time than the pass itself).
def _quantize_rows(v, col_scales, q, s):  # noqa: ANN001, ANN202
    codes, scales = _quantize_eager(v, torch.int8, -1, col_scales)
    q.copy_(codes)
    s.copy_(scales)


def _quantize_rows_experts(v, col_scales, rows_expert, q, s):  # noqa: ANN001, ANN202
    codes, scales = _quantize_eager(v, torch.int8, -1, col_scales, rows_expert)
    q.copy_(codes)
    s.copy_(scales)


def _quantize_rows_unscaled(v, q, s):  # noqa: ANN001, ANN202
    codes, scales = _quantize_eager(v, torch.int8, -1, None)
    q.copy_(codes)
    s.copy_(scales)


def _quantize_cols(v, q, s):  # noqa: ANN001, ANN202
    codes, scales = _quantize_eager(v, torch.int8, -2, None)
    q.copy_(codes)
    s.copy_(scales)


def _codes_and_scales(v: torch.Tensor, dim: int, dtype: torch.dtype = torch.int8) -> tuple[torch.Tensor, torch.Tensor]:
    """Uninitialised ``dtype`` codes shaped like ``v`` and fp32 scales over ``dim`` (reduced), from the
    CPU buffer pool (:mod:`..torch.buffers`; small ones from the allocator)."""
    from ..torch.buffers import cached_empty

    shape = list(v.shape)
    del shape[dim]
    return cached_empty(tuple(v.shape), v, dtype), cached_empty(tuple(shape), v, torch.float32)


def _epilogue_rows(out, acc, sa):  # noqa: ANN001, ANN202
    out.copy_(acc.float() * sa[:, None])


def _epilogue_rows_cols(out, acc, sa, sb):  # noqa: ANN001, ANN202
    out.copy_(acc.float() * sa[:, None] * sb[None, :])


def _epilogue_cols_rows(out, acc, sa, sb):  # noqa: ANN001, ANN202
    out.copy_(acc.float() * sb[None, :] * sa[:, None])


def _epilogue_rows_experts(out, acc, sa, sb, rows_expert):  # noqa: ANN001, ANN202
    out.copy_(acc.float() * sa[:, None] * sb[rows_expert])


def _variant(name: str, args: tuple) -> tuple[tuple, object, tuple]:
    """``(key, function, its arguments)`` of one call of the fused pass ``name``: every choice that
    is not a tensor size (the reduced dimension, which scales are given, their order, the rank) picks
    a function of its own, compiled on its own, so that dynamo guards on nothing but sizes (which
    ``dynamic=True`` keeps symbolic) and no variant's recompiles count against another's limit.
    Parameters are passed detached: their type and static sizes would guard too."""
    if name == "quantize":  # (v, dim, col_scales, rows_expert, codes, scales): the outputs' buffers last
        v, dim, col_scales, rows_expert, q, s = args
        v = v.detach()
        dim = dim - v.dim() if dim >= 0 else dim
        if dim == -1 and rows_expert is not None:
            return ("quantize", "rows-experts", v.dim()), _quantize_rows_experts, (v, col_scales.detach(), rows_expert,
                                                                                  q, s)
        if dim == -1:
            if col_scales is None:
                return ("quantize", "rows", v.dim()), _quantize_rows_unscaled, (v, q, s)
            return ("quantize", "rows-scaled", v.dim()), _quantize_rows, (v, col_scales.detach(), q, s)
        if dim == -2 and col_scales is None:
            return ("quantize", "cols", v.dim()), _quantize_cols, (v, q, s)
        raise ValueError(f"no fused quantize over dim {dim} with column scales {col_scales is not None}")
    out, acc, sa, sb, *rest = args
    cols_first = bool(rest[0]) if rest else False
    if len(rest) > 1 and rest[1] is not None:
        return ("epilogue", "rows-experts"), _epilogue_rows_experts, (out, acc, sa, sb, rest[1])
    if sb is None:
        return ("epilogue", "rows"), _epilogue_rows, (out, acc, sa)
    if cols_first:
        return ("epilogue", "cols-rows"), _epilogue_cols_rows, (out, acc, sa, sb)
    return ("epilogue", "rows-cols"), _epilogue_rows_cols, (out, acc, sa, sb)


def _fused(key: tuple, fn):  # noqa: ANN001, ANN202
    """The same computation as the eager function ``fn``, compiled by inductor into one loop nest
    (the amax, then codes in one pass; the epilogue in one pass): the same IEEE operations in the
    same order, so the same bits (tests/test_precision.py checks it), at a third to a sixth of the
    eager passes' time on the CPU. One compiled function per :func:`_variant` key, each over a code
    object of its own (dynamo keeps its cache and its recompile count per code object). None where
    it cannot be compiled (no C++ compiler)."""
    if _FUSED_FAILED:
        return None
    compiled = _FUSED.get(key)
    if compiled is None and weights_frozen():
        # Inference (decoding, evaluation): the eager passes, the same bits, until this pass has run
        # often enough to be worth compiling: compiling it cost the first ``generate`` of a tiny model
        # tens of times transformers' whole first ``generate``.
        uses = _FROZEN_USES[key] = _FROZEN_USES.get(key, 0) + 1
        if uses <= FROZEN_COMPILE_AFTER:
            return None
    if compiled is None:
        import types

        code = fn.__code__.replace(co_name=f"{fn.__name__}_{'_'.join(map(str, key[1:]))}".replace("-", "_"))
        own = types.FunctionType(code, fn.__globals__, code.co_name, fn.__defaults__, fn.__closure__)
        compiled = _FUSED[key] = torch.compile(own, dynamic=True)
    return compiled


def _plain(t):  # noqa: ANN001, ANN202
    """``t`` as dynamo should see it: the same memory, sizes and strides, but no view of another tensor
    and no storage offset. Dynamo guards a view on its base's sizes and strides, and a storage offset
    on being 0, 1 or more and on equalling another input's; the slices the expert loop hands over
    (one expert's rows, its slice of the scales) went through every such variant and passed the
    recompile limit (8) within a training step, after which every further variant ran unfused.
    Only sizes are left to guard on (``dynamic=True``: symbolic, but for 0 and 1)."""
    if not isinstance(t, torch.Tensor):
        return t
    t = t.detach()
    return torch.from_dlpack(t) if t.storage_offset() else t


def _run_fused(name: str, *args):  # noqa: ANN001, ANN202
    """``(True, result)``, or ``(False, None)`` where the fused kernel cannot run. ``name`` is
    ``"quantize"`` (``v, dim, col_scales[, rows_expert]``; the result ``(codes, scales)`` in pooled
    buffers) or ``"epilogue"`` (``out, acc, sa, sb[, cols_first[, rows_expert]]``)."""
    if name == "quantize":
        outs = _codes_and_scales(args[0], args[1])
        args = (*args[:3], args[3] if len(args) > 3 else None, *outs)
    key, fn, call_args = _variant(name, args)
    compiled = _fused(key, fn)
    if compiled is None:
        return False, None
    try:
        res = compiled(*(_plain(a) for a in call_args))
        return True, outs if name == "quantize" else res
    except Exception as exc:  # no compiler, or a compiler that fails: the eager passes, same numbers
        import warnings

        _FUSED_FAILED.append(f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}" if str(exc) else type(exc).__name__)
        warnings.warn(f"fastmoe_xpu: the fused int8 passes do not compile here ({_FUSED_FAILED[0]}); "
                      "using the eager ones", RuntimeWarning, stacklevel=3)
        return False, None


def _use_fused(t: torch.Tensor, dtype: torch.dtype) -> bool:
    return dtype == torch.int8 and t.numel() >= FUSED_MIN_ELEMENTS and t.device.type == "cpu"


#: A 3-D tensor (a weight's experts) of at least this many elements is quantized eagerly one expert
#: at a time: each expert's passes stay in cache, and their temporaries are an expert's size, not
#: fresh mappings of the whole weight faulted in page by page. 27-32 ms against 65-80 ms for a
#: [32, 512, 512] weight (one thread, Xeon with AMX, 2026-11-29): most of an int8 model's first call.
BY_EXPERT_MIN_ELEMENTS = 1 << 20


def _quantize_by_expert(v: torch.Tensor, dtype: torch.dtype, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`_quantize_eager` of a 3-D ``v`` (no column scales; ``dim`` one of the last two) expert
    by expert into one pair of buffers: the same codes and scales."""
    codes, scales = _codes_and_scales(v, dim, dtype)
    for e in range(v.shape[0]):
        c, sc = _quantize_eager(v[e], dtype, dim)
        codes[e].copy_(c)
        scales[e].copy_(sc)
    return codes, scales


def _quantize(v: torch.Tensor, dtype: torch.dtype, dim: int, col_scales: torch.Tensor | None = None,
              rows_expert: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    if _use_fused(v, dtype):
        ok, res = _run_fused("quantize", v, dim, col_scales, rows_expert)
        if ok:
            return res
    if (v.dim() == 3 and dim in (-1, -2) and col_scales is None and v.numel() >= BY_EXPERT_MIN_ELEMENTS
            and not torch.compiler.is_compiling()):
        return _quantize_by_expert(v, dtype, dim)
    return _quantize_eager(v, dtype, dim, col_scales, rows_expert)


def quantize_rows(v: torch.Tensor, dtype: torch.dtype, col_scales: torch.Tensor | None = None,
                  rows_expert: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(codes [..., M, K], scales [..., M])`` of ``v`` (times ``col_scales [K]`` when given; with
    ``rows_expert [M]``, ``col_scales [NR, K]`` and row r times ``col_scales[rows_expert[r]]``): one
    scale per row (the last dimension reduced)."""
    return _quantize(v, dtype, -1, col_scales, rows_expert)


def quantize_cols(v: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """``(codes [..., K, N], scales [..., N])``: one scale per column (dimension -2 reduced)."""
    return _quantize(v, dtype, -2)


def expert_of_rows(cum_token_counts: torch.Tensor, rows: int) -> torch.Tensor:
    """``[rows]`` int64 on the device: the expert whose rows (``cum_token_counts[e] ..
    cum_token_counts[e+1]``) hold each row, NR for rows past RT; no host read."""
    bounds = cum_token_counts[1:].to(torch.int64)
    return torch.searchsorted(bounds, torch.arange(rows, device=bounds.device), right=True)


#: The fp8 weight-gradient codes (:func:`quantize_cols_grouped_t`) start each expert's rows at a
#: multiple of this (defined beside the kernels' configs, which the Triton kernels read without this module).
ROW_ALIGN = QUANTIZED_ROW_ALIGN


def padded_bounds(cum_token_counts: torch.Tensor, align: int = ROW_ALIGN) -> torch.Tensor:
    """``[NR+1]`` int32 on the device: expert e's block ``[b[e], b[e+1])`` of ``align``-rounded length
    (its row count rounded up to a multiple of ``align``), the blocks back to back from 0."""
    cum = cum_token_counts.to(torch.int64)
    padded = (cum[1:] - cum[:-1] + (align - 1)) // align * align
    return torch.cat([cum.new_zeros(1), padded.cumsum(0)]).to(torch.int32)


def padded_length(rows: int, num_experts: int, align: int = ROW_ALIGN) -> int:
    """A length every :func:`padded_bounds` of ``rows`` rows over ``num_experts`` experts fits in
    (each expert adds fewer than ``align`` rows), a multiple of ``align``: known on the host."""
    return -(-(rows + (align - 1) * num_experts) // align) * align


def quantize_cols_grouped_t(v: torch.Tensor, dtype: torch.dtype, cum_token_counts: torch.Tensor,
                            padded_cum: torch.Tensor, length: int, idx: torch.Tensor | None = None,
                            ) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`quantize_cols_grouped` with the codes stored by column, each expert's rows aligned:
    ``(codes [N, length], scales [NR, N])`` where column block ``padded_cum[e] .. padded_cum[e+1]``
    (:func:`padded_bounds`) holds the codes of expert e's rows ``cum_token_counts[e] ..
    cum_token_counts[e+1]`` of ``v`` (``idx`` given: of ``v[idx[r]]``) in order, then zeros; zeros
    past the last block (``length``: :func:`padded_length`). The same codes and scales as
    :func:`quantize_cols` of each expert's rows alone; no host read. The fp8 weight-gradient
    kernel's operand layout (:func:`..triton.fp8_gemm.fp8_grouped_wgrad`)."""
    NR = cum_token_counts.numel() - 1
    cum = cum_token_counts.to(torch.int64)
    pcum = padded_cum.to(torch.int64)
    pos = torch.arange(length, device=v.device)
    e = torch.searchsorted(pcum[1:], pos, right=True)  # NR past the last block
    ec = e.clamp(max=NR - 1)
    row = pos - pcum.index_select(0, ec) + cum.index_select(0, ec)
    valid = (e < NR) & (row < cum.index_select(0, ec + 1))
    row = torch.where(valid, row, 0)
    if idx is not None:
        row = torch.where(valid, idx.index_select(0, row).to(torch.int64), 0)
    v = torch.where(valid[:, None], v.index_select(0, row).float(), 0.0)  # the pads: zero, whatever v holds
    eid = torch.where(valid, e, NR)
    q, scales = _scaled_per_expert(v, eid, NR, dtype)
    codes = torch.empty(v.shape[1], length, dtype=dtype, device=v.device)
    codes.t().copy_(q)
    return codes, scales


def quantize_cols_grouped(v: torch.Tensor, dtype: torch.dtype, cum_token_counts: torch.Tensor,
                          idx: torch.Tensor | None = None, rows: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(codes [R, N], scales [NR, N])``: the rows ``v[r]`` (``idx`` given: ``v[idx[r]]``, R =
    ``rows`` or ``len(idx)``) quantized with one scale per column over each expert's rows
    ``cum_token_counts[e] .. cum_token_counts[e+1]``, the same codes and scales as
    :func:`quantize_cols` of each expert's rows alone (the same fp32 operations), with the expert
    bounds kept on the device: no host read. An empty expert's scales are zero; the codes of rows
    past RT (and the indices there) are never used."""
    NR = cum_token_counts.numel() - 1
    R = rows if rows is not None else idx.shape[0] if idx is not None else v.shape[0]
    eid = expert_of_rows(cum_token_counts, R)  # rows past RT: NR, a slot of their own, dropped
    if idx is not None:
        v = v.index_select(0, torch.where(eid < NR, idx[:R].to(torch.int64), 0))
    q, scales = _scaled_per_expert(v[:R].float(), eid, NR, dtype)
    return q.to(dtype), scales


def _scaled_per_expert(v: torch.Tensor, eid: torch.Tensor, NR: int,
                       dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q, scales [NR, N])``: the fp32 rows ``v [R, N]`` over their column scales, one set per expert
    (row r belongs to expert ``eid[r]``; ``eid = NR``: a row of no expert, in a slot that is dropped),
    rounded for int8 (still fp32: the caller casts or copies into its codes)."""
    amax = v.new_zeros(NR + 1, v.shape[1]).scatter_reduce_(0, eid[:, None].expand(v.shape), v.abs(), "amax")
    qm = _QMAX[dtype]
    inv = torch.where(amax > 0, qm / amax, 0.0)  # a Python zero: fp32 like amax, no tensor made for it
    q = v * inv.index_select(0, eid)
    if dtype == torch.int8:
        q.round_()
    return q, amax[:NR] / qm


# ---------------------------------------------------------------- the weight-gradient GEMMs' format
@functools.lru_cache(maxsize=1)
def cpu_has_amx_bf16() -> bool:
    """Whether this CPU has AMX tiles and AVX512-BF16 (oneDNN's bf16 GEMMs then run on AMX) and this
    PyTorch has oneDNN; False where torch cannot tell (``torch.cpu._is_amx_tile_supported`` missing)."""
    try:
        return (bool(torch.cpu._is_amx_tile_supported()) and bool(torch.cpu._is_avx512_bf16_supported())
                and torch.backends.mkldnn.is_available())
    except (AttributeError, RuntimeError):
        return False


def weight_grad_gemm(fmt: str, device: torch.device | str) -> str:
    """How format ``fmt``'s weight-gradient GEMMs multiply on ``device`` on the torch base: ``fmt``
    itself (both operands quantized per column over each expert's rows), or ``"bf16"`` (both operands
    rounded to bf16, ``torch.mm`` with fp32 accumulation, the result rounded to bf16). bf16 for int8 on
    CPUs with AMX-BF16 (``FASTMOE_INT8_WEIGHT_GRADS`` forces either): the contraction of these GEMMs
    is an expert's rows (tens to hundreds), where ``torch._int_mm`` ran at a third to half of bf16
    ``torch.mm``'s rate on a Xeon with AMX, its int32 sums then dequantized in another pass
    (``python -m bench precision --layer`` prints G per GEMM); the forward and input-gradient GEMMs
    (contraction H or I) stay int8, where ``torch._int_mm`` is the faster."""
    if fmt != "int8" or torch.device(device).type != "cpu":
        return fmt
    from ... import settings

    forced = settings.get().int8_weight_grads
    if forced is not None:
        return forced
    return "bf16" if cpu_has_amx_bf16() else "int8"


# ---------------------------------------------------------------- the GEMM
def _pad_to(t: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    if t.shape == (rows, cols):
        return t
    out = t.new_zeros(rows, cols)
    out[: t.shape[0], : t.shape[1]] = t
    return out


def int_mm(a: torch.Tensor, b: torch.Tensor, pad: bool | None = None) -> torch.Tensor:
    """``a [M, K] int8 @ b [K, N] int8 -> int32`` exactly. ``torch._int_mm`` on CUDA needs M > 16
    and K, N multiples of 8: there (or with ``pad=True``) the operands are zero-padded, which
    changes no sum, and the result is cut back. The CPU takes any shape."""
    M, K = a.shape
    N = b.shape[1]
    if pad is None:
        pad = a.device.type != "cpu"
    if not pad:
        if a.device.type == "cpu":  # the int32 sums in a pooled buffer (a weight gradient's: 9 MB)
            from ..torch.buffers import cached_empty

            return torch._int_mm(a, b, out=cached_empty((M, N), a, torch.int32))
        return torch._int_mm(a, b)
    Mp, Kp, Np = max(M, 17), -(-K // 8) * 8, -(-N // 8) * 8
    if (Mp, Kp, Np) == (M, K, N):
        return torch._int_mm(a, b)
    return torch._int_mm(_pad_to(a, Mp, Kp), _pad_to(b, Kp, Np))[:M, :N]


def scaled_mm(qa: torch.Tensor, sa: torch.Tensor, qb: torch.Tensor, sb: torch.Tensor | None,
              pad: bool | None = None) -> torch.Tensor:
    """The fp8 GEMM, ``torch._scaled_mm`` with row-wise scales (fp32 out). CUDA wants K and N
    multiples of 16 and ``b`` column-major: there (or with ``pad=True``) the codes are zero-padded
    (no sum changes; padded columns get scale 1 and are cut off)."""
    M, K = qa.shape
    N = qb.shape[1]
    sb = torch.ones(N, device=qb.device) if sb is None else sb
    if pad is None:
        pad = qa.device.type != "cpu"
    Kp, Np = (-(-K // 16) * 16, -(-N // 16) * 16) if pad else (K, N)
    if (Kp, Np) != (K, N):
        qa, qb = _pad_to(qa, M, Kp), _pad_to(qb, Kp, Np)
        sb = torch.cat([sb, sb.new_ones(Np - N)])
    b = qb if qb.stride(0) == 1 else qb.t().contiguous().t()  # column-major B
    res = torch._scaled_mm(qa.contiguous(), b, scale_a=sa[:, None].contiguous(), scale_b=sb[None, :].contiguous(),
                           out_dtype=torch.float32)
    return res if Np == N else res[:, :N]


def qmm(qa: torch.Tensor, sa: torch.Tensor, qb: torch.Tensor, sb: torch.Tensor | None,
        out: torch.Tensor | None = None, cols_first: bool = False) -> torch.Tensor:
    """``sa[:, None] * sb[None, :] * (qa @ qb)`` in fp32 (``sb`` None: no column scales), written into
    ``out`` when given (in its dtype): the quantized GEMM with its dequantizing epilogue, which for
    int8 is two passes over the output (row scales while converting the int32 sums, then columns;
    ``cols_first``: the column scales first, as the transposed weight gradient needs to round as the
    reference's layout does)."""
    if qa.dtype == torch.int8:
        acc = int_mm(qa, qb)
        res = out if out is not None and out.dtype == torch.float32 else torch.empty(
            acc.shape, dtype=torch.float32, device=acc.device)
        if not (_use_fused(acc, torch.int8) and _run_fused("epilogue", res, acc, sa, sb, cols_first)[0]):
            _epilogue_eager(res, acc, sa, sb, cols_first)
    else:
        res = scaled_mm(qa, sa, qb, sb)
    if out is None or res is out:
        return res
    out.copy_(res)
    return out


def grouped_int8_mm(qa: torch.Tensor, sa: torch.Tensor, b_of, sb: torch.Tensor | None,  # noqa: ANN001
                    groups: list[tuple[int, int, int]], out: torch.Tensor,
                    packs: "ExpertPacks | None" = None) -> None:
    """For each expert ``(e, s, t)`` of ``groups`` (rows ``[s, t)``, back to back from 0): ``out[s:t] =
    sa[s:t, None] * sb[e][None, :] * (qa[s:t] @ b_of(e))`` (int8 codes; ``sb`` None: no column scales),
    the same numbers as :func:`qmm` expert by expert. Every expert's int32 sums go into one buffer and
    one dequantizing pass covers all rows (each row's column scales found by its expert): one pass per
    projection instead of one per expert, whose calls cost more than their work at a few hundred
    rows per expert. ``packs``: the weight's :class:`ExpertPacks`; inside :func:`frozen_weights` an
    expert used often enough multiplies on its oneDNN-packed codes instead (AMX int8), the same sums."""
    rt = groups[-1][2] if groups else 0
    if rt == 0:
        return
    if packs is not None and weights_frozen() and not torch.compiler.is_compiling():
        chosen = [(e, s, t, packs.get(e, b_of)) for e, s, t in groups if t > s]
        if any(c[3] is not None for c in chosen):
            _packed_epilogues(qa, sa, b_of, sb, chosen, out)
            return
    from ..torch.buffers import cached_empty

    acc = cached_empty((rt, out.shape[1]), qa, torch.int32)
    for e, s, t in groups:
        if t > s:
            torch._int_mm(qa[s:t], b_of(e), out=acc[s:t])
    rows = rows_of_experts(groups, qa.device) if sb is not None else None
    direct = out.dtype == torch.float32  # else fp32 first, then rounded into out's dtype as qmm does
    res = out[:rt] if direct else torch.empty(rt, out.shape[1], device=out.device)
    if not (_use_fused(acc, torch.int8) and _run_fused("epilogue", res, acc, sa, sb, False, rows)[0]):
        _epilogue_eager(res, acc, sa, sb, False, rows)
    if not direct:
        out[:rt].copy_(res)


def _packed_epilogues(qa: torch.Tensor, sa: torch.Tensor, b_of, sb: torch.Tensor | None,  # noqa: ANN001
                      groups: list[tuple[int, int, int, object]], out: torch.Tensor) -> None:
    """:func:`grouped_int8_mm` with some experts' codes packed for oneDNN (``groups``: ``(e, s, t, packed
    or None)``): the packed ones multiply in :func:`packed_int8_mm`, the others in ``torch._int_mm``, and
    each expert's rows are dequantized as the one pass does it (row scales, then the expert's column
    scales: the same products in the same order)."""
    rt = groups[-1][2]
    direct = out.dtype == torch.float32
    res = out[:rt] if direct else torch.empty(rt, out.shape[1], device=out.device)
    for e, s, t, packed in groups:
        acc = torch._int_mm(qa[s:t], b_of(e)) if packed is None else packed_int8_mm(qa[s:t], packed, out.shape[1])
        _epilogue_eager(res[s:t], acc, sa[s:t], None if sb is None else sb[e])
    if not direct:
        out[:rt].copy_(res)


def rows_of_experts(groups: list[tuple[int, int, int]], device: torch.device) -> torch.Tensor:
    """``[rt]`` int64: the expert of each row of ``groups`` (``(e, s, t)``, back to back from 0)."""
    counts = torch.tensor([t - s for _, s, t in groups], dtype=torch.int64)
    return torch.repeat_interleave(torch.tensor([e for e, _, _ in groups], dtype=torch.int64), counts).to(device)


# ---------------------------------------------------------------- AMX int8: oneDNN's packed weights
#: Forward uses of one expert's codes inside :func:`frozen_weights` before they are packed for oneDNN.
#: On a Xeon with AMX (2026-11-29, one thread) packing a 2048 x 2048 code matrix took 15-27 ms and
#: saved 75 us (one routed row) to 200 us (eight) per use against ``torch._int_mm``: 90-250 uses
#: to pay back, so an expert is packed once it has paid about that much in the slower GEMM (a
#: short ``generate`` packs nothing; a long-lived decoder packs its experts as they are used).
PACK_AFTER_USES = 128
#: The smallest expert matrix (elements) that is packed. oneDNN's quantized linear took 0.8-3.3 ms for
#: one row of a 256 x 256 or 512 x 256 code matrix (``torch._int_mm``: 5-11 us), tied at 1024 x 512 and
#: was 1.5-1.8x faster from 2048 x 1024 up (Xeon with AMX, one thread, 2026-11-29).
PACK_MIN_ELEMENTS = 1 << 20
_UNIT_SCALES: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}


def packed_int8_mm(a: torch.Tensor, packed: torch.Tensor, n: int) -> torch.Tensor:
    """``a [M, K] int8 @ W^T`` as fp32 (the exact int32 sums converted), ``packed``: ``W [n, K]`` int8
    packed by ``torch.ops.onednn.qlinear_prepack``. Unit scales, zero points 0 and an fp32 output:
    oneDNN's quantized linear with nothing to dequantize, so the sums are ``torch._int_mm``'s."""
    if n not in _UNIT_SCALES:
        _UNIT_SCALES[n] = (torch.ones(n), torch.zeros(n, dtype=torch.int64))
    ones, zeros = _UNIT_SCALES[n]
    return torch.ops.onednn.qlinear_pointwise(a, 1.0, 0, packed, ones, zeros, None, 1.0, 0, torch.float32,
                                              "none", [], "")


@functools.lru_cache(maxsize=1)
def amx_int8_linear() -> bool:
    """Whether int8 GEMMs on packed weights run here: a CPU with AMX tiles (oneDNN's quantized linear
    then multiplies on them, ``torch._int_mm`` on VNNI), oneDNN, the two ops, and their sums equal
    ``torch._int_mm``'s at an awkward shape. False where any of it is missing or fails."""
    try:
        if not (torch.cpu._is_amx_tile_supported() and torch.backends.mkldnn.is_available()):
            return False
        g = torch.Generator().manual_seed(0)
        a = torch.randint(-127, 128, (3, 37), dtype=torch.int8, generator=g)
        w = torch.randint(-127, 128, (21, 37), dtype=torch.int8, generator=g)
        got = packed_int8_mm(a, torch.ops.onednn.qlinear_prepack(w, None), 21)
        return torch.equal(got, torch._int_mm(a, w.t()).float())
    except (AttributeError, RuntimeError):
        return False


class ExpertPacks:
    """One int8 weight's experts packed for oneDNN (:func:`packed_int8_mm`), each once it has been used
    :data:`PACK_AFTER_USES` times inside :func:`frozen_weights`; kept with the codes they copy, so
    dropped with them when the weight changes."""

    __slots__ = ("uses", "packed")

    def __init__(self) -> None:
        self.uses: dict[int, int] = {}
        self.packed: dict[int, torch.Tensor] = {}

    def get(self, e: int, b_of) -> torch.Tensor | None:  # noqa: ANN001
        """Expert ``e``'s packed codes (``b_of(e)``: its ``[In, O]`` codes), packed at this use if due."""
        packed = self.packed.get(e)
        if packed is None:
            self.uses[e] = n = self.uses.get(e, 0) + 1
            if n > PACK_AFTER_USES:
                packed = self.packed[e] = torch.ops.onednn.qlinear_prepack(b_of(e).t().contiguous(), None)
        return packed


# ---------------------------------------------------------------- weights, quantized once per call
class QWeight(NamedTuple):
    codes: torch.Tensor
    """``[NR, O, In]`` (or ``[NR, In, O]`` for a transposed layout), the weight's own layout."""
    scales: torch.Tensor
    """``[NR, O]``: one per output channel."""
    packs: ExpertPacks | None = None
    """int8 on a CPU where :func:`amx_int8_linear`: the experts' codes packed for the forward."""


class _Entry(NamedTuple):
    ref: weakref.ref
    stamp: tuple
    """What the weight must still be for the codes to hold: :func:`_stamp`."""
    dtype: torch.dtype
    transposed: bool
    qw: QWeight
    recipe: str


_WEIGHTS: dict[int, _Entry] = {}
_FROZEN = threading.local()


def _stamp(w: torch.Tensor) -> tuple:
    """The weight's version and where and how its values lie: an in-place update moves the version,
    a new ``.data`` (a move, a cast, ZeRO-style gathering) moves the address, device, dtype or shape."""
    try:
        ptr = w.data_ptr()
    except RuntimeError:  # a tensor without storage of its own (a wrapper subclass): its version alone
        ptr = None
    return (w._version, ptr, w.device, w.dtype, tuple(w.shape), tuple(w.stride()))


@contextlib.contextmanager
def frozen_weights():
    """Inside, a forward takes back the quantized codes of a weight it has quantized before, for as
    long as the weight is the same tensor at the same version and address, instead of quantizing it
    again on every call (outside, only the backward of the same call does). For decoding and
    evaluation: at one token a call, quantizing every expert's weights costs many times the
    GEMMs. In-place updates (optimizer steps, ``load_state_dict``, ``torch.nn.init``) move the
    version, so the codes follow them; writes through ``.data`` (``w.data.add_(...)``, as some
    fused optimizers and EMA helpers do) do not: inside this context such a write is not seen.
    Thread-local, nestable; the codes stay held (a quarter of fp32 weights' memory for int8) until
    their weight is freed or :func:`forget_weights`."""
    _FROZEN.depth = getattr(_FROZEN, "depth", 0) + 1
    try:
        yield
    finally:
        _FROZEN.depth -= 1


_HINTED: list[bool] = []


def _hint_frozen() -> None:
    """Once per process: an inference forward is quantizing a weight that has not changed since its
    last quantization (decoding or evaluation outside :func:`frozen_weights`)."""
    if _HINTED:
        return
    _HINTED.append(True)
    import warnings

    warnings.warn("fastmoe_xpu: quantized expert weights that did not change since the last call were quantized "
                  "again (at decode shapes this costs more than the GEMMs); for decoding or evaluation, run the "
                  "calls inside fastmoe_xpu.frozen_expert_weights() (docs/precision.md)", UserWarning, stacklevel=2)


def weights_frozen() -> bool:
    """Whether this thread is inside :func:`frozen_weights`."""
    return getattr(_FROZEN, "depth", 0) > 0


def quantized_weight(w: torch.Tensor, dtype: torch.dtype, transposed: bool = False,
                     reuse: bool = False, quantize=None, recipe: str = "channel") -> QWeight:  # noqa: ANN001
    """``w [NR, O, In]`` (``transposed``: stored ``[NR, In, O]``) quantized per output channel.

    The forward (``reuse=False``) quantizes and remembers the result for this tensor object, its
    version and its address (:func:`_stamp`); the backward (``reuse=True``) takes it back when the
    same tensor is unchanged since, else quantizes again, and so does the forward inside
    :func:`frozen_weights`. An in-place update (an optimizer step) bumps the version, and a freed
    tensor's entry is dropped with it, so a stale copy is never used. ``quantize(w, dtype,
    transposed)``: another implementation of the same codes and scales (the Triton fp8 path's
    one-pass kernel) instead of :func:`quantize_rows` / :func:`quantize_cols`. ``recipe``: which scales
    ``quantize`` makes (``"channel"``, per output channel; ``"block"``, the ``fp8-block`` recipe's
    square blocks), part of what a remembered entry must match."""
    key = id(w)
    hit = _WEIGHTS.get(key)
    if (hit is not None and hit.ref() is w and hit.stamp == _stamp(w) and hit.dtype == dtype
            and hit.transposed == transposed and hit.recipe == recipe):
        if reuse or weights_frozen():
            return hit.qw
        if not torch.is_grad_enabled():
            _hint_frozen()
    # A stale entry's codes are dropped first: on the CPU they come from the buffer pool, which can
    # then hand the same buffer to the new codes instead of keeping two per weight.
    _WEIGHTS.pop(key, None)
    if quantize is not None:
        q = quantize(w, dtype, transposed)
    else:
        q = quantize_cols(w, dtype) if transposed else quantize_rows(w, dtype)
    packs = (dtype == torch.int8 and w.device.type == "cpu" and not torch.compiler.is_compiling()
             and w[0].numel() >= PACK_MIN_ELEMENTS and amx_int8_linear())
    qw = QWeight(*q, ExpertPacks() if packs else None)
    try:
        ref = weakref.ref(w, lambda _r, k=key: _WEIGHTS.pop(k, None))
    except TypeError:  # not weak-referenceable: nothing is kept
        return qw
    _WEIGHTS[key] = _Entry(ref, _stamp(w), dtype, transposed, qw, recipe)
    return qw


def forget_weights() -> None:
    """Drop every remembered quantized weight."""
    _WEIGHTS.clear()


# ---------------------------------------------------------------- availability
def _said(exc: Exception) -> str:
    """The sentence of ``exc`` that says why, in at most 160 characters. torch's internal asserts put
    the condition and a bug-report request first and the reason last (torch 2.11's CPU
    ``_scaled_mm``: "... please report a bug to PyTorch. Now _scaled_mm only supports per-tensor
    scaling for CPU backend."): the reason is what is kept."""
    text = " ".join(str(exc).split()) or type(exc).__name__
    head, sep, reason = text.partition("please report a bug to PyTorch.")
    return (reason.strip() if sep and reason.strip() else head.strip())[:160]


@functools.lru_cache(maxsize=None)
def _probe(fmt: str, device_type: str, device_index: int | None) -> str | None:
    dev = torch.device(device_type, device_index) if device_index is not None else torch.device(device_type)
    f = FORMATS[fmt]
    try:
        a = (torch.arange(32 * 32, device=dev, dtype=torch.float32).reshape(32, 32) % 7) - 3
        qa, sa = quantize_rows(a, f.forward)
        qb, sb = quantize_cols(a.t().contiguous(), f.grad)
        got, want = qmm(qa, sa, qb, sb), a @ a.t()
        # within a few code steps of the exact product (the quantization error of these values)
        if not (got - want).abs().max() <= 0.05 * want.abs().max():
            return f"{fmt} GEMMs give wrong results on {dev}"
    except Exception as exc:  # an unsupported device raises; any reason means "not here"
        return f"{fmt} GEMMs do not run on {dev} with torch {torch.__version__}: {_said(exc)}"
    return None


def unsupported_reason(fmt: str, device: torch.device | str, dtype: torch.dtype, base: str | None = None) -> str | None:
    """None when precision ``fmt`` runs for ``dtype`` activations on ``device`` next to kernel base
    ``base``; else why not. Next to the Triton base, where the format's Triton grouped GEMMs run on
    the device (their config table has them; fp8: sm_89+), those are every GEMM of the path and
    nothing else is needed; otherwise the torch GEMMs are probed once with a tiny quantized GEMM, so
    the answer follows the installed torch (whose CPU ``_scaled_mm`` took row-wise scales only from
    2.13 on)."""
    dev = torch.device(device)
    if dev.type == "meta":
        return f"{fmt} GEMMs are not probed on the meta device"
    if fmt == "fp8" and dev.type == "cuda" and torch.cuda.get_device_capability(dev) < (8, 9):
        return f"fp8 GEMMs need sm_89 or newer, {torch.cuda.get_device_name(dev)} is sm_" + "".join(
            map(str, torch.cuda.get_device_capability(dev)))
    if base == "triton" and _triton_kernels_run(fmt, dev):
        return None
    return _probe(fmt, dev.type, dev.index)


def _triton_kernels_run(fmt: str, dev: torch.device) -> bool:
    try:
        if fmt == "int8":
            from ..triton import int8_gemm as kernels
        else:
            from ..triton import fp8_gemm as kernels
    except ImportError:  # no triton
        return False
    return bool(kernels.available(dev))
