"""One way parallelism is applied to a model: :func:`parallelize` runs, in this order, tensor
parallelism -> expert parallelism -> activation checkpointing -> FSDP2 on the non-expert weights
(``--parallel.dp_shard fsdp``) -> compilation on one model (or one pipeline stage), the same for the
OLMoE block and for every transformers family.

* TP (``--tp``): attention heads and MLP columns of the dense model (:mod:`.tp`);
* EP (``--ep``): the OLMoE block is built sharded (``patch_olmoe(ep_group=...)``); a family's
  experts modules are sharded here, their dispatcher set to allgather or all-to-all (:mod:`.ep`);
* activation checkpointing (``--ac``): the decoder layers' norms, attention and MoE blocks (:mod:`.ac`);
* compilation (``--compile``): the decoder stack (:func:`fastmoe_xpu.compiling.compile_decoder`),
  whole under allgather dispatch, in pieces under all-to-all (its count read breaks the graph).

Data-parallel sharding (the optimizer's buckets) and pipeline stages come from the trainer around
this: the pipeline builds each stage and calls :func:`parallelize` on it, the optimizer shards what
the model holds afterwards.
"""
from __future__ import annotations

from typing import Any

import torch.nn as nn


def parallelize(model: nn.Module, layout: Any, cfg: Any, before_shard: Any = None) -> nn.Module:
    """Apply TP -> EP -> activation checkpointing -> compile to ``model`` for ``layout`` (a
    :class:`trainer.layout.DeviceMesh`) as ``cfg`` (a validated :class:`trainer.config.TrainConfig`)
    asks; returns ``model`` (changed in place). Compilation is lazy: the graph is traced at the first
    call, so weights may still be loaded or broadcast in place after this, except under FSDP2, which
    shards the weights it is given: ``before_shard(model)`` (loading or broadcasting weights) runs
    just before it."""
    from .ac import apply_activation_checkpointing

    m, p = cfg.model, cfg.parallel
    tp = layout.tp
    if tp > 1:
        from .tp import apply_tensor_parallel

        apply_tensor_parallel(model, layout.tp_group, rank=layout.tp_rank, tp=tp)
    if m.is_hf and layout.ep > 1:
        from .ep import apply_expert_parallel

        apply_expert_parallel(model, layout.ep_group, dispatch=m.ep_dispatch, check_inputs=m.ep_check_inputs)
    apply_activation_checkpointing(model, p.ac)
    fsdp = getattr(p, "dp_shard", "none") == "fsdp" and layout.dpep_group is not None
    if fsdp:
        if before_shard is not None:
            before_shard(model)
        from fastmoe_xpu.dist.sharding import is_expert_weight

        from ..optim.fsdp import apply_fsdp

        from ..optim.fsdp import fsdp_mesh

        apply_fsdp(model, fsdp_mesh(layout, getattr(p, "fsdp_shard", 0)), is_expert=is_expert_weight,
                   reduce_dtype=getattr(cfg.optim, "grad_reduce_dtype", "fp32"))
    if m.compile:
        from fastmoe_xpu.compiling import compile_decoder

        # Allgather dispatch traces whole under EP; all-to-all breaks the graph at its count read
        # unless dynamo captures unbacked sizes (docs/compile.md), so it compiles in pieces. A
        # family's experts function reads its routed row count on the host under EP (sentinel rows
        # are skipped): it compiles in pieces under either dispatcher.
        whole = layout.ep == 1 or (m.ep_dispatch == "allgather" and not m.is_hf)
        if fsdp:  # in pieces: transformers' output recorder reads a context variable set outside the layer
            compile_layers(model, fullgraph=False, backend=m.compile_backend)
        else:
            compile_decoder(model, fullgraph=whole, backend=m.compile_backend)
    return model


def compile_layers(model: nn.Module, *, fullgraph: bool, backend: str) -> int:
    """Compile every decoder layer's ``forward`` (not the module call): FSDP2's gather and
    reduce-scatter hooks, which dynamo does not trace, run around each compiled layer, as
    torchtitan compiles its blocks. The embedding, final norm and head stay eager. Returns the
    number of layers compiled."""
    import torch

    from fastmoe_xpu.compiling import _install_output_hooks

    from ..model.family import decoder_layers

    _install_output_hooks(getattr(model, "model", model))
    layers = decoder_layers(model)
    for layer in layers:
        layer.forward = torch.compile(layer.forward, fullgraph=fullgraph, backend=backend)
    return len(layers)
