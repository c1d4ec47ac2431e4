"""The two limits every case is measured against, in the same run as the providers.

- Dense-matmul ceiling: one large square ``torch.mm`` of the case's dtype, the machine's GEMM rate.
- GEMM-only bound: the layer's own per-expert GEMMs of forward and backward, with the same shapes
  (the case's per-expert row counts), run back to back with ``torch.mm`` into buffers allocated
  once, and nothing else: no routing, gather, activation, scatter, reduction or allocation. No
  implementation built from per-expert ``torch.mm`` calls (transformers' included) can beat it by
  more than noise; one on a faster GEMM library can (the ``onednn`` engine on CPUs where oneDNN's
  matmul beats MKL's, docs/engines.md), and then runs below 1.00x of it.

Legend: H hidden, I intermediate, NR local experts, RT routed rows, n rows of one expert.
"""
from __future__ import annotations

import torch

from .cases import Case, generator, randn


class DenseCeiling:
    """``C [m, n] = A [m, k] @ B [k, n]`` into a preallocated C (square ``n x n`` unless ``m``, ``k``
    are given)."""

    def __init__(self, n: int, dtype: torch.dtype, device: torch.device, m: int | None = None,
                 k: int | None = None) -> None:
        g = generator(device, 1)  # on a GPU drawn there (cases.draw_device)
        m, k = m or n, k or n
        self.n, self.shape = n, (m, k, n)
        self.a = randn(g, m, k, device=device, dtype=dtype)
        self.b = randn(g, k, n, device=device, dtype=dtype)
        self.c = torch.empty(m, n, device=device, dtype=dtype)

    @classmethod
    def same_flops(cls, case: Case) -> "DenseCeiling":
        """The dense ``[RT, H] @ [H, 3I]`` with the layer's forward FLOPs (``6*RT*H*I``)."""
        p = case.preset
        return cls(3 * p.intermediate, case.dtype, case.device, m=max(1, case.rows), k=p.hidden)

    @property
    def flops(self) -> float:
        m, k, n = self.shape
        return 2.0 * m * k * n

    def run(self) -> None:
        torch.mm(self.a, self.b, out=self.c)


class GemmBound:
    """The six GEMMs per expert of one forward+backward, and nothing else.

    Forward: ``gate_up [n, 2I] = a [n, H] @ Wgu^T``; ``y [n, H] = h [n, I] @ Wd^T``.
    Backward: ``dh = dy @ Wd``; ``dWd = dy^T @ h``; ``da = dgu @ Wgu``; ``dWgu = dgu^T @ a``.
    The layouts are those of ``F.linear`` and its gradients, which every provider uses.
    """

    def __init__(self, case: Case) -> None:
        dev, dt = case.device, case.dtype
        H, I = case.preset.hidden, case.preset.intermediate
        RT = case.rows
        g = generator(dev, 2)  # on a GPU drawn there (cases.draw_device)

        def rnd(*shape: int) -> torch.Tensor:
            return randn(g, *shape, std=0.1, device=dev, dtype=dt)

        self.w_gu = case.w_gate_up_N2IH.detach()
        self.w_d = case.w_down_NHI.detach()
        self.a, self.h, self.dy, self.dgu = rnd(RT, H), rnd(RT, I), rnd(RT, H), rnd(RT, 2 * I)
        self.gu = torch.empty(RT, 2 * I, device=dev, dtype=dt)
        self.y = torch.empty(RT, H, device=dev, dtype=dt)
        self.dh = torch.empty(RT, I, device=dev, dtype=dt)
        self.da = torch.empty(RT, H, device=dev, dtype=dt)
        self.dw_gu = torch.empty_like(self.w_gu)
        self.dw_d = torch.empty_like(self.w_d)
        bounds = [0]
        for c in case.counts_N:
            bounds.append(bounds[-1] + c)
        self.groups = [(e, bounds[e], bounds[e + 1]) for e in range(len(case.counts_N)) if bounds[e + 1] > bounds[e]]

    #: The GEMM ``mm(a, b, out=c)`` (a subclass may run another: ``torch._int_mm`` on int8 codes).
    mm = staticmethod(torch.mm)

    def gate_up_fwd(self) -> None:
        for e, s, t in self.groups:
            self.mm(self.a[s:t], self.w_gu[e].t(), out=self.gu[s:t])

    def down_fwd(self) -> None:
        for e, s, t in self.groups:
            self.mm(self.h[s:t], self.w_d[e].t(), out=self.y[s:t])

    def down_input_grad(self) -> None:
        for e, s, t in self.groups:
            self.mm(self.dy[s:t], self.w_d[e], out=self.dh[s:t])

    def down_weight_grad(self) -> None:
        for e, s, t in self.groups:
            self.mm(self.dy[s:t].t(), self.h[s:t], out=self.dw_d[e])

    def gate_up_input_grad(self) -> None:
        for e, s, t in self.groups:
            self.mm(self.dgu[s:t], self.w_gu[e], out=self.da[s:t])

    def gate_up_weight_grad(self) -> None:
        for e, s, t in self.groups:
            self.mm(self.dgu[s:t].t(), self.a[s:t], out=self.dw_gu[e])

    #: The six GEMMs by name, in the order of a forward and backward.
    GEMMS = ("gate_up_fwd", "down_fwd", "down_input_grad", "down_weight_grad", "gate_up_input_grad",
             "gate_up_weight_grad")

    def _run(self, *gemms: str) -> None:
        for name in gemms:
            getattr(self, name)()

    def down_bwd(self) -> None:
        self._run("down_input_grad", "down_weight_grad")

    def gate_up_bwd(self) -> None:
        self._run("gate_up_input_grad", "gate_up_weight_grad")

    def forward(self) -> None:
        self._run(*self.GEMMS[:2])

    def backward(self) -> None:
        self._run(*self.GEMMS[2:])
