"""Providers: the same expert layer computed four ways, built from one :class:`~bench.harness.cases.Case`.

- ``hf_v4``: transformers-4-style block (``bench.harness.baselines.HFv4SparseMoeBlock``): a ``ModuleList`` of
  per-expert MLPs looped with masks, ``index_add_`` to combine.
- ``hf_v5_eager`` / ``hf_v5_grouped_mm`` (/ ``hf_v5_batched_mm``, when named): transformers v5's own
  ``OlmoeExperts`` with ``config._experts_implementation`` set to ``"eager"``, ``"grouped_mm"`` (v5's
  default) or ``"batched_mm"``;
  local slices (EP > 1) run as transformers' ``AllToAllEP`` (its training path) runs a rank's
  experts: top-1 on the rank's (token, expert) rows, the weighted sum per token after; only the
  all-to-all itself is left out, as every provider's communication is.
- ``liger``: Liger-Kernel's fused MoE (``liger_kernel.ops.fused_moe.LigerFusedMoEFunction``), the same
  ``[E, 2I, H]`` / ``[E, H, I]`` weights and the case's routing; ``sonicmoe``: SonicMoE's
  ``moe_general_routing_inputs`` on the same routing. Neither is in the default list; each reports in one
  line why it cannot run where its package is missing or cannot take the case.
- ``fastmoe/<backend>``: stages 2-5 of FastSparseMoeBlock (``block.moe_experts_forward``) on each
  kernel backend, stage 4 on the engine ``--gemm-engine`` names (default ``auto``: the timed choice,
  named in the provider's note); ``fastmoe/<backend>@<engine>``: the same with stage 4 on one
  grouped-GEMM engine (``triton``, ``grouped_mm``, ``loop``), so each engine is reported apart.

Every provider maps ``(x [T, H], weights [T, K], topk_idx [T, K]) -> out [T, H]``, differentiable in
x, the weights and the expert parameters. The expert parameters are the case's tensors (v4's
per-expert ``nn.Linear`` weights are views of them: same values, same contiguous layout), so no
provider pays for a copy and all start from identical weights.

Legend: T tokens, H hidden, I intermediate, E experts, K experts per token, NR local experts.
"""
from __future__ import annotations

import importlib
import importlib.metadata
import os
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Callable

import torch
import torch.nn as nn

from fastmoe_xpu.autograd.moe_experts import moe_experts_forward
from fastmoe_xpu.kernels import registry

from .baselines import HFv4SparseMoeBlock
from .cases import Case

HF_PROVIDERS = ("hf_v4", "hf_v5_eager", "hf_v5_grouped_mm")
FASTMOE_BACKENDS = ("torch", "triton")
ALL_PROVIDERS = HF_PROVIDERS + tuple(f"fastmoe/{b}" for b in FASTMOE_BACKENDS)
#: transformers' other experts implementation (batched over tokens: each token's K experts' weights
#: gathered, no offsets, so it computes every selected row even where grouped_mm would skip none):
#: its choice for decode; named on request, not in the default list.
NAMED_PROVIDERS = ("hf_v5_batched_mm",)
#: Other projects' MoE layers, fed the case's routing (named on request, not in the default list).
EXTERNAL_PROVIDERS = ("liger", "sonicmoe")
REFERENCE = "hf_v4"


class ProviderSkipped(Exception):
    """A provider that cannot run here; the message says why (it is reported, never dropped)."""


@dataclass
class Provider:
    name: str
    forward: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
    params: list[nn.Parameter]
    merged_grads: Callable[[], tuple[torch.Tensor, torch.Tensor]]
    note: str = ""
    keep: list = field(default_factory=list)  # modules the closures use
    precision: str | None = None
    """Quantized expert GEMMs (``"int8"``, ``"fp8"``): checked against the reference with that
    precision's tolerance."""
    state: Callable[[], dict] | None = None
    """What the provider tells of itself after its rounds (``auto``: its choice in use, whether it was
    trusted, the calls it saw and the re-timings among them), recorded beside its times."""

    def zero_grads(self) -> None:
        for p in self.params:
            p.grad = None


def default_fastmoe(device: torch.device) -> str:
    """The fastmoe provider the speedups are quoted for: the backend ``auto`` picks on ``device``."""
    return "fastmoe/triton" if torch.device(device).type in ("cuda", "xpu") else "fastmoe/torch"


def expand_names(names: list[str] | None) -> list[str]:
    """``fastmoe`` stands for every backend; default: all providers."""
    if not names:
        return list(ALL_PROVIDERS)
    out: list[str] = []
    for n in names:
        base, colon, precision = n.partition(":")
        if colon:
            if not base.startswith("fastmoe/") or precision not in registry.PRECISIONS:
                raise ValueError(f"unknown provider {n!r}; quantized providers are fastmoe/<backend>:<precision> "
                                 f"with precision in {tuple(registry.PRECISIONS)}")
            expand_names([base])
            out.append(n)
        elif n == "fastmoe":
            out.extend(f"fastmoe/{b}" for b in FASTMOE_BACKENDS)
        elif n in ALL_PROVIDERS or n in EXTERNAL_PROVIDERS or n in NAMED_PROVIDERS:
            out.append(n)
        elif n.startswith("fastmoe/") and "@" in n:
            backend, engine = n[len("fastmoe/"):].split("@", 1)
            if backend not in FASTMOE_BACKENDS or engine not in registry.ENGINES:
                raise ValueError(f"unknown provider {n!r}; engine providers are fastmoe/<backend>@<engine> with "
                                 f"backend in {FASTMOE_BACKENDS} and engine in {registry.ENGINES}")
            out.append(n)
        else:
            raise ValueError(f"unknown provider {n!r}; known: {list(ALL_PROVIDERS + NAMED_PROVIDERS + EXTERNAL_PROVIDERS)} "
                             "or 'fastmoe'")
    if REFERENCE not in out:
        out.insert(0, REFERENCE)  # correctness is judged against it
    return list(dict.fromkeys(out))


def with_precisions(names: list[str], precisions: list[str]) -> list[str]:
    """``names`` with ``<fastmoe provider>:<precision>`` after each plain fastmoe provider for every
    precision other than ``none``; without ``none`` the plain fastmoe providers are left out."""
    out: list[str] = []
    for n in names:
        if not n.startswith("fastmoe/") or ":" in n:
            out.append(n)
            continue
        out.extend(n if p == "none" else f"{n}:{p}" for p in precisions)
    return list(dict.fromkeys(out))


def build_provider(name: str, case: Case, gemm_engine: str = "auto") -> Provider:
    """Build ``name`` on ``case``; raises :class:`ProviderSkipped` with the reason when it cannot run.
    ``gemm_engine``: stage 4's engine for the plain ``fastmoe/<backend>`` providers."""
    if name == "hf_v4":
        return _hf_v4(case)
    if name in ("hf_v5_eager", "hf_v5_grouped_mm", "hf_v5_batched_mm"):
        return _hf_v5(case, name.split("_", 2)[2])
    if name == "liger":
        return _liger(case)
    if name == "sonicmoe":
        return _sonicmoe(case)
    if name.startswith("fastmoe/"):
        spec, _, precision = name.split("/", 1)[1].partition(":")
        backend, _, engine = spec.partition("@")
        return _fastmoe(case, backend, engine or gemm_engine, name, precision or None)
    raise ValueError(f"unknown provider {name!r}")


# ---------------------------------------------------------------- hf_v4
def _hf_v4(case: Case) -> Provider:
    p = case.preset
    I, NR = p.intermediate, p.local_experts
    cfg = SimpleNamespace(hidden_size=p.hidden, intermediate_size=I, num_experts=NR,
                          num_experts_per_tok=p.top_k, norm_topk_prob=False)
    with torch.device("meta"):
        block = HFv4SparseMoeBlock(cfg)
    gu, dn = case.w_gate_up_N2IH.detach(), case.w_down_NHI.detach()
    params: list[nn.Parameter] = []
    for e, m in enumerate(block.experts):
        m.gate_proj.weight = nn.Parameter(gu[e, :I])
        m.up_proj.weight = nn.Parameter(gu[e, I:])
        m.down_proj.weight = nn.Parameter(dn[e])
        params += [m.gate_proj.weight, m.up_proj.weight, m.down_proj.weight]
    global_experts = p.experts

    def forward(x_TH, weights_TK, idx_TK):
        return block.experts_forward(x_TH, weights_TK, idx_TK, num_experts=global_experts)

    def merged_grads():
        def g(w):
            return w.grad if w.grad is not None else torch.zeros_like(w)
        gate_up = torch.stack([torch.cat([g(m.gate_proj.weight), g(m.up_proj.weight)]) for m in block.experts])
        down = torch.stack([g(m.down_proj.weight) for m in block.experts])
        return gate_up, down

    return Provider("hf_v4", forward, params, merged_grads, "per-expert nn.Linear loop (transformers v4 style)", [block])


# ---------------------------------------------------------------- hf_v5
def _hf_v5(case: Case, impl: str) -> Provider:
    try:
        import transformers
        from transformers import OlmoeConfig
        from transformers.models.olmoe.modeling_olmoe import OlmoeExperts
    except Exception as exc:  # transformers missing or too old for merged experts
        raise ProviderSkipped(f"transformers v5 (OlmoeExperts) not importable: {exc}") from None
    version = transformers.__version__
    if int(version.split(".")[0]) < 5:
        raise ProviderSkipped(f"transformers {version} installed; hf_v5_* need transformers >= 5")
    if impl != "eager":
        try:
            from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS
        except Exception as exc:
            raise ProviderSkipped(f"transformers {version} has no experts interface: {exc}") from None
        if impl not in ALL_EXPERTS_FUNCTIONS:
            raise ProviderSkipped(f"transformers {version} has no '{impl}' experts implementation")
    p = case.preset
    NR = p.local_experts
    cfg = OlmoeConfig(hidden_size=p.hidden, intermediate_size=p.intermediate, num_experts=NR,
                      num_experts_per_tok=p.top_k, norm_topk_prob=False)
    cfg._experts_implementation = impl
    with torch.device("meta"):
        experts = OlmoeExperts(cfg)
    experts.gate_up_proj = case.w_gate_up_N2IH
    experts.down_proj = case.w_down_NHI
    sharded = NR < p.experts
    K = p.top_k
    note = f"transformers {version}, experts_implementation={impl!r}"
    if impl == "grouped_mm":
        note += f" ({_grouped_mm_path(case)})"
    if sharded:
        note += "; local slice as transformers' AllToAllEP computes it in training, less the all-to-all"

    def forward(x_TH, weights_TK, idx_TK):
        if not sharded:
            return experts(x_TH, idx_TK, weights_TK)
        # transformers' AllToAllEP (its training path): this rank's experts run top-1 with unit
        # weights on the (token, expert) rows the all-to-all delivers, sorted by expert; the
        # results are weighted and summed per token on the way back. Rank 0 holds experts [0, NR).
        T, H = x_TH.shape
        flat = idx_TK.reshape(-1)
        slots = torch.nonzero(flat < NR).squeeze(1)
        slots = slots[torch.argsort(flat[slots], stable=True)]
        tok = slots // K
        rows = experts(x_TH[tok], flat[slots].unsqueeze(1), x_TH.new_ones(slots.numel(), 1))
        return x_TH.new_zeros(T, H).index_add(0, tok, rows * weights_TK.reshape(-1)[slots].unsqueeze(1))

    def merged_grads():
        return tuple(w.grad if w.grad is not None else torch.zeros_like(w)
                     for w in (case.w_gate_up_N2IH, case.w_down_NHI))

    return Provider(f"hf_v5_{impl}", forward, [case.w_gate_up_N2IH, case.w_down_NHI], merged_grads, note, [experts])


def _grouped_mm_path(case: Case) -> str:
    """Which grouped GEMM transformers' grouped_mm will call here (torch's kernel or its own loop)."""
    try:
        from transformers.integrations import moe
        offs = torch.zeros(case.preset.local_experts, dtype=torch.int32, device=case.device)
        x = case.x_TH[:1]
        if moe._can_use_grouped_mm(x, case.w_gate_up_N2IH, offs):
            return "torch.nn.functional.grouped_mm" if hasattr(torch.nn.functional, "grouped_mm") else "torch._grouped_mm"
        return "transformers' grouped_mm fallback loop"
    except Exception:  # private helper moved: not worth failing the run over a label
        return "grouped GEMM path unknown"


# ---------------------------------------------------------------- other projects
def _whole_layer_only(case: Case, who: str) -> None:
    """Raise :class:`ProviderSkipped` for a local slice (EP > 1): ``who`` computes every expert the routing
    names on one device, so it cannot run a rank's share the way the other providers do."""
    p = case.preset
    if p.local_experts < p.experts:
        raise ProviderSkipped(f"{who} computes every expert the routing names on one device; this case is one "
                              f"rank's slice ({p.local_experts} of {p.experts} experts, EP={p.ep})")


def _modules(names: tuple[str, ...], what: str, install: str) -> list:
    """The modules ``names``, or :class:`ProviderSkipped` naming ``what`` could not be imported and
    how to install it."""
    try:
        return [importlib.import_module(n) for n in names]
    except Exception as exc:
        raise ProviderSkipped(f"{what} not importable ({type(exc).__name__}: {exc}); {install}") from None


def _version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:  # imported from a path, not installed
        return "unknown version"


def _interpreted() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def _liger(case: Case) -> Provider:
    """Liger-Kernel's fused MoE on the case's tensors. On a GPU its Triton autotuner picks each kernel's
    config (unless ``LIGER_FUSED_MOE_AUTOTUNE=0`` was set before it was imported: one pinned config); on
    the CPU it runs only under ``TRITON_INTERPRET=1``, with the pinned config (the autotuner times
    configs on a GPU)."""
    _whole_layer_only(case, "Liger's fused MoE")
    on_cpu = case.device.type == "cpu"
    if on_cpu:
        if not _interpreted():
            raise ProviderSkipped("Liger's fused MoE is Triton kernels: on the CPU they run only under "
                                  "TRITON_INTERPRET=1, set before Python starts (a correctness check, not a benchmark)")
        os.environ.setdefault("LIGER_FUSED_MOE_AUTOTUNE", "0")  # read when liger_kernel is imported
    fused, kernels = _modules(("liger_kernel.ops.fused_moe", "liger_kernel.ops.fused_moe_kernels"), "liger_kernel",
                              "pip install liger-kernel (the bench extra has it)")
    pinned = bool(getattr(kernels, "_AUTOTUNE_DISABLED", False))
    if on_cpu and not pinned:
        raise ProviderSkipped("liger_kernel was imported with its autotuner on, which times configs on a GPU: "
                              "set LIGER_FUSED_MOE_AUTOTUNE=0 before it is imported")
    version = _version("liger-kernel")
    fn = fused.LigerFusedMoEFunction
    w_gu, w_d = case.w_gate_up_N2IH, case.w_down_NHI

    def forward(x_TH, weights_TK, idx_TK):
        # Its kernels read int32 expert indices; the conversion is what a caller with torch.topk's
        # int64 indices pays, so it stays in the timed call.
        return fn.apply(x_TH, w_gu, w_d, idx_TK.to(torch.int32), weights_TK)

    def merged_grads():
        return tuple(w.grad if w.grad is not None else torch.zeros_like(w) for w in (w_gu, w_d))

    configs = "one pinned config (LIGER_FUSED_MOE_AUTOTUNE=0)" if pinned else "configs chosen by its autotuner"
    return Provider("liger", forward, [w_gu, w_d], merged_grads,
                    f"Liger-Kernel {version} LigerFusedMoEFunction, {configs}")


def _sonicmoe(case: Case) -> Provider:
    """SonicMoE's layer on precomputed routing (``sonicmoe.functional.moe_general_routing_inputs``): its
    weights are ``w1 [2I, H, E]`` with gate and up rows interleaved and ``w2 [H, I, E]``, both stored
    expert-major, so the provider keeps its own copies of the case's weights in that layout (made once,
    untimed) and maps their gradients back for the check."""
    _whole_layer_only(case, "SonicMoE's layer")
    if case.device.type != "cuda":
        raise ProviderSkipped(f"SonicMoE runs on NVIDIA Hopper and Blackwell GPUs only, not on {case.device.type}")
    functional, enums = _modules(("sonicmoe.functional", "sonicmoe.enums"), "sonicmoe",
                                 "it needs pip install sonic-moe with its CUTLASS DSL packages and a torch it supports")
    NR, I2, H = case.w_gate_up_N2IH.shape
    I = I2 // 2
    T, K = case.topk_idx_TK.shape
    with torch.no_grad():
        gu = case.w_gate_up_N2IH.detach()
        inter = torch.stack([gu[:, :I], gu[:, I:]], dim=2).reshape(NR, I2, H)  # gate0, up0, gate1, up1, ...
        w1 = nn.Parameter(inter.permute(1, 2, 0))                # [2I, H, E], E the slowest-moving dim
        w2 = nn.Parameter(case.w_down_NHI.detach().clone().permute(1, 2, 0))  # [H, I, E]
    tokens = torch.arange(T, device=case.device, dtype=torch.int32).repeat_interleave(K)  # sorted, as it requires
    swiglu = enums.ActivationType.SWIGLU

    def forward(x_TH, weights_TK, idx_TK):
        out = functional.moe_general_routing_inputs(
            x_TH, weights_TK.reshape(-1), tokens, idx_TK.reshape(-1).to(torch.int32), w1, None, w2, None, NR,
            torch.cuda.current_stream().cuda_stream, swiglu)
        return out[0] if isinstance(out, tuple) else out

    def merged_grads():
        g1 = w1.grad if w1.grad is not None else torch.zeros_like(w1)
        g2 = w2.grad if w2.grad is not None else torch.zeros_like(w2)
        g1 = g1.permute(2, 0, 1).reshape(NR, I, 2, H)
        return torch.cat([g1[:, :, 0], g1[:, :, 1]], dim=1), g2.permute(2, 0, 1)

    version = _version("sonic-moe")
    return Provider("sonicmoe", forward, [w1, w2], merged_grads,
                    f"SonicMoE {version} moe_general_routing_inputs on the case's routing")


# ---------------------------------------------------------------- fastmoe
def _fastmoe(case: Case, backend: str, gemm_engine: str = "native", name: str | None = None,
             precision: str | None = None) -> Provider:
    dev = case.device.type
    if backend == "triton":
        if dev not in ("cuda", "xpu"):
            raise ProviderSkipped(
                f"the Triton backend needs a GPU (cuda or xpu); on {dev} it runs only in the "
                "interpreter, which is a correctness tool, not a benchmark"
            )
        try:
            importlib.import_module("fastmoe_xpu.kernels.triton")
        except Exception as exc:
            raise ProviderSkipped(f"fastmoe_xpu.kernels.triton not importable: {exc}") from None
    elif backend != "torch":
        raise ValueError(f"unknown fastmoe backend {backend!r}")
    w_gu, w_d = case.w_gate_up_N2IH, case.w_down_NHI
    name = name or f"fastmoe/{backend}"
    registry.check_choice(gemm_engine)
    if gemm_engine in registry.ENGINES:
        reason = registry.unavailable_reason(gemm_engine, backend, case.device, case.x_TH.dtype)
        if reason is not None:
            raise ProviderSkipped(f"{gemm_engine} engine: {reason}")
    note = f"FastSparseMoE stages 2-5, {backend} backend, {gemm_engine} GEMM engine"
    state = None
    if precision is not None:
        try:
            engine = registry.precision_engine(precision, backend, case.device, case.x_TH.dtype)
        except RuntimeError as exc:
            raise ProviderSkipped(str(exc)) from None
        note = (f"FastSparseMoE stages 2-5, {backend} backend, expert GEMMs quantized to {precision} "
                f"({engine} implementation)")
    elif gemm_engine == "auto":
        # Take the timed choices now (one call each primes them; the cache makes them a lookup next time),
        # so that the report says which engine 'auto' is: a call with a backward to come (training) and
        # one without (inference), which may take another engine untimed.
        with torch.no_grad():
            moe_experts_forward(case.x_TH, case.weights_TK, case.topk_idx_TK, w_gu, w_d, backend=backend,
                                expert_start=0, gemm_engine="auto")
        with torch.enable_grad():
            moe_experts_forward(case.x_TH.detach().requires_grad_(), case.weights_TK, case.topk_idx_TK, w_gu, w_d,
                                backend=backend, expert_start=0, gemm_engine="auto")
        T, K = case.topk_idx_TK.shape
        layer = registry.whole_layer(backend, "auto", case.device, case.x_TH.dtype,
                                     (T, K, w_gu.shape[2], w_d.shape[2], w_gu.shape[0]))
        if layer is not None:  # a small layer: stages 2-5 in one op, no stage-4 engine to choose
            chosen = f"{layer} experts op (stages 2-5 in one piece)"
        else:
            shape = (w_gu.shape[2], w_d.shape[2], w_gu.shape[0], case.topk_idx_TK.numel())
            # the in-process timed choice; else (FASTMOE_GEMM_ENGINE names one) the engine auto resolves to
            chosen = registry.chosen_for(backend, case.device, case.x_TH.dtype, shape) or registry.choose_engine(
                "auto", backend=backend, device=case.device, dtype=case.x_TH.dtype, shape=shape)
            infer = registry.chosen_for(backend, case.device, case.x_TH.dtype, shape, inference=True)
            if infer is not None and infer != chosen:
                chosen = f"{chosen} (forward calls without a backward: {infer})"
        note = f"FastSparseMoE stages 2-5, {backend} backend, GEMM engine auto -> {chosen}"
        if layer is None:
            state = _auto_state(backend, case, shape)

    def forward(x_TH, weights_TK, idx_TK):
        return moe_experts_forward(x_TH, weights_TK, idx_TK, w_gu, w_d, backend=backend, expert_start=0,
                                   gemm_engine=gemm_engine, expert_precision=precision)

    def merged_grads():
        return tuple(w.grad if w.grad is not None else torch.zeros_like(w) for w in (w_gu, w_d))

    return Provider(name, forward, [w_gu, w_d], merged_grads, note, precision=precision, state=state)


def _auto_state(backend: str, case: Case, shape: tuple[int, int, int, int]) -> Callable[[], dict] | None:
    """The ``auto`` provider's report after its rounds (None: no watched choice): a choice re-timed while
    it was measured ran its candidates' timings inside some samples, which a time beside the chosen
    engine's own shows."""
    watch = registry.watch_for(backend, case.device, case.x_TH.dtype, shape)
    if watch is None:
        return None
    calls0, retimes0, seen = watch.calls, watch.retimes, len(watch.history)  # the history holds its first timing

    def state() -> dict:
        return {"engine": watch.engine, "inference_engine": watch.inference_engine, "trusted": watch.trusted,
                "forward_calls": watch.calls - calls0, "retimes": watch.retimes - retimes0,
                "history": [f"call {c}: {what}" for c, what in watch.history[seen:]]}

    return state
