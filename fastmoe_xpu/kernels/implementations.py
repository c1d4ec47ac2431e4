"""The implementation table: which kernels can run stages 2-5, declared in one place, and the kernel sets built from it.

Each :class:`Implementation` names the stages it provides (``route``: counting and index generation,
stages 2-3; ``gemm``: the grouped GEMMs of stage 4; ``combine``: stage 5; ``experts``: stages 2-5 in
one piece, for the layers it suits), the device types and
dtypes it runs on, and the module holding its launchers (:class:`.contract.KernelBackend` methods).
Adding an implementation (another GEMM engine, a low-precision or adapter variant) is one new entry
in :data:`IMPLEMENTATIONS` plus its launcher module; nothing else is edited.

========  ======================  ===============================================================
name      stages                  runs
========  ======================  ===============================================================
torch     route, gemm, combine    plain PyTorch, any device (the CPU's kernels); its gemm is ``loop``
triton    route, gemm, combine    Triton kernels: xpu, cuda, and CPU tensors under TRITON_INTERPRET=1
loop      gemm                    one ``torch.mm`` per expert (``kernels/torch/grouped_gemm.py``)
grouped_mm  gemm                  PyTorch's grouped GEMM (``kernels/grouped_mm.py``)
onednn    gemm                    the loop on oneDNN's matmul instead of MKL's, CPU, float32
                                  (``kernels/torch/onednn.py``)
int8      gemm (precision)        quantized int8 GEMMs, ``torch._int_mm`` (``kernels/quantized``)
fp8       gemm (precision)        quantized fp8 GEMMs (e4m3 forward, e5m2 gradients), ``torch._scaled_mm``
triton_tma  gemm                  persistent TMA grouped GEMMs for sm_90+ (``kernels/triton/tma_gemm.py``);
                                  CPU tensors only under TRITON_INTERPRET=1, never timed there
decode    experts                 a matrix-vector product per chosen expert and projection, next to
                                  the torch base on the CPU for one token whose K choices are at most
                                  the local experts (``kernels/torch/decode.py``): decoding one
                                  sequence
padded    experts                 each expert's rows in a zero-padded block, one batched GEMM per
                                  projection, next to the torch base on the CPU for layers under its
                                  budget (``kernels/torch/padded.py``): small layers, where launches
                                  dominate
========  ======================  ===============================================================

An *experts* entry replaces the whole chain for the layers it suits (:func:`.registry.whole_layer`): the
fused path of a layer whose ``gemm_engine`` is ``auto`` takes the first available one whose
``max_layer_macs`` holds the layer's work ``max(T * K, NR) * 3 * H * I`` (:func:`.registry.layer_macs`: the
routed rows, or one row per local expert where there are fewer, as in decoding); a named engine
always runs the staged chain.

A *precision* entry (``int8``, ``fp8``) is a stage-4 implementation that changes the numbers, not
only the speed: ``gemm_engine`` and ``auto`` never pick it; a block's ``expert_precision`` does
(:func:`.registry.precision_engine`), and its kernel set is named like any other (``"torch+int8"``).

A *kernel set* is a base implementation (``torch`` or ``triton``: stages 2, 3 and 5, and its native
stage 4) with an optional other stage-4 implementation: its name is ``"<base>"`` or
``"<base>+<gemm>"`` (``"torch+grouped_mm"``). :func:`kernels` turns a name into the launchers; the
name is what the experts op (:mod:`fastmoe_xpu.autograd.ops`) carries, so a compiled graph holds a
string, never a module.

Which set runs a layer is chosen by :mod:`.registry` (:func:`.registry.select`), which re-exports these names.
"""
from __future__ import annotations

import functools
import importlib
import os
from dataclasses import dataclass
from types import ModuleType
from typing import Callable, Mapping

import torch

from .. import settings
from .contract import FUSED_LAUNCHERS, LAUNCHERS, STAGE4_LAUNCHERS, KernelBackend
from .timing import apart_from_caller

#: The stages an implementation may provide, and the launchers each stage consists of.
STAGES: Mapping[str, tuple[str, ...]] = {
    "route": ("count_tokens", "build_indices"),
    "gemm": STAGE4_LAUNCHERS,
    "combine": ("combine_fwd", "combine_bwd", "router_weights_bwd"),
    "experts": ("experts_forward", "experts_backward"),
}
_FLOATS = (torch.float32, torch.bfloat16, torch.float16)


@functools.lru_cache(maxsize=1)
def _triton_available() -> bool:
    """Whether triton is installed (looked up once: every layer call on the Triton backend asks)."""
    return importlib.util.find_spec("triton") is not None


def triton_interpreting() -> bool:
    # Triton's own switch, read where Triton reads it (not a FASTMOE_* setting).
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def _triton_reason(device: torch.device, dtype: torch.dtype) -> str | None:
    if not _triton_available():
        return "the triton package is not installed"
    if device.type == "cpu" and not triton_interpreting():
        return "Triton kernels on CPU tensors need TRITON_INTERPRET=1"
    return None


def _tma_reason(device: torch.device, dtype: torch.dtype) -> str | None:
    reason = _triton_reason(device, dtype)
    if reason is not None:
        return reason
    import triton.language as tl

    if not hasattr(tl, "make_tensor_descriptor") or importlib.util.find_spec("triton.tools.tensor_descriptor") is None:
        return "this triton has no tensor descriptors (triton >= 3.4)"
    if device.type == "cuda":
        if getattr(torch.version, "hip", None):
            return "triton_tma runs on NVIDIA GPUs (TMA), not ROCm"
        major, _ = torch.cuda.get_device_capability(device)
        if major < 9:
            return f"triton_tma needs TMA (sm_90 or newer), this GPU is sm_{major}x"
    return None


def _module_reason(module: str) -> Callable[[torch.device, torch.dtype], str | None]:
    """The ``unsupported_reason(device, dtype)`` of an engine's own module, imported on first use."""
    def reason(device: torch.device, dtype: torch.dtype) -> str | None:
        with apart_from_caller():
            return importlib.import_module(module, __package__).unsupported_reason(device, dtype)

    return reason


def _quantized_reason(fmt: str) -> Callable[..., str | None]:
    def reason(device: torch.device, dtype: torch.dtype, base: str | None = None) -> str | None:
        from .quantized.core import unsupported_reason

        with apart_from_caller():
            return unsupported_reason(fmt, device, dtype, base)

    return reason


def _block_reason(device: torch.device, dtype: torch.dtype, base: str | None = None) -> str | None:
    from .quantized.fp8_block import unsupported_reason

    with apart_from_caller():
        return unsupported_reason(device, dtype, base)


@dataclass(frozen=True)
class Implementation:
    """One entry of the registry."""

    name: str
    stages: tuple[str, ...]
    """Which of :data:`STAGES` it provides."""
    devices: tuple[str, ...]
    """Device types it runs on (``"cpu"``, ``"cuda"``, ``"xpu"``)."""
    dtypes: tuple[torch.dtype, ...] | None
    """Activation/weight dtypes it takes (None: any floating dtype)."""
    module: str
    """The module (under ``fastmoe_xpu.kernels``) holding its launchers."""
    unavailable: Callable[[torch.device, torch.dtype], str | None] | None = None
    """A further check beyond devices and dtypes (a package present, a probe call); None: none."""
    native_gemm: str | None = None
    """For an implementation of every stage: the gemm entry its own stage 4 is (``torch`` -> ``loop``)."""
    timed: Callable[[torch.device], bool] = lambda device: True
    """Whether ``auto`` may time it on this device (an interpreter is never timed for speed)."""
    precision: str | None = None
    """For a stage-4 implementation that quantizes its GEMMs: the ``expert_precision`` it runs
    (``"int8"``, ``"fp8"``); None for the full-precision ones ``gemm_engine`` chooses among."""
    low_rank_gemm: tuple[str, ...] = ()
    """For a base: the engines that run LoRA adapters' ``r``-wide grouped GEMMs, the first available
    one wins (empty: the kernel set's own stage 4). These products are thin (one side ``r`` wide), so
    one batched call beats a launch per expert whatever engine the base GEMMs were timed onto."""
    bases: tuple[str, ...] = ()
    """For an ``experts`` implementation: the bases it may stand in for (its numbers are theirs)."""
    max_layer_macs: int = 0
    """For an ``experts`` implementation: the largest layer it runs, in multiply-accumulates of the
    forward (:func:`.registry.layer_macs`), up to which it was measured to beat the staged chain."""
    max_tokens: int = 0
    """For an ``experts`` implementation whose work is the routed rows' alone (no padding): it also
    runs any layer of at most this many tokens whose ``T * K`` routed rows are at most one per local
    expert, whatever the layer's size (decoding, where most experts have no row)."""
    adapters: bool = False
    """For an ``experts`` implementation: whether it also runs LoRA adapters on the frozen weights
    (``lora_experts_forward`` / ``lora_experts_backward``)."""

    def launchers(self) -> tuple[str, ...]:
        return tuple(name for stage in self.stages for name in STAGES[stage])

    def reason_unavailable(self, device: torch.device | str, dtype: torch.dtype, base: str | None = None) -> str | None:
        """None when this implementation runs for ``dtype`` on ``device``; else why not. ``base``: the
        kernel base it runs next to, which a precision entry's answer depends on (next to the Triton
        base its GEMMs may be Triton kernels rather than torch's)."""
        dev = torch.device(device)
        if dev.type not in self.devices:
            return f"{self.name} runs on {'/'.join(self.devices)} tensors, not {dev.type}"
        if self.dtypes is not None and dtype not in self.dtypes:
            names = ", ".join(str(d).removeprefix("torch.") for d in self.dtypes)
            return f"{self.name} takes {names}, not {str(dtype).removeprefix('torch.')}"
        if self.unavailable is None:
            return None
        return self.unavailable(dev, dtype, base) if self.precision is not None else self.unavailable(dev, dtype)


#: Every implementation, by name. Order matters only for breaking timing ties (earlier wins).
IMPLEMENTATIONS: dict[str, Implementation] = {
    impl.name: impl
    for impl in (
        Implementation("torch", ("route", "combine"), ("cpu", "cuda", "xpu", "meta"), None, ".torch",
                       native_gemm="loop", low_rank_gemm=("grouped_mm", "loop")),
        Implementation("loop", ("gemm",), ("cpu", "cuda", "xpu"), None, ".torch.grouped_gemm"),
        Implementation("grouped_mm", ("gemm",), ("cpu", "cuda", "xpu"), None, ".grouped_mm",
                       unavailable=_module_reason(".grouped_mm")),
        Implementation("onednn", ("gemm",), ("cpu",), (torch.float32,), ".torch.onednn", unavailable=_module_reason(".torch.onednn")),
        Implementation("triton", ("route", "gemm", "combine"), ("cpu", "cuda", "xpu"), _FLOATS, ".triton",
                       unavailable=_triton_reason, native_gemm="triton", timed=lambda device: device.type != "cpu"),
        Implementation("triton_tma", ("gemm",), ("cpu", "cuda"), _FLOATS, ".triton.tma_gemm",
                       unavailable=_tma_reason, timed=lambda device: device.type == "cuda"),
        Implementation("int8", ("gemm",), ("cpu", "cuda", "xpu"), _FLOATS, ".quantized.int8",
                       unavailable=_quantized_reason("int8"), timed=lambda device: False, precision="int8"),
        Implementation("fp8", ("gemm",), ("cpu", "cuda", "xpu"), _FLOATS, ".quantized.fp8",
                       unavailable=_quantized_reason("fp8"), timed=lambda device: False, precision="fp8"),
        Implementation("fp8-block", ("gemm",), ("cpu", "cuda"), _FLOATS, ".quantized.fp8_block",
                       unavailable=_block_reason, timed=lambda device: False, precision="fp8-block"),
        # Measured on the CPU against the padded op, the staged chain and transformers (docs/small_shapes.md).
        Implementation("decode", ("experts",), ("cpu",), _FLOATS, ".torch.decode", bases=("torch",),
                       max_tokens=1),
        # Measured on the CPU against the staged chain and transformers (docs/small_shapes.md).
        Implementation("padded", ("experts",), ("cpu",), _FLOATS, ".torch.padded", bases=("torch",),
                       max_layer_macs=4 * 2**20, adapters=True),
    )
}

#: The base implementations (stages 2, 3 and 5): what a block's ``backend`` names.
BASES = tuple(n for n, impl in IMPLEMENTATIONS.items() if {"route", "combine"} <= set(impl.stages))
#: The full-precision stage-4 implementations ("engines"), in the order ties are broken.
ENGINES = tuple(n for n, impl in IMPLEMENTATIONS.items() if "gemm" in impl.stages and impl.precision is None)
#: ``expert_precision`` -> the stage-4 implementations that run it, in order of preference.
PRECISIONS: dict[str, tuple[str, ...]] = {}
for _n, _impl in IMPLEMENTATIONS.items():
    if _impl.precision is not None:
        PRECISIONS[_impl.precision] = (*PRECISIONS.get(_impl.precision, ()), _n)
del _n, _impl
#: Every stage-4 implementation a kernel set may name.
GEMMS = ENGINES + tuple(n for names in PRECISIONS.values() for n in names)
#: Every value ``gemm_engine`` (and ``FASTMOE_GEMM_ENGINE``) accepts.
CHOICES = ("auto", "native", *ENGINES)
settings.declare_gemm_engines(ENGINES)
settings.declare_expert_precisions(tuple(PRECISIONS))
#: The stage-4 engine of each base.
NATIVE = {n: IMPLEMENTATIONS[n].native_gemm for n in BASES}
#: The implementations of the whole experts op (stages 2-5 in one piece), in order of preference.
LAYERS = tuple(n for n, impl in IMPLEMENTATIONS.items() if "experts" in impl.stages)


def check_choice(gemm_engine: str) -> str:
    """``gemm_engine`` itself, or a ValueError naming the accepted values."""
    if gemm_engine not in CHOICES:
        raise ValueError(f"gemm_engine must be one of {CHOICES}, got {gemm_engine!r}")
    return gemm_engine


def _implementation(name: str, role: str = "implementation") -> Implementation:
    impl = IMPLEMENTATIONS.get(name)
    if impl is None:
        raise ValueError(f"unknown {role} {name!r} (expected one of {tuple(IMPLEMENTATIONS)})")
    return impl


@functools.lru_cache(maxsize=None)
def module_of(name: str) -> ModuleType:
    """The module holding ``name``'s launchers (imported on first use: triton stays optional)."""
    return importlib.import_module(_implementation(name).module, __package__)


def unavailable_reason(engine: str, backend: str, device: torch.device | str, dtype: torch.dtype) -> str | None:
    """None when stage-4 implementation ``engine`` runs next to ``backend``'s buffers on ``device`` in
    ``dtype``; else why not."""
    if engine not in GEMMS:
        raise ValueError(f"unknown gemm engine {engine!r} (expected one of {GEMMS})")
    return IMPLEMENTATIONS[engine].reason_unavailable(device, dtype, backend)


# ---------------------------------------------------------------- kernel sets by name
class KernelSet:
    """A :class:`.contract.KernelBackend`: stages 2, 3 and 5 (and whatever stage-4 launcher the engine
    lacks) from a base implementation, stage 4 from an engine. An engine module with a
    ``launchers_for(base)`` function gives its launchers for that base through it (``int8`` runs
    its Triton kernel next to the Triton base)."""

    def __init__(self, base: str, engine: str) -> None:
        base_module, engine_module = module_of(base), module_of(engine)
        per_base = getattr(engine_module, "launchers_for", None)
        if per_base is not None:  # an engine whose launchers depend on the base's kernels
            engine_module = per_base(base)
        provided = IMPLEMENTATIONS[engine].launchers()
        provided = getattr(engine_module, "LAUNCHERS", provided)
        self.NAME = base if NATIVE[base] == engine else f"{base}+{engine}"
        self.base = base
        self.engine = engine
        for name in LAUNCHERS:
            source = engine_module if name in STAGE4_LAUNCHERS and name in provided else base_module
            setattr(self, name, getattr(source, name))
        for name in FUSED_LAUNCHERS:  # from the engine alone: a fused launcher runs its own GEMMs
            if (name in getattr(engine_module, "__all__", ()) or name in provided) and hasattr(engine_module, name):
                setattr(self, name, getattr(engine_module, name))

    def __repr__(self) -> str:
        return f"<kernels {self.NAME}>"


@functools.lru_cache(maxsize=None)
def kernels(name: str) -> KernelBackend:
    """The launchers of kernel set ``name`` (``"torch"``, ``"triton"``, ``"torch+grouped_mm"``, ...).
    The same name gives the same object every call."""
    base, _, engine = name.partition("+")
    if base not in BASES:
        raise ValueError(f"unknown kernel backend {base!r} (expected one of {BASES})")
    engine = engine or NATIVE[base]
    if engine not in GEMMS:
        raise ValueError(f"unknown gemm engine {engine!r} (expected one of {GEMMS})")
    if engine == NATIVE[base] and name != base:
        return kernels(base)
    if engine == NATIVE[base]:
        return module_of(base)  # type: ignore[return-value]
    return KernelSet(base, engine)  # type: ignore[return-value]


def kernel_set_name(base: str, engine: str) -> str:
    """The name of ``base`` with stage 4 on ``engine``."""
    return base if NATIVE[base] == engine else f"{base}+{engine}"


@functools.lru_cache(maxsize=None)
def _low_rank_set(base: str, device_type: str, device_index: int | None, dtype: torch.dtype) -> str:
    dev = torch.device(device_type, device_index) if device_index is not None else torch.device(device_type)
    for engine in IMPLEMENTATIONS[base].low_rank_gemm:
        if unavailable_reason(engine, base, dev, dtype) is None:
            return kernel_set_name(base, engine)
    return ""


def low_rank_kernels(name: str, device: torch.device, dtype: torch.dtype) -> KernelBackend:
    """The launchers that run the ``r``-wide grouped GEMMs of LoRA adapters next to kernel set
    ``name`` (resolved, no ``auto``): the base's first available :attr:`Implementation.low_rank_gemm`
    engine, else ``name`` itself."""
    base = name.partition("+")[0]
    chosen = _low_rank_set(base, device.type, device.index, dtype)
    return kernels(chosen or name)
