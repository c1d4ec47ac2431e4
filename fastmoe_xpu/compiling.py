"""``torch.compile`` for models holding FastSparseMoeBlocks, and the seconds spent compiling
counted apart from the seconds spent running.

:func:`compile_decoder` compiles a transformers causal LM's decoder stack (``model.model``) in
place, with ``fullgraph=True`` by default, so a graph break is an error instead of a silent
slowdown. The stack rather than each layer: transformers records router logits and hidden states
through hooks that read a ``ContextVar`` set by the stack's own forward, which dynamo can trace only
when that forward is inside the compiled frame. The stack also matches the trainer's loop, which
calls the decoder stack and the head separately.
"""
from __future__ import annotations

import torch.nn as nn

__all__ = ["compile_decoder", "compile_seconds"]


def compile_decoder(
    model: nn.Module, *, fullgraph: bool = True, dynamic: bool | None = None, backend: str = "inductor"
) -> nn.Module:
    """Compile ``model.model`` (the decoder stack) in place with ``nn.Module.compile``, or ``model``
    itself when it has no ``model`` submodule; returns the module compiled. Compilation happens at
    its first call; :func:`compile_seconds` counts it."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"compile_decoder expects an nn.Module, got {type(model).__name__}")
    target = getattr(model, "model", None)
    target = target if isinstance(target, nn.Module) else model
    _install_output_hooks(target)
    target.compile(fullgraph=fullgraph, dynamic=dynamic, backend=backend)
    return target


def _install_output_hooks(module: nn.Module) -> None:
    """transformers installs its output-recording hooks at a model's first call, under a lock that
    dynamo cannot enter; installing them now keeps that out of the compiled frame."""
    try:
        from transformers.utils.output_capturing import maybe_install_capturing_hooks
    except ImportError:  # transformers absent, or a version that hooks differently
        return
    if hasattr(module, "config"):
        maybe_install_capturing_hooks(module)


def compile_seconds() -> float:
    """Seconds this process has spent compiling frames so far (dynamo tracing plus the backend's
    forward and backward compilation, which AOTAutograd does within the frame's compile), from
    torch's own timers. The difference of two readings is the compile time of the work between."""
    from torch._dynamo.utils import compilation_time_metrics

    return float(sum(compilation_time_metrics.get("_compile.compile_inner", ())))
