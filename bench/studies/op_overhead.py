"""What one differentiable custom op costs per forward+backward on the CPU, by registration style.

``python -m bench op_overhead``: two copies of an op with the schema of ``fastmoe::mlp_combine``
(eleven arguments, two outputs) and a trivial body, one registered with ``torch.library.custom_op``
+ ``register_autograd``, one the way :mod:`fastmoe_xpu.autograd.ops` registers its ops (a library
fragment, the body as the CompositeExplicitAutograd kernel, a plain ``autograd.Function`` as the
Autograd kernel), and the body alone; forward+backward of each, interleaved, minimum over rounds
of CPU thread time. The difference to the body alone is what the op path adds to every layer call.
"""
from __future__ import annotations

import time

import torch
from ..harness.usage import Parser, count

_SCHEMA = ("(Tensor x, Tensor w, Tensor i1, Tensor i2, Tensor i3, Tensor i4, Tensor i5, str name, str group)"
           " -> (Tensor, Tensor)")
_BWD_SCHEMA = ("(Tensor d, Tensor x, Tensor w, Tensor i1, Tensor i2, Tensor i3, Tensor i4, Tensor i5, str name,"
               " str group) -> (Tensor, Tensor)")


def _body(x, w, i1, i2, i3, i4, i5, name, group):  # noqa: ANN001, ANN202
    return x.clone(), x.clone()


def _body_bwd(d, x, w, i1, i2, i3, i4, i5, name, group):  # noqa: ANN001, ANN202
    return d.clone(), w.clone()


def _fake(x, *rest):  # noqa: ANN001, ANN202
    return torch.empty_like(x), torch.empty_like(x)


def _fake_bwd(d, x, w, *rest):  # noqa: ANN001, ANN202
    return torch.empty_like(d), torch.empty_like(w)


def _custom_op():  # noqa: ANN202
    lib = torch.library.Library("fastmoe_overhead_a", "FRAGMENT")
    fwd = torch.library.custom_op("fastmoe_overhead_a::f", _body, mutates_args=(), schema=_SCHEMA)
    torch.library.register_fake("fastmoe_overhead_a::f", _fake)
    bwd = torch.library.custom_op("fastmoe_overhead_a::fb", _body_bwd, mutates_args=(), schema=_BWD_SCHEMA)
    torch.library.register_fake("fastmoe_overhead_a::fb", _fake_bwd)

    def setup(ctx, inputs, output):  # noqa: ANN001, ANN202
        x, w, *rows, name, group = inputs
        ctx.mark_non_differentiable(output[1])
        ctx.save_for_backward(x, w, *rows)
        ctx.names = (name, group)

    def backward(ctx, d, _):  # noqa: ANN001, ANN202
        dx, dw = bwd(d, *ctx.saved_tensors, *ctx.names)
        return dx, dw, None, None, None, None, None, None, None

    fwd.register_autograd(backward, setup_context=setup)
    return fwd, lib


def _fragment():  # noqa: ANN202
    lib = torch.library.Library("fastmoe_overhead_b", "FRAGMENT")
    lib.define("f" + _SCHEMA)
    lib.define("fb" + _BWD_SCHEMA)
    lib.impl("f", _body, "CompositeExplicitAutograd")
    lib.impl("fb", _body_bwd, "CompositeExplicitAutograd")
    torch.library.register_fake("fastmoe_overhead_b::f", _fake, lib=lib)
    torch.library.register_fake("fastmoe_overhead_b::fb", _fake_bwd, lib=lib)
    op, op_bwd = torch.ops.fastmoe_overhead_b.f.default, torch.ops.fastmoe_overhead_b.fb.default

    class Fn(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, w, *rest):  # noqa: ANN001, ANN205
            with torch._C._AutoDispatchBelowAutograd():
                out = op(x, w, *rest)
            ctx.mark_non_differentiable(out[1])
            ctx.save_for_backward(x, w, *rest[:5])
            ctx.names = rest[5:]
            return out

        @staticmethod
        def backward(ctx, d, _):  # noqa: ANN001, ANN205
            dx, dw = op_bwd(d, *ctx.saved_tensors, *ctx.names)
            return dx, dw, None, None, None, None, None, None, None

    def autograd_kernel(*args):  # noqa: ANN002, ANN202
        if torch.is_grad_enabled() and any(a.requires_grad for a in args[:2]):
            return Fn.apply(*args)
        with torch._C._AutoDispatchBelowAutograd():
            return op(*args)

    lib.impl("f", autograd_kernel, "Autograd")
    return op, lib


def main(argv: list[str] | None = None) -> None:
    ap = Parser(prog="fastmoe-bench op_overhead", description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=count, default=60)
    ap.add_argument("--calls", type=count, default=10, help="calls per timed round")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    a, _lib_a = _custom_op()
    b, _lib_b = _fragment()
    x = torch.randn(48, 64, requires_grad=True)
    w = torch.randn(8, 64, 64, requires_grad=True)
    rows = [torch.zeros(96, dtype=torch.int32) for _ in range(5)]

    def through(op):  # noqa: ANN001, ANN202
        def run() -> None:
            out, _ = op(x, w, *rows, "torch", "")
            out.sum().backward()
        return run

    def body_alone() -> None:
        out = x.clone()
        out.sum().backward()

    runs = {"custom_op + register_autograd": through(a), "library fragment + autograd.Function": through(b),
            "body alone": body_alone}
    best = dict.fromkeys(runs, float("inf"))
    for _ in range(args.rounds):
        for name, run in runs.items():
            run()
            t = time.thread_time()
            for _ in range(args.calls):
                run()
            best[name] = min(best[name], (time.thread_time() - t) / args.calls)
    base = best["body alone"]
    print("forward+backward of one op with mlp_combine's schema (CPU thread time, min over rounds)")
    for name, sec in best.items():
        extra = "" if name == "body alone" else f"  (+{(sec - base) * 1e6:.1f} us over the body)"
        print(f"  {name:40s} {sec * 1e6:7.1f} us{extra}")


if __name__ == "__main__":
    main()
