"""The two fp8 recipes' numbers against full precision: ``TRITON_INTERPRET=1 fastmoe-bench fp8_recipes``.

One layer (``--shape T H I E K``, default 32 256 64 4 2), fp32, on the Triton base (the interpreter on
the CPU, ``--device cuda`` compiled), run at full precision and with ``expert_precision="fp8"`` (per-row
and per-output-channel scales) and ``"fp8-block"`` (128-value blocks); x's column 0 multiplied by each
``--outliers`` factor. Prints, per factor and recipe, the relative norm of the difference from the
full-precision layer (%) of the output and each gradient, as a markdown table (docs/precision.md).
"""
from __future__ import annotations

import os

import torch

from fastmoe_xpu.autograd.moe_experts import moe_experts_forward
from fastmoe_xpu.routing import topk_routing

from ..harness.usage import Parser, count, fail, seconds

COLUMNS = ("out", "dx", "dw_gate_up", "dw_down", "d router weights")


def layer(T: int, H: int, I: int, E: int, K: int, seed: int) -> tuple[torch.Tensor, ...]:  # noqa: E741
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=g)
    weights, idx = topk_routing(torch.randn(T, E, generator=g), K, True)
    return (x, weights, idx, torch.randn(E, 2 * I, H, generator=g) * 0.3, torch.randn(E, H, I, generator=g) * 0.3,
            torch.randn(T, H, generator=g))


def run(case: tuple[torch.Tensor, ...], precision: str | None, device: str) -> list[torch.Tensor]:
    x, weights, idx, w_gu, w_d, dout = (t.to(device) for t in case)
    leaves = [t.clone().requires_grad_(True) for t in (x, weights, w_gu, w_d)]
    out = moe_experts_forward(leaves[0], leaves[1], idx, leaves[2], leaves[3], backend="triton",
                              expert_precision=precision)
    out.backward(dout)
    return [t.detach().cpu() for t in (out, leaves[0].grad, leaves[2].grad, leaves[3].grad, leaves[1].grad)]


def main(argv: list[str] | None = None) -> int:
    ap = Parser(prog="fastmoe-bench fp8_recipes", description=__doc__.splitlines()[0])
    ap.add_argument("--shape", nargs=5, type=count, default=[32, 256, 64, 4, 2], metavar=("T", "H", "I", "E", "K"))
    ap.add_argument("--outliers", nargs="+", type=seconds, default=[1.0, 50.0, 2000.0], metavar="FACTOR",
                    help="what x's column 0 is multiplied by, one table row pair each (default 1 50 2000)")
    ap.add_argument("--device", default="cpu", help="cpu (Triton's interpreter: TRITON_INTERPRET=1) or cuda (sm_89+)")
    ap.add_argument("--seed", type=int, default=5)
    args = ap.parse_args(argv)
    T, H, I, E, K = args.shape  # noqa: E741
    if K > E:
        fail(f"error: --shape: K={K} experts per token of E={E} (see fastmoe-bench fp8_recipes --help)")
    if torch.device(args.device).type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        fail("error: on the CPU the Triton kernels run under the interpreter: TRITON_INTERPRET=1 fastmoe-bench "
             "fp8_recipes ... (set before Python starts)")
    print("| x column 0 | recipe | " + " | ".join(COLUMNS) + " |")
    print("|---|---|" + "---:|" * len(COLUMNS))
    for factor in args.outliers:
        case = layer(*args.shape, seed=args.seed)
        case[0][:, 0] *= factor
        exact = run(case, None, args.device)
        for precision in ("fp8", "fp8-block"):
            got = run(case, precision, args.device)
            errs = [100 * ((a - b).norm() / b.norm()).item() for a, b in zip(got, exact)]
            print(f"| x{factor:g} | {precision} | " + " | ".join(f"{e:.2f}" for e in errs) + " |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
