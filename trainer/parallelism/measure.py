"""Measured memory and traffic of one training step per rank under ZeRO-1, EPSO and FSDP2, beside
the planner's figures for the same layout (:mod:`trainer.parallelism.plan`).

    python -m trainer.parallelism.measure --preset small-moe --world 4 --ep 2

Starts ``--world`` gloo processes on this machine for each layout, trains one warm-up step (lazy
initialisation) and measures the next one on every rank:

weights      bytes of the storages holding this rank's parameters (ZeRO-1 / EPSO: the flat buckets;
             FSDP2: its padded shards of the non-expert weights, and the expert weights)
grads        bytes of the gradient storages when the optimizer step starts (flat buckets; FSDP2's
             sharded gradients)
optim        the optimizer's fp32 master weights and Adam moments on this rank
act          the largest bytes saved for backward by one micro-batch (``saved_tensors_hooks``;
             parameters excluded, each storage once)
gathered     FSDP2: the largest bytes of gathered (unsharded) non-expert weights, and of all-gather
             buffers not yet copied out (a prefetch), seen when a decoder layer starts its forward
             or its backward reads a saved tensor
sent         bytes this rank sends per step for its weights and gradients, from every c10d
             collective the step runs (a ``TorchDispatchMode`` sees them): an all-reduce of S bytes
             over W ranks counts 2 (W-1)/W S, an all-gather or reduce-scatter (W-1)/W of the whole
             buffer, an all-to-all what leaves the rank, a send its bytes; the EP token exchange
             (collectives over the EP group in forward and backward) is shown apart as ``tokens``

Each column is printed as the largest value over the ranks, the planner's figure beside it
(``make_plan`` with the run's sizes, fp32 weights and gradients; its ``gathered`` is the weights
gathered at once, its ``sent`` :meth:`~trainer.parallelism.plan.Plan.traffic_bytes`). The total adds
the columns, as the planner does: an upper bound on what is alive at one moment.
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import weakref
from typing import Any, Sequence

import torch

#: Layout name -> (--optim.name, --parallel.dp_shard), the planner's kind
LAYOUTS = {"ZeRO-1": ("sharded", "none", "sharded"), "EPSO": ("epso", "none", "epso"),
           "FSDP2": ("epso", "fsdp", "fsdp")}
COLUMNS = ("weights", "grads", "optim", "act", "gathered")


def _storage(t: torch.Tensor) -> tuple[int, int]:
    """(address, bytes) of the storage holding ``t`` (a DTensor's local shard)."""
    local = getattr(t, "_local_tensor", t)
    st = local.untyped_storage()
    return st.data_ptr(), st.nbytes()


def _unique_bytes(tensors: Any) -> int:
    seen: dict[int, int] = {}
    for t in tensors:
        if t is not None:
            ptr, n = _storage(t)
            if n:
                seen[ptr] = n
    return sum(seen.values())


def _sent_bytes(op: str, args: Sequence[Any], size: int, rank: int) -> int:
    """Bytes one rank sends for c10d op ``op`` over ``size`` ranks (ring algorithms)."""

    def nbytes(x: Any) -> int:
        if isinstance(x, torch.Tensor):
            return x.numel() * x.element_size()
        if isinstance(x, (list, tuple)):
            return sum(nbytes(y) for y in x)
        return 0

    f = (size - 1) / size if size > 1 else 0.0
    if op == "allreduce_":
        return round(2 * f * nbytes(args[0]))
    if op in ("_allgather_base_", "allgather_", "allgather_into_tensor_coalesced_"):
        return round((size - 1) * nbytes(args[1]))
    if op in ("_reduce_scatter_base_", "reduce_scatter_", "reduce_scatter_tensor_coalesced_"):
        return round((size - 1) * nbytes(args[0]))
    if op == "alltoall_base_":
        inp, splits = args[1], list(args[4]) if len(args) > 4 and args[4] else []
        row = nbytes(inp) // max(inp.shape[0], 1) if inp.dim() else 0
        own = splits[rank] * row if splits else nbytes(inp) // size
        return nbytes(inp) - own
    if op == "alltoall_":
        return nbytes(args[1]) - nbytes(args[1][rank])
    if op == "send":
        return nbytes(args[0])
    if op == "broadcast_":
        return nbytes(args[0]) if rank == int(args[2]) else 0
    return 0  # recv, barrier: nothing sent


class StepProbe:
    """Measures one :meth:`trainer.trainer.Trainer.train_step` of ``trainer`` (a context manager)."""

    def __init__(self, trainer: Any) -> None:
        import torch.distributed as dist

        self.t = trainer
        lay = trainer.layout
        self.ep_name = lay.ep_group.group_name if lay.ep_group is not None else None
        self.dist = dist
        self.sent = {"params": 0, "tokens": 0}
        self.ops: dict[str, int] = {}
        self.in_optimizer = False
        self.act = 0
        self._mb: dict[int, int] = {}
        self.gathered = 0
        self._gather_buffers: dict[int, int] = {}
        self.grads = 0
        self._handles: list[Any] = []

    # ---- hooks
    def _param_storages(self) -> set[int]:
        return {_storage(p)[0] for p in self.t.model.parameters()}

    def _pack(self, x: torch.Tensor) -> torch.Tensor:
        ptr, n = _storage(x)
        if n and ptr not in self._mb and ptr not in self._param_storages():
            self._mb[ptr] = n
            self.act = max(self.act, sum(self._mb.values()))
        return x

    def _unpack(self, x: torch.Tensor) -> torch.Tensor:
        if self.t.fsdp:  # in backward: the layer's weights, and the next one's being prefetched
            self._layer_start()
        return x

    def _new_micro_batch(self, *_: Any) -> None:
        self._mb = {}

    def _layer_start(self, *_: Any) -> None:
        from fastmoe_xpu.dist.sharding import is_expert_weight

        full = [p for n, p in self.t.model.named_parameters()
                if not is_expert_weight(n) and not hasattr(p, "_local_tensor")]
        self.gathered = max(self.gathered, _unique_bytes(full) + sum(self._gather_buffers.values()))

    def _count(self, func: Any, args: Sequence[Any]) -> None:
        pg = next((a for a in args if isinstance(a, torch.ScriptObject)), None)
        if pg is None:
            return
        group = self.dist.ProcessGroup.unbox(pg)
        n = _sent_bytes(func._opname, args, group.size(), group.rank())
        kind = "tokens" if group.group_name == self.ep_name and not self.in_optimizer else "params"
        self.sent[kind] += n
        self.ops[func._opname] = self.ops.get(func._opname, 0) + 1
        gather = func._opname in ("_allgather_base_", "allgather_into_tensor_coalesced_")
        if self.t.fsdp and kind == "params" and gather:
            # an all-gather's output lives until its weights are copied out (a prefetch: while the
            # layer before it runs): counted as gathered while it is alive
            for out in (args[0] if isinstance(args[0], (list, tuple)) else [args[0]]):
                key = id(out)
                self._gather_buffers[key] = out.numel() * out.element_size()
                weakref.finalize(out, self._gather_buffers.pop, key, None)

    def __enter__(self) -> "StepProbe":
        from torch.utils._python_dispatch import TorchDispatchMode

        from ..model.family import decoder_layers

        probe = self

        class _Collectives(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                if func.namespace == "c10d":
                    probe._count(func, args)
                return func(*args, **(kwargs or {}))

        t = self.t
        self._handles.append(t.model.get_input_embeddings().register_forward_pre_hook(self._new_micro_batch))
        if t.fsdp:
            self._handles += [layer.register_forward_pre_hook(self._layer_start) for layer in decoder_layers(t.model)]
        inner = t.optimizer_step

        def optimizer_step() -> dict[str, Any]:
            grads = [p.grad for p in t.model.parameters()] + [getattr(b, "flat_grad", None)
                                                              for b in t.optimizer.buckets if hasattr(b, "offsets")]
            self.grads = _unique_bytes(grads)
            self.in_optimizer = True
            try:
                return inner()
            finally:
                self.in_optimizer = False
        t.optimizer_step = optimizer_step
        self._saved = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self._saved.__enter__()
        self._mode = _Collectives()
        self._mode.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._mode.__exit__(*exc)
        self._saved.__exit__(*exc)
        del self.t.optimizer_step
        for h in self._handles:
            h.remove()

    def result(self) -> dict[str, Any]:
        t = self.t
        return {"weights": _unique_bytes(t.model.parameters()), "grads": self.grads,
                "optim": int(t.optimizer.state_bytes()), "act": self.act, "gathered": self.gathered,
                "sent": self.sent["params"], "tokens": self.sent["tokens"], "ops": self.ops}


def quiet_config(preset: str, sizes: dict[str, int], *, optimizer: str, dp_shard: str = "none", ep: int = 1,
                 pp: int = 1, ac: str = "", steps: int = 2, data_cache: str | None = None, name: str = "measure") -> Any:
    """A fp32 trainer config of ``preset`` at ``sizes`` (context, micro_batch, global_batch) that trains
    ``steps`` steps and writes nothing but its output folder (no evaluation, progress, plots or
    TensorBoard): what the measurements here and trainer.scale's validation run."""
    from ..config.presets import get_preset

    cfg = get_preset(preset)
    cfg.optim.name, cfg.parallel.dp_shard, cfg.parallel.ep, cfg.parallel.pp = optimizer, dp_shard, ep, pp
    cfg.parallel.ac = ac
    cfg.data.context = sizes["context"]
    cfg.schedule.micro_batch, cfg.schedule.global_batch = sizes["micro_batch"], sizes["global_batch"]
    cfg.schedule.steps = steps
    cfg.model.param_dtype, cfg.model.autocast, cfg.optim.grad_reduce_dtype = "fp32", "none", "fp32"
    cfg.data.cache_dir = data_cache
    cfg.eval.enabled = cfg.eval.moe_health = False
    cfg.logging.progress = cfg.logging.plot = cfg.logging.tensorboard = False
    cfg.logging.peak_tflops = 1.0
    cfg.logging.out = os.path.join(tempfile.gettempdir(), f"fastmoe-{name}-{os.getppid()}")
    return cfg


def measure_rank(preset: str, world: int, ep: int, layout: str, sizes: dict[str, int], data_cache: str | None) -> dict:
    """One rank's measurement of ``layout`` (run in each of ``world`` processes)."""
    from ..config import validate
    from ..trainer import Trainer

    name, shard, _ = LAYOUTS[layout]
    cfg = quiet_config(preset, sizes, optimizer=name, dp_shard=shard, ep=ep, data_cache=data_cache,
                       name=f"measure-{layout}")
    t = Trainer(validate(cfg, world))
    t.train_step()  # lazy initialisation (FSDP2, the dispatcher) happens here
    with StepProbe(t) as probe:
        t.train_step()
    return probe.result()


def measure(preset: str, world: int, ep: int, sizes: dict[str, int], data_cache: str | None = None,
            layouts: Sequence[str] = tuple(LAYOUTS), timeout_s: float = 600.0) -> dict[str, list[dict]]:
    """``{layout: [rank results]}`` for each of ``layouts`` (``world`` gloo processes each)."""
    from fastmoe_xpu.dist.testing import run_distributed

    if data_cache is not None:
        from ..data import ensure_default_dataset

        ensure_default_dataset(data_cache, sizes["context"], 0, progress=False)  # once, before the ranks
    env = {"OMP_NUM_THREADS": "1"}
    return {name: run_distributed(measure_rank, world, preset, world, ep, name, sizes, data_cache, env=env,
                                  timeout_s=timeout_s, comm_timeout_s=timeout_s, fail_fast=True)
            for name in layouts}


def planned(preset: str, world: int, ep: int, sizes: dict[str, int], layout: str) -> dict[str, int]:
    """The planner's figures for rank 0 of ``layout`` (one stage, fp32 weights and gradients)."""
    from .plan import make_plan

    kind = LAYOUTS[layout][2]
    p = make_plan(preset, world=world, ep=ep, micro_batch=sizes["micro_batch"], context=sizes["context"],
                  global_batch=sizes["global_batch"], weights="fp32",
                  optimizer=kind if kind != "fsdp" else "epso")
    st = p.stages[0]
    w, g, o, tr = p.state_bytes(st, kind)
    return {"weights": w, "grads": g, "optim": o, "act": p.activation_bytes(st), "gathered": tr,
            "sent": p.traffic_bytes(st, kind)}


def format_table(preset: str, world: int, ep: int, sizes: dict[str, int], results: dict[str, list[dict]]) -> str:
    def kib(n: float) -> str:
        return f"{n / 1024:,.0f}"

    dp = world // ep
    head = (f"{preset}, world {world} = DP {dp} x EP {ep}, micro-batch {sizes['micro_batch']} x context "
            f"{sizes['context']}, global batch {sizes['global_batch']}, fp32; per rank, KiB: measured "
            f"(largest over the ranks) / planned")
    cols = [*COLUMNS, "total", "sent"]
    lines = [head, f"  {'layout':8s} " + " ".join(f"{c:>17s}" for c in cols) + f" {'tokens':>9s}"]
    for name, ranks in results.items():
        got = {c: max(r[c] for r in ranks) for c in (*COLUMNS, "sent", "tokens")}
        got["total"] = max(sum(r[c] for c in COLUMNS) for r in ranks)
        want = planned(preset, world, ep, sizes, name)
        want["total"] = sum(want[c] for c in COLUMNS)
        cells = [f"{kib(got[c])} / {kib(want[c])}" for c in cols]
        lines.append(f"  {name:8s} " + " ".join(f"{c:>17s}" for c in cells) + f" {kib(got['tokens']):>9s}")
    lines.append("  (tokens: the EP exchange of hidden states, measured only; sent: weights and gradients)")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m trainer.parallelism.measure", description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="small-moe")
    ap.add_argument("--world", type=int, nargs="+", default=[2, 4], help="one table per world size")
    ap.add_argument("--ep", type=int, default=1)
    ap.add_argument("--context", type=int, default=64)
    ap.add_argument("--micro-batch", type=int, default=2)
    ap.add_argument("--micro-batches", type=int, default=2, help="per rank (gradient accumulation)")
    ap.add_argument("--data-cache", default=None, help="where the embedded corpus is prepared (default: the trainer's)")
    args = ap.parse_args(argv)
    for world in args.world:
        if world % args.ep:
            print(f"error: world {world} is not divisible by --ep {args.ep}", file=sys.stderr)
            return 2
        sizes = {"context": args.context, "micro_batch": args.micro_batch,
                 "global_batch": world * args.micro_batch * args.micro_batches}
        results = measure(args.preset, world, args.ep, sizes, args.data_cache)
        print(format_table(args.preset, world, args.ep, sizes, results), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
