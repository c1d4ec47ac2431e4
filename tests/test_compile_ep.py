"""Expert parallelism under torch.compile: a compiled EP block (gloo, world 2) gives the eager EP
block's numbers with gradients, in one graph: allgather dispatch as it is, all-to-all dispatch with
dynamo's unbacked-size capture switched on.

The dispatch collectives trace as torch's functional collectives, the input check's host read
becomes a device-side assertion. Each rank compares its compiled block with an eager copy of the
same block on the same rows; the eager EP block itself is checked against the single-process block
in test_dist_ep.py.
"""
from __future__ import annotations

from types import SimpleNamespace

import torch
import torch.distributed as dist

from fastmoe_xpu import FastSparseMoeBlock
from fastmoe_xpu.dist.testing import run_distributed
from tolerances import assert_close

CFG = dict(hidden_size=12, intermediate_size=10, num_experts=8, num_experts_per_tok=3, norm_topk_prob=True,
           hidden_act="silu")


def _blocks(check_inputs: bool, seed: int = 0, dispatch: str = "allgather") -> tuple[FastSparseMoeBlock, FastSparseMoeBlock]:
    cfg = SimpleNamespace(**CFG)
    torch.manual_seed(seed)
    full = FastSparseMoeBlock(cfg, backend="torch")
    full.reset_parameters(0.3)  # outputs of order 1, so that relative errors mean something
    blocks = []
    for _ in range(2):
        b = FastSparseMoeBlock(cfg, backend="torch", ep_group=dist.group.WORLD, dispatch=dispatch,
                               check_inputs=check_inputs)
        b.load_state_dict(full.state_dict())  # the full state dict: each rank keeps its slice
        blocks.append(b)
    return blocks[0], blocks[1]


def _f_b(block, x: torch.Tensor, g: torch.Tensor) -> dict[str, torch.Tensor]:
    x = x.clone().requires_grad_(True)
    block.zero_grad(set_to_none=True)
    out = block(x)
    out.backward(g)
    grads = {n.removeprefix("_orig_mod."): p.grad.clone() for n, p in block.named_parameters()}
    return {"out": out.detach(), "dx": x.grad, **grads}


def _compiled_allgather(check_inputs: bool, with_inductor: bool) -> dict:
    """On each rank: eager and compiled (fullgraph, dynamic, aot_eager; then inductor) EP blocks on
    the same rows, two sequence lengths; returns the frame and graph-break counts (mismatched numbers
    raise here)."""
    import torch._dynamo
    import torch._dynamo.testing

    torch._dynamo.reset()
    r = dist.get_rank()
    eager, traced = _blocks(check_inputs)
    explained = torch._dynamo.explain(traced)(torch.randn(2, 5, CFG["hidden_size"]))
    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(traced, fullgraph=True, dynamic=True, backend=counter)
    for S in (5, 7):  # one compile serves both lengths
        g = torch.Generator().manual_seed(10 * S + r)  # rows differ per rank, as in training
        x = torch.randn(2, S, CFG["hidden_size"], generator=g)
        dout = torch.randn(2, S, CFG["hidden_size"], generator=g)
        want, got = _f_b(eager, x, dout), _f_b(compiled, x, dout)
        assert set(got) == set(want)
        for name in want:
            assert_close(got[name], want[name], msg=f"rank {r}, S={S}: {name}")
    if with_inductor:
        torch._dynamo.reset()
        inductor = torch.compile(traced, fullgraph=True)
        x = torch.randn(6, CFG["hidden_size"], generator=torch.Generator().manual_seed(99 + r))
        dout = torch.ones(6, CFG["hidden_size"])
        want, got = _f_b(eager, x, dout), _f_b(inductor, x, dout)
        for name in want:
            assert_close(got[name], want[name], msg=f"rank {r}, inductor: {name}")
    return {"graph_breaks": explained.graph_break_count, "graphs": explained.graph_count,
            "frames_aot_eager": counter.frame_count}


def _mismatched_sizes_compiled() -> str:
    """Traced, the size check is a device-side assertion: unequal token counts fail on every rank."""
    r = dist.get_rank()
    block, _ = _blocks(check_inputs=True)
    compiled = torch.compile(block, fullgraph=True, backend="aot_eager")
    try:
        compiled(torch.randn(4 + r, CFG["hidden_size"]))
    except RuntimeError as err:
        assert "same number of tokens" in str(err), err
        return "raised"
    raise AssertionError("unequal token counts passed the compiled size check")


def _compiled_alltoall() -> dict:
    """All-to-all dispatch reads its split sizes from a tensor: traced as unbacked sizes (dynamo's
    capture_scalar_outputs and capture_dynamic_output_shape_ops), it compiles into one graph.
    Unequal token counts per rank, two lengths."""
    import torch._dynamo
    import torch._dynamo.testing

    torch._dynamo.reset()
    r = dist.get_rank()
    eager, traced = _blocks(check_inputs=True, dispatch="alltoall")
    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    with torch._dynamo.config.patch(capture_scalar_outputs=True, capture_dynamic_output_shape_ops=True):
        compiled = torch.compile(traced, fullgraph=True, dynamic=True, backend=counter)
        for S in (5, 8):
            g = torch.Generator().manual_seed(10 * S + r)
            x = torch.randn(S + r, CFG["hidden_size"], generator=g)  # S differs between ranks
            dout = torch.randn(S + r, CFG["hidden_size"], generator=g)
            want, got = _f_b(eager, x, dout), _f_b(compiled, x, dout)
            assert set(got) == set(want)
            for name in want:
                assert_close(got[name], want[name], msg=f"rank {r}, alltoall, S={S + r}: {name}")
    return {"frames_aot_eager": counter.frame_count}


def worker_compiled_ep() -> dict:
    """Every case in one pair of processes (process start-up and imports cost more than the cases)."""
    return {
        "check_inputs": _compiled_allgather(check_inputs=True, with_inductor=True),
        "no_check": _compiled_allgather(check_inputs=False, with_inductor=False),
        "mismatch": _mismatched_sizes_compiled(),
        "alltoall": _compiled_alltoall(),
    }


def test_compiled_allgather_ep_block_equals_eager_in_one_graph():
    results = run_distributed(worker_compiled_ep, 2, timeout_s=240, comm_timeout_s=60, fail_fast=True)
    for rank, res in enumerate(results):
        for case in ("check_inputs", "no_check"):
            assert res[case]["graph_breaks"] == 0, (rank, case, res[case])
            assert res[case]["graphs"] == 1, (rank, case, res[case])
            # dynamic=True: no recompile for the second length
            assert res[case]["frames_aot_eager"] == 1, (rank, case, res[case])
        assert res["mismatch"] == "raised"
        assert res["alltoall"]["frames_aot_eager"] == 1, (rank, res["alltoall"])
