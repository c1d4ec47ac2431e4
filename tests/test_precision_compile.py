"""An int8 FastSparseMoeBlock under ``torch.compile(fullgraph=True)`` (the ``aot_eager`` backend:
dynamo and AOTAutograd trace the quantized custom ops and their backward, no code generation, so
it runs in about two seconds): the same outputs and gradients as eager, bit for bit, before and after
an in-place weight update (the weight codes are made again for new weight versions)."""
from __future__ import annotations

from types import SimpleNamespace

import torch
from torch._dynamo.backends.debugging import aot_eager, boxed_nop

from compile_util import block_step
from fastmoe_xpu import FastSparseMoeBlock


def test_int8_block_compiled_equals_eager():
    torch._dynamo.reset()
    # odd widths, K=3 of E=7, 38 tokens (not a multiple of any block)
    cfg = SimpleNamespace(hidden_size=24, intermediate_size=20, num_experts=7, num_experts_per_tok=3,
                          norm_topk_prob=False, hidden_act="silu")
    torch.manual_seed(0)
    block = FastSparseMoeBlock(cfg, backend="torch", expert_precision="int8")
    x = torch.randn(2, 19, 24, requires_grad=True)
    graphs: list[torch.fx.GraphModule] = []

    def keep(g, example):  # noqa: ANN001, ANN202
        graphs.append(g)
        return boxed_nop(g, example)

    compiled = torch.compile(block, fullgraph=True,
                             backend=lambda gm, ex: aot_eager(gm, ex, fw_compiler=keep, bw_compiler=keep))

    def run(f):  # noqa: ANN001, ANN202
        return block_step(block, x, f)

    for update in range(2):
        if update:  # an optimizer-like in-place step: new weight versions, new codes
            with torch.no_grad():
                for p in block.parameters():
                    p.add_(torch.randn_like(p) * 0.05)
        want, got = run(block), run(compiled)
        for k, v in want.items():
            assert v is not None and torch.equal(got[k], v), (update, k, (got[k] - v).abs().max())
    assert len(graphs) == 2  # one forward and one backward graph, reused after the update
    calls = [n for g in graphs for n in g.graph.nodes if n.op == "call_function" and str(n.target).startswith("fastmoe.")]
    assert any("torch+int8" in n.args for n in calls)  # the quantized kernels ran inside the graph
    ref = FastSparseMoeBlock(cfg, backend="torch")
    ref.load_state_dict(block.state_dict())
    plain = ref(x.detach())
    plain = plain[0] if isinstance(plain, tuple) else plain
    assert not torch.equal(plain, want["out"])  # the int8 result is really quantized
