"""What the compile gates compile: every Triton kernel variant x config, as a :class:`KernelSpec`.

Shared by :mod:`fastmoe_xpu.tools.compile_check` (sm_90, sm_100a, gfx942) and
:mod:`fastmoe_xpu.tools.compile_xpu` (Intel PVC), which import this file and never each other. The
problem it describes is an OLMoE-sized layer: H=2048, I=1024, K=8, token block 8, bf16 activations
and weights. The specs mirror how the launchers in ``kernels/triton`` call the kernels.
"""
from __future__ import annotations

import types
from dataclasses import dataclass, field
from typing import Any

from ..kernels.configs import configs
from ..kernels.triton import combine, counting, fp8_block_gemm, fp8_gemm, grouped_gemm, indices, int8_gemm, tma_gemm

@dataclass
class KernelSpec:
    """One kernel compile: ``triton.compile(ASTSource(fn, signature, constexprs), options)``."""

    name: str
    fn: Any
    signature: dict[str, str]
    constexprs: dict[str, Any]
    config_name: str
    num_warps: int
    num_stages: int
    is_default: bool
    extra_options: dict[str, Any]
    #: Arguments the runtime would specialise as multiples of 16 (aligned pointers, model dims).
    divisible_by_16: tuple[str, ...] = field(default_factory=tuple)

    def options(self) -> dict[str, Any]:
        return {"num_warps": self.num_warps, "num_stages": self.num_stages, **self.extra_options}


#: The NVIDIA targets: ``cuda`` (sm_90) and ``sm100`` (sm_100a). Both compile the same kernel
#: variants (``sm100``'s list is ``cuda``'s), each with its own config table.
NVIDIA_TARGETS = ("cuda", "sm100")

_jit_cache: dict[int, Any] = {}


def _jit(kernel: Any) -> Any:
    """A compiled-mode JITFunction of ``kernel`` even when its module was imported under the
    interpreter. The Python function is wrapped again over a copy of its globals in which every
    interpreted jit function it calls (``@triton.jit`` helpers, referenced by name) is itself
    wrapped again, recursively: the compiler accepts only JITFunctions as callees."""
    from triton.runtime.jit import JITFunction

    if isinstance(kernel, JITFunction):
        return kernel
    key = id(kernel)
    if key not in _jit_cache:
        fn = kernel.fn
        scope = dict(fn.__globals__)
        rewrapped = types.FunctionType(fn.__code__, scope, fn.__name__, fn.__defaults__, fn.__closure__)
        rewrapped.__qualname__, rewrapped.__module__ = fn.__qualname__, fn.__module__
        rewrapped.__kwdefaults__, rewrapped.__annotations__ = fn.__kwdefaults__, fn.__annotations__
        _jit_cache[key] = JITFunction(rewrapped, **getattr(kernel, "kwargs", {}))
        for name, value in scope.items():  # after caching: a helper may reach this kernel again
            if _is_interpreted(value):
                scope[name] = _jit(value)
    return _jit_cache[key]


def _is_interpreted(value: Any) -> bool:
    try:
        from triton.runtime.interpreter import InterpretedFunction
    except ImportError:  # a Triton build without the interpreter has only JITFunctions
        return False
    return isinstance(value, InterpretedFunction)


# Representative problem: OLMoE-1B-7B-like layer on one rank.
H, I, K, TBS = 2048, 1024, 8, 8
_P32, _P64, _I32 = "*i32", "*i64", "i32"


def _variants(target: str) -> list[tuple[str, str, Any, dict[str, str], dict[str, Any], tuple[str, ...]]]:
    """``(spec name, configs key, kernel, signature, constexprs without tiles, aligned args)``."""
    block_ptr = target == "xpu"
    act = "*bf16"
    gemm_flags = {"BLOCK_PTR": block_ptr, "DOT_PRECISION": "ieee"}
    out: list = []
    out.append(("count_tokens", "count_tokens", counting._count_tokens_fwd_kernel, {
        "topk_idx_ptr": _P64, "partial_ptr": _P32, "expert_counts_ptr": _P32, "block_totals_ptr": _P32,
        "expert_totals_ptr": _P32, "T": _I32, "K": _I32, "TH": _I32, "expert_start": _I32, "num_local": _I32,
        "block_size": _I32}, {"BLOCK_T": TBS, "BLOCK_K": K},
        ("topk_idx_ptr", "partial_ptr", "expert_counts_ptr", "block_totals_ptr", "expert_totals_ptr")))
    out.append(("cumsum_counts", "cumsum_counts", counting._cumsum_counts_fwd_kernel, {
        "partial_ptr": _P32, "expert_totals_ptr": _P32, "expert_counts_ptr": _P32, "block_totals_ptr": _P32,
        "partial_cum_ptr": _P32, "cum_token_ptr": _P32, "cum_expert_ptr": _P32, "T": _I32, "TH": _I32,
        "num_local": _I32, "block_size": _I32, "tokens_per_chunk": _I32}, {},
        ("partial_ptr", "expert_totals_ptr", "expert_counts_ptr", "block_totals_ptr", "partial_cum_ptr",
         "cum_token_ptr", "cum_expert_ptr")))
    out.append(("build_indices", "build_indices", indices._build_indices_fwd_kernel, {
        "topk_idx_ptr": _P64, "partial_cum_ptr": _P32, "cum_expert_ptr": _P32, "input_idx_ptr": _P32,
        "output_idx_ptr": _P32, "selected_ptr": _P32, "T": _I32, "K": _I32, "TH": _I32, "expert_start": _I32,
        "num_local": _I32, "block_size": _I32}, {"BLOCK_K": K, "BLOCK_J": TBS * K},
        ("topk_idx_ptr", "partial_cum_ptr", "cum_expert_ptr", "input_idx_ptr", "output_idx_ptr", "selected_ptr")))
    out.append(("gate_up_fwd", "gate_up_fwd", grouped_gemm._gate_up_fwd_kernel, {
        "x_ptr": act, "input_idx_ptr": _P32, "cum_token_ptr": _P32, "w_ptr": act, "gate_up_ptr": act, "h_ptr": act,
        "H": _I32, "I": _I32}, dict(gemm_flags),
        ("x_ptr", "input_idx_ptr", "cum_token_ptr", "w_ptr", "gate_up_ptr", "h_ptr", "H", "I")))
    mm_sig = {"a_ptr": act, "idx_ptr": _P32, "w_ptr": act, "cum_token_ptr": _P32, "out_ptr": act, "t_ptr": act,
              "lb_ptr": act, "N": _I32, "K": _I32, "RANK": _I32}
    mm_aligned = ("a_ptr", "idx_ptr", "w_ptr", "cum_token_ptr", "out_ptr", "t_ptr", "lb_ptr", "N", "K")
    lora_off = {"LORA": False, "BLOCK_R": grouped_gemm.LORA_BLOCK_R, "GATHER_A": False}
    out.append(("grouped_mm_fwd[W^T]", "grouped_mm_fwd", grouped_gemm._grouped_mm_fwd_kernel, mm_sig,
                {"TRANS_W": True, **gemm_flags, **lora_off}, mm_aligned))
    out.append(("grouped_mm_fwd[W]", "grouped_mm_fwd", grouped_gemm._grouped_mm_fwd_kernel, mm_sig,
                {"TRANS_W": False, **gemm_flags, **lora_off}, mm_aligned))
    # LoRA adapters' up-projection in the epilogue (down_fwd_lora), both weight layouts; rank 16
    for trans, tag in ((True, "W^T"), (False, "W")):
        out.append((f"grouped_mm_fwd[{tag}+lora]", "grouped_mm_fwd", grouped_gemm._grouped_mm_fwd_kernel, mm_sig,
                    {"TRANS_W": trans, **gemm_flags, **lora_off, "LORA": True}, mm_aligned + ("RANK",)))
    # down_silu_bwd's input gradient: the output gradient's rows gathered in the A loads (pointer loads;
    # not on Intel, where down_silu_bwd keeps the block-pointer GEMMs over gathered rows)
    if not block_ptr:
        out.append(("grouped_mm_fwd[W+gather]", "grouped_mm_fwd", grouped_gemm._grouped_mm_fwd_kernel, mm_sig,
                    {"TRANS_W": False, **gemm_flags, **lora_off, "BLOCK_PTR": False, "GATHER_A": True}, mm_aligned))
    bwd_sig = {"a_ptr": act, "b_ptr": act, "idx_ptr": _P32, "cum_token_ptr": _P32, "dw_ptr": act,
               "M": _I32, "N": _I32}
    bwd_aligned = ("a_ptr", "b_ptr", "idx_ptr", "cum_token_ptr", "dw_ptr", "M", "N")
    out.append(("grouped_mm_bwd[rows]", "grouped_mm_bwd", grouped_gemm._grouped_mm_bwd_kernel, bwd_sig,
                {"GATHER": False, **gemm_flags, "GATHER_A": False}, bwd_aligned))
    out.append(("grouped_mm_bwd[gather]", "grouped_mm_bwd", grouped_gemm._grouped_mm_bwd_kernel, bwd_sig,
                {"GATHER": True, **gemm_flags, "GATHER_A": False}, bwd_aligned))
    # down_silu_bwd's weight gradient: the output gradient's rows gathered as the left operand (not on Intel)
    if not block_ptr:
        out.append(("grouped_mm_bwd[gather_a]", "grouped_mm_bwd", grouped_gemm._grouped_mm_bwd_kernel, bwd_sig,
                    {"GATHER": False, **gemm_flags, "BLOCK_PTR": False, "GATHER_A": True}, bwd_aligned))
    out.append(("silu_mul_bwd", "silu_mul_bwd", grouped_gemm._silu_mul_bwd_kernel, {
        "gate_up_ptr": act, "dh_ptr": act, "d_gate_up_ptr": act, "cum_token_ptr": _P32, "R": _I32, "I": _I32,
        "NR": _I32}, {"HAS_COUNTS": True},
        ("gate_up_ptr", "dh_ptr", "d_gate_up_ptr", "cum_token_ptr", "I")))
    # down_weighted_bwd after its input-gradient GEMM: h recomputed, router-weight dots, rows weighted,
    # w * h written for the weight gradient.
    # With SILU_BWD (down_silu_bwd): the SiLU*up gradient written instead of the scaled dh.
    for silu in (False, True):
        out.append((f"row_dot_scale{'[silu_bwd]' if silu else ''}", "row_dot_scale",
                    grouped_gemm._row_dot_scale_kernel, {
                        "dh_ptr": act, "gate_up_ptr": act, "rw_ptr": "*fp32", "cum_token_ptr": _P32,
                        "d_row_ptr": "*fp32", "hw_ptr": act, "d_gate_up_ptr": act, "R": _I32, "I": _I32,
                        "NR": _I32}, {"SILU_BWD": silu},
                    ("dh_ptr", "gate_up_ptr", "rw_ptr", "cum_token_ptr", "d_row_ptr", "hw_ptr", "d_gate_up_ptr",
                     "I")))
    comb_sig = {"y_ptr": act, "weights_ptr": act, "output_idx_ptr": _P32, "selected_ptr": _P32,
                "cum_expert_ptr": _P32, "out_ptr": act, "T": _I32, "H": _I32, "K": _I32}
    comb_aligned = ("y_ptr", "weights_ptr", "output_idx_ptr", "selected_ptr", "cum_expert_ptr", "out_ptr", "H", "K")
    out.append(("combine_fwd[weighted]", "combine_fwd", combine._combine_fwd_kernel, comb_sig, {"WEIGHTED": True},
                comb_aligned))
    out.append(("combine_fwd[sum]", "combine_fwd", combine._combine_fwd_kernel, comb_sig, {"WEIGHTED": False},
                comb_aligned))
    for write_dy in (True, False):  # without WRITE_DY: the rows' weights alone (down_silu_bwd)
        out.append((f"combine_bwd{'' if write_dy else '[row_weights]'}", "combine_bwd", combine._combine_bwd_kernel, {
            "dout_ptr": act, "weights_ptr": act, "output_idx_ptr": _P32, "selected_ptr": _P32,
            "cum_expert_ptr": _P32, "dy_ptr": act, "row_w_ptr": "*fp32", "T": _I32, "H": _I32, "K": _I32},
            {"WRITE_DY": write_dy},
            ("dout_ptr", "weights_ptr", "output_idx_ptr", "selected_ptr", "cum_expert_ptr", "dy_ptr", "row_w_ptr",
             "H", "K")))
    out.append(("router_weights_bwd", "router_weights_bwd", combine._router_weights_bwd_kernel, {
        "d_row_w_ptr": "*fp32", "output_idx_ptr": _P32, "selected_ptr": _P32, "cum_expert_ptr": _P32,
        "dweights_ptr": act, "T": _I32, "K": _I32}, {"BLOCK_K": K},
        ("d_row_w_ptr", "output_idx_ptr", "selected_ptr", "cum_expert_ptr", "dweights_ptr", "K")))
    if target == "cuda":
        out += _tma_variants(act, _P32, _I32)
    out += _int8_variants(act)
    if target == "cuda":  # fp8 dots: NVIDIA's OCP e4m3 / e5m2 (gfx942 has another fp8 encoding, PVC none)
        out += _fp8_variants(act) + _fp8_block_variants(act)
    return out


def _fp8_block_variants(act: str) -> list:
    """The block-scaled fp8 GEMMs (``expert_precision="fp8-block"``) as their launchers call them: the
    gate/up forward (x's rows gathered and quantized to e4m3 in the loads), the down forward (h made
    from ``gate_up`` in the loads), the input gradients (e5m2: the output gradient's rows gathered by
    token, ``d_gate_up``'s rows, both weight layouts, fp32 ``g`` or the activations' dtype out); the
    weight gradients (e5m2 gradient rows, plain or gathered, against e4m3 x rows gathered, SiLU*up
    times the router weights, or plain rows); the weights' block quantizer."""
    e4 = "*fp8e4nv"
    blk = fp8_block_gemm.BLOCK
    sig = {"a_ptr": act, "idx_ptr": _P32, "w_ptr": e4, "ws_ptr": "*fp32", "cum_token_ptr": _P32, "out_ptr": act,
           "N": _I32, "K": _I32, "stride_a": _I32, "SB0": _I32, "SB1": _I32}
    aligned = ("a_ptr", "idx_ptr", "w_ptr", "ws_ptr", "cum_token_ptr", "out_ptr", "N", "K", "stride_a")
    out = []
    for tag, mode, trans, grad, out_ty in (("gate_up", "gather", True, False, act), ("down:silu", "silu", True, False, act),
                                           ("down", "rows", True, False, act), ("down:W", "rows", False, False, act),
                                           ("dgrad:gather", "gather", False, True, "*fp32"),
                                           ("dgrad", "rows", False, True, act), ("dgrad:W^T", "rows", True, True, act)):
        out.append((f"fp8b_grouped_mm[{tag}]", fp8_block_gemm.KERNEL, fp8_block_gemm._fp8b_grouped_mm_kernel,
                    {**sig, "out_ptr": out_ty},
                    {"QB": blk, "A_MODE": mode, "TRANS_W": trans, "A_E5M2": grad, "ROUND_FIRST": False}, aligned))
    wsig = {"l_ptr": act, "l_idx_ptr": _P32, "r_ptr": act, "r_idx_ptr": _P32, "rw_ptr": "*fp32",
            "cum_token_ptr": _P32, "out_ptr": act, "M": _I32, "N": _I32, "stride_l": _I32, "stride_r": _I32}
    waligned = ("l_ptr", "l_idx_ptr", "r_ptr", "r_idx_ptr", "rw_ptr", "cum_token_ptr", "out_ptr", "M", "N",
                "stride_l", "stride_r")
    for tag, lg, rg, rs, left_grad in (("gate_up", False, True, False, True), ("down:silu", True, False, True, True),
                                       ("down", False, False, False, True), ("down:W^T", False, False, False, False)):
        out.append((f"fp8b_grouped_wgrad[{tag}]", fp8_block_gemm.WGRAD_KERNEL,
                    fp8_block_gemm._fp8b_grouped_wgrad_kernel, wsig,
                    {"QB": blk, "L_GATHER": lg, "R_GATHER": rg, "R_SILU": rs, "L_E5M2": left_grad,
                     "R_E5M2": not left_grad, "ROUND_FIRST": False}, waligned))
    out.append(("fp8b_weight", fp8_block_gemm.WEIGHT_KERNEL, fp8_block_gemm._fp8b_weight_kernel,
                {"w_ptr": act, "q_ptr": e4, "s_ptr": "*fp32", "D0": _I32, "D1": _I32, "SB0": _I32, "SB1": _I32},
                {"QB": blk, "ROUND_FIRST": False}, ("w_ptr", "q_ptr", "s_ptr", "D1")))
    return out


def _int8_variants(act: str) -> list:
    """The int8 grouped GEMMs (``expert_precision="int8"`` next to the Triton base) as their launchers
    call them: the gate/up forward (rows gathered, weight scales), the down forward and the input
    gradient (no column scales); the weight gradient in the stored layout (the gradient's scales
    first) and the transposed one."""
    sig = {"a_ptr": "*i8", "sa_ptr": "*fp32", "idx_ptr": _P32, "w_ptr": "*i8", "sw_ptr": "*fp32",
           "cum_token_ptr": _P32, "out_ptr": act, "N": _I32, "K": _I32}
    aligned = ("a_ptr", "sa_ptr", "idx_ptr", "w_ptr", "sw_ptr", "cum_token_ptr", "out_ptr", "N", "K")
    out = [(f"int8_grouped_mm[{tag}]", int8_gemm.KERNEL, int8_gemm._int8_grouped_mm_kernel, sig,
            {"TRANS_W": trans, "GATHER": gather, "HAS_SW": has_sw}, aligned)
           for tag, trans, gather, has_sw in (("W^T+gather", True, True, True), ("W^T", True, False, True),
                                              ("W", False, False, False))]
    wsig = {"l_ptr": "*i8", "sl_ptr": "*fp32", "r_ptr": "*i8", "sr_ptr": "*fp32", "cum_token_ptr": _P32,
            "out_ptr": act, "M": _I32, "N": _I32}
    waligned = ("l_ptr", "sl_ptr", "r_ptr", "sr_ptr", "cum_token_ptr", "out_ptr", "M", "N")
    out += [(f"int8_grouped_wgrad[{tag}]", int8_gemm.WGRAD_KERNEL, int8_gemm._int8_grouped_wgrad_kernel, wsig,
             {"LEFT_SCALE_FIRST": left}, waligned) for tag, left in (("W", True), ("W^T", False))]
    return out


def _fp8_variants(act: str) -> list:
    """The fp8 grouped GEMMs (``expert_precision="fp8"`` next to the Triton base) as their launchers
    call them: the gate/up forward (e4m3 rows gathered, weight scales), the down forward, the input
    gradient (e5m2 gradient codes against the e4m3 weight codes, both weight layouts); the weight
    gradients (e5m2 gradient codes against e4m3 input codes, stored by column with each expert's
    rows aligned) in both weight layouts."""
    e4, e5 = "*fp8e4nv", "*fp8e5"
    aligned = ("a_ptr", "sa_ptr", "idx_ptr", "w_ptr", "sw_ptr", "cum_token_ptr", "out_ptr", "N", "K")
    out = []
    for tag, a, trans, gather, has_sw in (("W^T+gather", e4, True, True, True), ("W^T", e4, True, False, True),
                                          ("W", e4, False, False, True), ("dgrad:W", e5, False, False, False),
                                          ("dgrad:W^T", e5, True, False, False)):
        sig = {"a_ptr": a, "sa_ptr": "*fp32", "idx_ptr": _P32, "w_ptr": e4, "sw_ptr": "*fp32",
               "cum_token_ptr": _P32, "out_ptr": act, "N": _I32, "K": _I32}
        out.append((f"fp8_grouped_mm[{tag}]", fp8_gemm.KERNEL, fp8_gemm._fp8_grouped_mm_kernel, sig,
                    {"TRANS_W": trans, "GATHER": gather, "HAS_SW": has_sw}, aligned))
    waligned = ("l_ptr", "sl_ptr", "r_ptr", "sr_ptr", "pcum_ptr", "out_ptr", "M", "N", "LD")
    for tag, left in (("W", True), ("W^T", False)):
        l_ty, r_ty = (e5, e4) if left else (e4, e5)
        wsig = {"l_ptr": l_ty, "sl_ptr": "*fp32", "r_ptr": r_ty, "sr_ptr": "*fp32", "pcum_ptr": _P32,
                "out_ptr": act, "M": _I32, "N": _I32, "LD": _I32}
        out.append((f"fp8_grouped_wgrad[{tag}]", fp8_gemm.WGRAD_KERNEL, fp8_gemm._fp8_grouped_wgrad_kernel, wsig,
                    {"LEFT_SCALE_FIRST": left, "ROW_ALIGN": fp8_gemm.ROW_ALIGN}, waligned))
    return out + _fp8_pass_variants(act)


def _fp8_pass_variants(act: str) -> list:
    """The fp8 path's quantization and row passes (``fp8q_*``, no matrix product) as their launchers
    call them on the GPU (the hardware's fp8 cast, no rounding in fp32 first): activations per row
    into e4m3 (the forward's x and h, h's routed rows only), gradients per row times their expert's
    weight scales into e5m2 (the input gradients), the weights per output channel in both stored
    layouts; the weight gradients' column codes of plain rows (e5m2), gathered rows and SiLU*up
    rows times the router weights (e4m3); SiLU*up and the router-weight dots."""
    e4, e5 = "*fp8e4nv", "*fp8e5"
    fmt = {e4: dict(QMAX=448.0, MANT=3, MIN_EXP=-6), e5: dict(QMAX=57344.0, MANT=2, MIN_EXP=-14)}
    rows_aligned = ("v_ptr", "idx_ptr", "cs_ptr", "cum_token_ptr", "q_ptr", "s_ptr", "L")
    out = []
    # rows:dgrad+gather: the fused down backward's output-gradient rows, read by token
    for tag, key, v_ty, q_ty, cols, has_cs, routed, gather in (
            ("rows:x", "fp8q_rows", act, e4, False, False, False, False),
            ("rows:h", "fp8q_rows", act, e4, False, False, True, False),
            ("rows:dgrad", "fp8q_rows", act, e5, False, True, True, False),
            ("rows:dgrad+gather", "fp8q_rows", act, e5, False, True, True, True),
            ("wcols", "fp8q_wcols", act, e4, True, False, False, False)):
        sig = {"v_ptr": v_ty, "idx_ptr": _P32, "cs_ptr": "*fp32", "cum_token_ptr": _P32, "q_ptr": q_ty,
               "s_ptr": "*fp32", "C": _I32, "L": _I32, "NR": _I32}
        out.append((f"fp8q_{'wcols' if cols else 'rows'}[{tag}]", key, fp8_gemm._fp8q_rows_kernel, sig,
                    {**fmt[q_ty], "ROUND_FIRST": False, "COLS": cols, "HAS_CS": has_cs, "ROUTED_ONLY": routed,
                     "GATHER": gather},
                    rows_aligned if not cols else rows_aligned[:-1] + ("C",)))
    csig = {"v_ptr": act, "idx_ptr": _P32, "rw_ptr": "*fp32", "cum_token_ptr": _P32, "pcum_ptr": _P32, "q_ptr": e4,
            "s_ptr": "*fp32", "N": _I32, "LD": _I32, "NR": _I32, "stride_v": _I32}
    caligned = ("v_ptr", "idx_ptr", "rw_ptr", "cum_token_ptr", "pcum_ptr", "q_ptr", "s_ptr", "N", "LD", "stride_v")
    for tag, q_ty, gather, silu in (("grad", e5, False, False), ("grad+gather", e5, True, False),
                                    ("gather", e4, True, False), ("silu", e4, False, True)):
        out.append((f"fp8q_cols[{tag}]", "fp8q_cols", fp8_gemm._fp8q_cols_kernel, {**csig, "q_ptr": q_ty},
                    {**fmt[q_ty], "ROUND_FIRST": False, "GATHER": gather, "SILU": silu, "ROW_W": silu,
                     "WRITE_PCUM": q_ty == e5, "ROW_ALIGN": fp8_gemm.ROW_ALIGN}, caligned))
    # the fused fp8 forward: h's codes made from gate_up, h never written
    out.append(("fp8q_rows[silu]", "fp8q_rows", fp8_gemm._fp8q_silu_rows_kernel, {
        "gate_up_ptr": act, "h_like_ptr": act, "cum_token_ptr": _P32, "q_ptr": e4, "s_ptr": "*fp32", "C": _I32,
        "L": _I32, "NR": _I32}, {**fmt[e4], "ROUND_FIRST": False},
        ("gate_up_ptr", "h_like_ptr", "cum_token_ptr", "q_ptr", "s_ptr", "L")))
    out.append(("fp8q_silu_mul", "fp8q_silu_mul", fp8_gemm._fp8q_silu_mul_kernel, {
        "gate_up_ptr": act, "h_ptr": act, "cum_token_ptr": _P32, "R": _I32, "I": _I32, "NR": _I32},
        {"ROUND_FIRST": False},
        ("gate_up_ptr", "h_ptr", "cum_token_ptr", "I")))
    for silu_bwd in (False, True):  # with SILU_BWD: the fused down backward's SiLU*up gradient
        out.append((f"fp8q_row_dot{'[silu_bwd]' if silu_bwd else ''}", "fp8q_row_dot", fp8_gemm._fp8q_row_dot_kernel, {
            "g_ptr": "*fp32", "gate_up_ptr": act, "rw_ptr": "*fp32", "cum_token_ptr": _P32, "dh_ptr": act,
            "d_row_ptr": "*fp32", "R": _I32, "I": _I32, "NR": _I32}, {"ROUND_FIRST": False, "SILU_BWD": silu_bwd},
            ("g_ptr", "gate_up_ptr", "rw_ptr", "cum_token_ptr", "dh_ptr", "d_row_ptr", "I")))
    return out


def _desc(dtype: str, *box: str):
    """The signature type of a TMA descriptor argument whose box is ``box`` (names of tile constexprs
    or numbers), resolved against each config's tiles."""
    return lambda meta: f"tensordesc<{dtype}[{','.join(str(meta.get(b, b)) for b in box)}]>"


def _tma_variants(act: str, p32: str, i32: str) -> list:
    """The persistent TMA kernels (sm_90+ only: the ``triton_tma`` engine runs on NVIDIA GPUs)."""
    dt = act.lstrip("*")
    flags = {"DOT_PRECISION": "ieee"}
    out: list = []
    out.append(("tma_gate_up_fwd", "tma_gate_up_fwd", tma_gemm._tma_gate_up_fwd_kernel, {
        "x_ptr": act, "input_idx_ptr": p32, "cum_token_ptr": p32, "w_desc": _desc(dt, 1, "BLOCK_N", "BLOCK_K"),
        "g_desc": _desc(dt, "BLOCK_M", "BLOCK_N"), "u_desc": _desc(dt, "BLOCK_M", "BLOCK_N"),
        "h_desc": _desc(dt, "BLOCK_M", "BLOCK_N"), "gate_up_ptr": act, "h_ptr": act, "H": i32, "I": i32,
        "NR": i32}, dict(flags), ("x_ptr", "input_idx_ptr", "cum_token_ptr", "gate_up_ptr", "h_ptr", "H", "I")))
    for trans, tag, box in ((True, "W^T", (1, "BLOCK_N", "BLOCK_K")), (False, "W", (1, "BLOCK_K", "BLOCK_N"))):
        out.append((f"tma_grouped_mm[{tag}]", "tma_grouped_mm", tma_gemm._tma_grouped_mm_kernel, {
            "a_desc": _desc(dt, "BLOCK_M", "BLOCK_K"), "w_desc": _desc(dt, *box), "cum_token_ptr": p32,
            "out_desc": _desc(dt, "BLOCK_M", "BLOCK_N"), "out_ptr": act, "N": i32, "K": i32, "NR": i32},
            {"TRANS_W": trans, **flags}, ("cum_token_ptr", "out_ptr", "N", "K")))
    rows_b = _desc(dt, "BLOCK_K", "BLOCK_N")
    for name, gather in (("tma_grouped_mm_bwd[rows]", False), ("tma_grouped_mm_bwd[gather]", True)):
        a_desc = _desc(dt, "BLOCK_K", "BLOCK_M")
        out.append((name, "tma_grouped_mm_bwd", tma_gemm._tma_wgrad_kernel, {
            "a_desc": a_desc, "b_desc": a_desc if gather else rows_b,
            "b_ptr": act, "idx_ptr": p32, "cum_token_ptr": p32,
            "dw_desc": _desc(dt, 1, "BLOCK_M", "BLOCK_N"), "M": i32, "N": i32, "NR": i32},
            {"GATHER": gather, **flags}, ("b_ptr", "idx_ptr", "cum_token_ptr", "M", "N")))
    return out


def kernel_specs(target: str) -> list[KernelSpec]:
    """Every (kernel variant, config) to compile for ``target`` in ``"cuda"``, ``"sm100"``, ``"hip"``,
    ``"xpu"``; the config lists come from ``configs.py``'s table of that name (``xpu`` variants load
    ``tl.dot`` operands through block pointers, as the XPU launchers do; ``sm100`` compiles
    ``cuda``'s variants)."""
    if target not in (*NVIDIA_TARGETS, "hip", "xpu"):
        raise ValueError(f"target must be 'cuda', 'sm100', 'hip' or 'xpu', got {target!r}")
    specs = []
    for name, key, kernel, signature, constexprs, aligned in _variants("cuda" if target in NVIDIA_TARGETS else target):
        for i, cfg in enumerate(configs(target, key)):
            cexpr = {**cfg.meta, **constexprs}
            sig = {k: v(cfg.meta) if callable(v) else v for k, v in signature.items()}
            sig.update({k: "constexpr" for k in cexpr})
            specs.append(KernelSpec(
                name=name, fn=_jit(kernel), signature=sig, constexprs=cexpr, config_name=cfg.name,
                num_warps=cfg.num_warps, num_stages=cfg.num_stages, is_default=i == 0,
                extra_options=dict(cfg.extra_options), divisible_by_16=tuple(aligned),
            ))
    return specs
