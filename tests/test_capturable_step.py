"""A whole training step with no host synchronisation, so that it can be captured in a CUDA graph.

The step: embedding, a FastSparseMoeBlock on the Triton backend with its experts split over an
expert-parallel group of 2 (allgather dispatch, gloo), the LM head, cross-entropy plus the
load-balancing and router z-losses, backward, gradient clipping and an optimizer step. After one
warm-up step (as a capture needs), a second step runs under two detectors: the profiler's count of
``aten::_local_scalar_dense`` (every ``.item()`` / ``int(t)`` / ``bool(t)`` of a tensor) and
``bench.studies.audit``'s hooks on ``Tensor.tolist`` / ``.item`` / ``__int__`` / ``__bool__`` ... plus its
dispatch-level list of host-reading ops (``nonzero``, boolean indexing, ``bincount`` ...). Both
must find nothing (``torch._assert_async``, the dispatch's device-side input check, reads its flag
on CPU tensors; on a GPU it is a kernel, so the read under it is counted apart); a control step with the input agreement's host read (the eager default) shows
that the detectors do detect.
"""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from fastmoe_xpu.dist.testing import run_distributed

pytest.importorskip("triton")

H, I, E, K, V, S = 16, 8, 4, 2, 32, 6


class _TinyLM(torch.nn.Module):
    def __init__(self, group) -> None:  # noqa: ANN001
        super().__init__()
        from fastmoe_xpu import FastSparseMoeBlock

        cfg = SimpleNamespace(hidden_size=H, intermediate_size=I, num_experts=E, num_experts_per_tok=K,
                              norm_topk_prob=True, hidden_act="silu")
        self.embed = torch.nn.Embedding(V, H)
        self.moe = FastSparseMoeBlock(cfg, backend="triton", gemm_engine="native", ep_group=group,
                                      dispatch="allgather")
        self.head = torch.nn.Linear(H, V, bias=False)

    def forward(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = self.embed(ids)
        logits_TE = torch.nn.functional.linear(x.reshape(-1, H), self.moe.gate.weight)  # the router's logits
        y = x + self.moe(x)
        return self.head(y), logits_TE


def _step(model, opt, ids, targets):  # noqa: ANN001
    from fastmoe_xpu import load_balancing_loss, router_z_loss

    logits, router_logits = model(ids)
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, V), targets.reshape(-1))
    loss = loss + 0.01 * load_balancing_loss((router_logits,), num_experts=E, top_k=K) \
        + 0.001 * router_z_loss((router_logits,))
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, foreach=True)
    opt.step()
    opt.zero_grad(set_to_none=False)
    return loss.detach()


def _rank_steps() -> tuple[dict, dict]:
    """Warm-up, then one step as under a capture and one eager step (the control)."""
    import torch.distributed as dist

    torch.manual_seed(0)
    model = _TinyLM(dist.group.WORLD)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, foreach=True)
    g = torch.Generator().manual_seed(dist.get_rank())
    ids, targets = torch.randint(0, V, (1, S), generator=g), torch.randint(0, V, (1, S), generator=g)
    _step(model, opt, ids, targets)  # warm-up: kernels built, optimizer state made
    return _audited_step(model, opt, ids, targets, True), _audited_step(model, opt, ids, targets, False)


def _audited_step(model, opt, ids, targets, capture: bool) -> dict:  # noqa: ANN001
    from bench.studies.audit import Audit
    from fastmoe_xpu.dist import dispatch

    with pytest.MonkeyPatch.context() as mp:
        if capture:  # what torch.cuda.is_current_stream_capturing() says inside a CUDA graph capture
            mp.setattr(dispatch, "capturing", lambda device: True)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            with Audit() as audit:
                loss = _step(model, opt, ids, targets)
    scalar_reads, in_asserts = 0, 0
    for e in prof.events():
        if e.name != "aten::_local_scalar_dense":
            continue
        parent = e.cpu_parent
        while parent is not None and parent.name != "aten::_assert_async":
            parent = parent.cpu_parent
        if parent is None:
            scalar_reads += 1
        else:  # CPU tensors: the assertion reads its flag; on a GPU it is a kernel, nothing waits
            in_asserts += 1
    syncs = [s for phase in audit.syncs.values() for s in phase]
    kernels = sorted({k for phase in audit.launches.values() for k in phase})
    return {"scalar_reads": scalar_reads, "assert_reads": in_asserts, "syncs": syncs, "kernels": kernels, "loss": float(loss)}


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
def test_training_step_with_expert_parallel_dispatch_has_no_host_sync():
    env = {"TRITON_INTERPRET": "1", "FASTMOE_GEMM_ENGINE": "native"}
    results = run_distributed(_rank_steps, 2, env=env, timeout_s=240.0, fail_fast=True)
    for rank, (res, _) in enumerate(results):
        assert res["scalar_reads"] == 0 and res["syncs"] == [], (rank, res)
        assert res["assert_reads"] == 1, res  # the dispatch's device-side token-count check, once
        assert "_gate_up_fwd_kernel" in res["kernels"] and "_combine_bwd_kernel" in res["kernels"], res
        assert res["loss"] == res["loss"]  # finite enough to compare with itself: not NaN
    # Control: eagerly (no capture) the dispatcher agrees on every rank's input on the host.
    eager = [e for _, e in results]
    assert all(r["syncs"] for r in eager) and all(r["scalar_reads"] or "Tensor.tolist" in r["syncs"] for r in eager)
