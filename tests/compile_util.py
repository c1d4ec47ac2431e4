"""Compiled static-cache generation as the tests drive it: transformers' own ``generate`` with a
compile config whose backend keeps every graph it is handed."""
from __future__ import annotations

import torch
from transformers.generation.configuration_utils import CompileConfig


def graph_keeping_config() -> tuple[CompileConfig, list[torch.fx.GraphModule]]:
    """``(config, graphs)``: a fullgraph, static-shape compile config on aot_eager whose backend
    appends each graph dynamo hands it to ``graphs``."""
    graphs: list[torch.fx.GraphModule] = []

    def backend(gm, example_inputs):
        # A plain function: transformers deep-copies its compile config, and a function survives that
        # as itself (a counter object would be copied and count nothing).
        graphs.append(gm)
        return torch._dynamo.lookup_backend("aot_eager")(gm, example_inputs)

    config = CompileConfig(fullgraph=True, dynamic=False, backend=backend, mode=None)
    config._compile_all_devices = True  # transformers compiles on accelerators only unless told
    return config, graphs


def generate_compiled_and_eager(model, *, low: int, high: int, new_tokens: int, calls: int = 2):
    """``(graphs, [(compiled, eager) per call])``: ``calls`` greedy generations with a static cache,
    each on a new prompt of the same length (so a compiled forward is reused, not recompiled)."""
    config, graphs = graph_keeping_config()
    kw = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, cache_implementation="static")
    outs = []
    for seed in range(calls):
        ids = torch.randint(low, high, (2, 5), generator=torch.Generator().manual_seed(seed))
        outs.append((model.generate(ids, compile_config=config, **kw), model.generate(ids, disable_compile=True, **kw)))
    return graphs, outs


def block_step(block: torch.nn.Module, x: torch.Tensor, f) -> dict[str, torch.Tensor]:  # noqa: ANN001
    """One forward and backward of ``f`` (``block`` or a compiled form of it) on ``x`` with
    ``out.pow(2).sum()`` as the loss, from cleared gradients: the output and every gradient, by name."""
    block.zero_grad(set_to_none=True)
    x.grad = None
    out = f(x)
    out = out[0] if isinstance(out, tuple) else out
    out.pow(2).sum().backward()
    return {"out": out.detach(), "x": x.grad, **{n: p.grad for n, p in block.named_parameters()}}
