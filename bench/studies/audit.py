"""Count kernel launches and host synchronisations of one MoE layer, forward and backward.

``python -m fastmoe_bench audit [--experts 64 --top-k 8 --tokens 32]`` prints, for our block
on the Triton backend (the CPU runs it under ``TRITON_INTERPRET=1``), our block on the torch
backend and the transformers-v4-style reference block: Triton launches, other device ops
dispatched by PyTorch, and host synchronisations, per phase.

What counts:

* a Triton launch is a call of :func:`fastmoe_xpu.kernels.triton.launch.launch`;
* a device op is an ATen op seen by a ``TorchDispatchMode`` outside Triton launches, except views
  and ``empty`` allocations (which launch no kernel);
* a host synchronisation is an op that makes the host wait for device values:
  ``_local_scalar_dense`` (``.item()``, ``int(t)``, ``bool(t)``), ``nonzero`` (boolean indexing,
  ``torch.where(cond)``), ``masked_select``, ``unique``, ``bincount``, ``repeat_interleave``
  without ``output_size``, ``equal``, ``is_nonzero``, and the Python-level ``Tensor.tolist``,
  ``item``, ``__int__``, ``__float__``, ``__bool__``, ``__index__`` and ``numpy``. Work inside a
  Triton launch is not counted: the interpreter reads memory on the host by design, and on a GPU
  a launch is asynchronous.
"""
from __future__ import annotations

import contextlib
import os
from collections import Counter
from types import SimpleNamespace
from typing import Any, Callable, Iterator

import torch
from fastmoe_xpu.autograd.ops import BODIES
from torch.utils._python_dispatch import TorchDispatchMode

from fastmoe_xpu.kernels.triton import launch as _launch
from ..harness.usage import Parser, count

_SYNC_OPS = {
    "aten::_local_scalar_dense", "aten::nonzero", "aten::masked_select", "aten::_unique", "aten::_unique2",
    "aten::unique_dim", "aten::unique_consecutive", "aten::bincount", "aten::equal", "aten::is_nonzero",
    "aten::histc",
}
_ALLOC_OPS = {"aten::empty", "aten::empty_strided", "aten::empty_like", "aten::new_empty", "aten::new_empty_strided"}
_PY_SYNC_METHODS = ("tolist", "item", "__int__", "__float__", "__bool__", "__index__", "numpy")


class _Mode(TorchDispatchMode):
    def __init__(self, audit: "Audit") -> None:
        super().__init__()
        self.audit = audit

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        a = self.audit
        if a._in_launch == 0:
            name = func._schema.name
            if name in _SYNC_OPS:
                a.record_sync(name)
            elif name == "aten::repeat_interleave" and kwargs.get("output_size") is None and isinstance(
                    args[0], torch.Tensor) and len(args) < 3:
                a.record_sync(name + " (no output_size)")
            elif name in ("aten::index", "aten::index_put", "aten::index_put_") and any(
                    isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in (args[1] or ())):
                a.record_sync(name + " (boolean mask)")
            if not func.is_view and name not in _ALLOC_OPS:
                a.ops[a.phase][name] += 1
        body = BODIES.get(func._schema.name.partition("::")[2]) if func.namespace == "fastmoe" else None
        if body is not None:
            # A fastmoe custom op: run its body with this mode still active, so that the launches,
            # ATen ops and host reads inside it are seen as well.
            with self:
                return body(*args, **kwargs)
        return func(*args, **kwargs)


class Audit:
    """Context manager recording launches, device ops and host syncs per phase (see module doc)."""

    def __init__(self) -> None:
        self.phase = "other"
        self.launches: dict[str, Counter] = {}
        self.ops: dict[str, Counter] = {}
        self.syncs: dict[str, list[str]] = {}
        self._in_launch = 0
        self._stack = contextlib.ExitStack()
        self._set_phase("other")

    def _set_phase(self, phase: str) -> None:
        self.phase = phase
        self.launches.setdefault(phase, Counter())
        self.ops.setdefault(phase, Counter())
        self.syncs.setdefault(phase, [])

    @contextlib.contextmanager
    def in_phase(self, phase: str) -> Iterator[None]:
        previous = self.phase
        self._set_phase(phase)
        try:
            yield
        finally:
            self._set_phase(previous)

    def record_sync(self, what: str) -> None:
        self.syncs[self.phase].append(what)

    def __enter__(self) -> "Audit":
        original_launch = _launch.launch

        def counted_launch(kernel, grid, *args, **kwargs):
            self.launches[self.phase][getattr(kernel, "__name__", repr(kernel))] += 1
            self._in_launch += 1
            try:
                return original_launch(kernel, grid, *args, **kwargs)
            finally:
                self._in_launch -= 1

        _launch.launch = counted_launch
        self._stack.callback(setattr, _launch, "launch", original_launch)
        for meth in _PY_SYNC_METHODS:
            original = getattr(torch.Tensor, meth)

            def wrapper(t, *a, __original=original, __name=meth, **k):
                if self._in_launch == 0:
                    self.record_sync(f"Tensor.{__name}")
                return __original(t, *a, **k)

            setattr(torch.Tensor, meth, wrapper)
            self._stack.callback(setattr, torch.Tensor, meth, original)
        self._stack.enter_context(_Mode(self))
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stack.close()

    def total(self, table: dict[str, Counter], phase: str) -> int:
        return sum(table.get(phase, Counter()).values())


def audit_layer(block: torch.nn.Module, x: torch.Tensor) -> Audit:
    """One forward and one backward of ``block`` on ``x`` (a gradient of ones on the output)."""
    x = x.detach().requires_grad_(True)
    with Audit() as audit:
        with audit.in_phase("forward"):
            out = block(x)
        grad = torch.ones_like(out)
        with audit.in_phase("backward"):
            out.backward(grad)
    return audit


def _olmoe_like(experts: int, top_k: int, hidden: int, inter: int) -> SimpleNamespace:
    return SimpleNamespace(hidden_size=hidden, intermediate_size=inter, num_experts=experts,
                           num_experts_per_tok=top_k, norm_topk_prob=False, hidden_act="silu")


def compare(experts: int = 64, top_k: int = 8, tokens: int = 32, hidden: int = 16, inter: int = 16,
            seed: int = 0) -> list[dict[str, Any]]:
    """Audit our block (Triton and torch backends) and the v4-style reference on one input."""
    from fastmoe_xpu.block import FastSparseMoeBlock

    from ..harness.baselines import HFv4SparseMoeBlock

    torch.manual_seed(seed)
    cfg = _olmoe_like(experts, top_k, hidden, inter)
    ours = FastSparseMoeBlock(cfg, backend="torch")
    v4 = HFv4SparseMoeBlock(cfg).load_merged(ours.gate.weight, ours.experts.gate_up_proj, ours.experts.down_proj)
    x = torch.randn(1, tokens, hidden)
    rows = []
    cases: list[tuple[str, Callable[[], Audit]]] = []
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        def triton_case() -> Audit:
            ours.backend = "triton"
            try:
                return audit_layer(ours, x)
            finally:
                ours.backend = "torch"
        cases.append(("fastmoe (triton)", triton_case))
    cases.append(("fastmoe (torch)", lambda: audit_layer(ours, x)))
    cases.append(("hf v4 reference", lambda: audit_layer(v4, x)))
    for name, run in cases:
        a = run()
        rows.append({
            "block": name,
            **{f"{ph}_{kind}": a.total(tbl, ph) for ph in ("forward", "backward")
               for kind, tbl in (("triton", a.launches), ("ops", a.ops))},
            "forward_syncs": len(a.syncs["forward"]), "backward_syncs": len(a.syncs["backward"]),
            "audit": a,
        })
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = Parser(prog="fastmoe-bench audit",
                                     description="kernel launches and host syncs per MoE layer")
    parser.add_argument("--experts", type=count, default=64)
    parser.add_argument("--top-k", type=count, default=8)
    parser.add_argument("--tokens", type=count, default=32)
    parser.add_argument("--verbose", action="store_true", help="list the ops and kernels of each phase")
    args = parser.parse_args(argv)
    rows = compare(args.experts, args.top_k, args.tokens)
    print(f"E={args.experts} K={args.top_k} T={args.tokens}: launches per layer "
          "(Triton kernels + other device ops) and host syncs")
    head = f"{'block':<18} | {'fwd triton':>10} | {'fwd ops':>7} | {'fwd syncs':>9} | {'bwd triton':>10} | {'bwd ops':>7} | {'bwd syncs':>9}"
    print(head)
    print("-" * len(head))
    for r in rows:
        print(f"{r['block']:<18} | {r['forward_triton']:>10} | {r['forward_ops']:>7} | {r['forward_syncs']:>9} | "
              f"{r['backward_triton']:>10} | {r['backward_ops']:>7} | {r['backward_syncs']:>9}")
    if args.verbose:
        for r in rows:
            a = r["audit"]
            for ph in ("forward", "backward"):
                print(f"\n{r['block']} {ph}: triton {dict(a.launches[ph])}\n  ops {dict(a.ops[ph])}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
