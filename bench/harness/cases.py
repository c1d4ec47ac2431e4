"""One setup factory per benchmark case: inputs, routing and weights shared by every provider.

Every provider sees the same tokens, the same routing and the same expert weights, so timings
and results compare like with like. The router runs once here, outside the timed region: it is
the same ``[T, H] x [H, E]`` GEMM in every provider (under 0.5% of the layer's FLOPs at EP=1), and
in a single process it cannot be split across ranks the way stage 1 splits it.

Legend: T tokens, H hidden, I intermediate, E experts, K experts per token, NR local experts,
RT routed rows on this rank.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn as nn
import torch.nn.functional as F

from fastmoe_xpu.routing import forced_uniform_routing, topk_routing

from .presets import Preset

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}

#: transformers' initializer_range for OLMoE: the scale of every random weight here.
INIT_STD = 0.02


def draw_device(device: str | torch.device) -> torch.device:
    """Where a case's random inputs are drawn: on a GPU (cuda, xpu) the device itself, by its own
    generator; elsewhere the CPU. Drawn on the host, the inputs of a T=32k layer (the weights, and
    the GEMM-only bound's and the dense ceiling's operands: billions of elements per shape) took a
    second per 10^8 elements of one core, most of a practitioners' run on an H200; on the device they
    take milliseconds. A seed gives the same values every time on one kind of device; a GPU's values
    differ from the CPU's."""
    device = torch.device(device)
    return device if device.type in ("cuda", "xpu") else torch.device("cpu")


def generator(device: str | torch.device, seed: int) -> torch.Generator:
    """A generator seeded with ``seed`` on :func:`draw_device` of ``device``."""
    return torch.Generator(device=draw_device(device)).manual_seed(seed)


def randn(g: torch.Generator, *shape: int, std: float = 1.0, device: str | torch.device,
          dtype: torch.dtype) -> torch.Tensor:
    """Normal values of ``std`` drawn by ``g`` (from :func:`generator`) in fp32 where ``g`` lives, then
    put on ``device`` in ``dtype``."""
    t = torch.randn(*shape, generator=g, device=g.device)
    return (t * std if std != 1.0 else t).to(device=device, dtype=dtype)


@dataclass
class Case:
    preset: Preset
    dtype: torch.dtype
    device: torch.device
    x_TH: torch.Tensor
    weights_TK: torch.Tensor
    topk_idx_TK: torch.Tensor
    dout_TH: torch.Tensor
    w_gate_up_N2IH: nn.Parameter
    w_down_NHI: nn.Parameter
    gate_EH: torch.Tensor
    counts_N: list[int] = field(default_factory=list)

    @property
    def rows(self) -> int:
        """RT: routed rows on this rank."""
        return sum(self.counts_N)

    def flops(self) -> dict[str, float]:
        """Useful FLOPs of the expert GEMMs, the formula every GFLOP/s figure uses.

        Per routed row: forward ``2*H*2I`` (gate/up) + ``2*I*H`` (down) = ``6*H*I``; backward twice
        that (input and weight gradient of both GEMMs) = ``12*H*I``. Routing, gather, SiLU and
        reduction are not counted.
        """
        p = self.preset
        fwd = 6.0 * p.hidden * p.intermediate * self.rows
        return {"fwd": fwd, "bwd": 2.0 * fwd, "fwdbwd": 3.0 * fwd, "infer": fwd}

    def describe(self) -> dict:
        c = self.counts_N
        return {
            "preset": self.preset.as_dict(),
            "dtype": str(self.dtype).replace("torch.", ""),
            "device": str(self.device),
            "rows": self.rows,
            "rows_per_expert": {"min": min(c), "mean": self.rows / len(c), "max": max(c)},
            "flops": self.flops(),
        }


def make_case(
    preset: Preset,
    *,
    dtype: str | torch.dtype = "fp32",
    device: str | torch.device = "cpu",
    seed: int = 0,
    routing: str = "router",
) -> Case:
    """Build the inputs of one case.

    ``routing="router"``: OLMoE's softmax top-k router (``norm_topk_prob=False``) on random weights,
    with its natural imbalance; ``"uniform"``: forced uniform routing (every expert gets T*K/E rows).
    Rank 0's experts ``[0, NR)`` are the local ones; the others exist only in the routing.
    """
    if isinstance(dtype, str):
        if dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
        dtype = DTYPES[dtype]
    if routing not in ("router", "uniform"):
        raise ValueError(f"routing must be 'router' or 'uniform', got {routing!r}")
    device = torch.device(device)
    p = preset
    T, H, I, E, K, NR = p.tokens, p.hidden, p.intermediate, p.experts, p.top_k, p.local_experts
    g = generator(device, seed)  # on the device where it is a GPU: see draw_device

    def draw(*shape: int, std: float = 1.0) -> torch.Tensor:
        return randn(g, *shape, std=std, device=device, dtype=dtype)

    x_TH = draw(T, H)
    gate_EH = draw(E, H, std=INIT_STD)
    with torch.no_grad():
        logits_TE = F.linear(x_TH, gate_EH)
        if routing == "router":
            weights_TK, idx_TK = topk_routing(logits_TE, K, norm_topk_prob=False)
        else:
            weights_TK, idx_TK = forced_uniform_routing(logits_TE, K, norm_topk_prob=False)
    w_gate_up = nn.Parameter(draw(NR, 2 * I, H, std=INIT_STD))
    w_down = nn.Parameter(draw(NR, H, I, std=INIT_STD))
    dout_TH = draw(T, H)
    counts = torch.bincount(idx_TK.reshape(-1).cpu(), minlength=E)[:NR].tolist()
    return Case(p, dtype, device, x_TH, weights_TK.contiguous(), idx_TK.contiguous(), dout_TH,
                w_gate_up, w_down, gate_EH, counts)
