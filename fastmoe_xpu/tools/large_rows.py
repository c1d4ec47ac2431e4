"""A layer whose row buffers pass 2^31 elements: Triton forward and backward against the torch backend.

``python -m fastmoe_xpu.tools.large_rows --device cuda`` runs one bf16 MoE layer at T=140,000
tokens, K=8, E=16, H=512, I=1024 (the shape at which an int32 row-index x stride product in a
fused-MoE kernel was seen to wrap: R = T*K = 1,120,000 routed rows make the ``gate_up [R, 2I]``
buffer 2.29e9 elements) on each Triton GEMM engine (``triton``, and ``triton_tma`` where the GPU has
TMA), forward and backward, and checks that

* every output and gradient (``out``, ``dx``, the router weights' and both expert weights'
  gradients) is finite, and
* the rows of sampled tokens equal the torch backend's on the same tokens: the output, the input
  gradient and the router-weight gradient of a token depend on that token alone, so the reference
  runs on the sampled tokens only. The sample holds the last tokens routed to the last expert
  (the highest rows of every row buffer, past 2^31 elements of ``gate_up``), the first tokens of
  the first expert, the batch's first and last tokens and random ones.

The weight gradients (sums over every row) are compared over the whole batch, as a relative norm,
with the torch backend run in fp32 on fp32 copies of the inputs: the Triton engine's error must be
within 1e-2 or within 1.25x the error of the torch backend run in the check's own dtype, whichever is
larger (``--no-weight-grads`` skips those two full-size layers). In bf16 a weight gradient that sums
70,000 rows per expert is only as close to another bf16 computation as its inputs' roundings allow
(about 1% between the two backends on an H200, since each rounds its SiLU*up rows differently), so a
bf16 reference is no judge; the fp32 one is. Tolerances on the sampled rows are the test suite's: in
bf16 ``|a - b| <= 1e-2 + 1e-2 * max|b|`` on values of order one (the weights are scaled by
``1/sqrt(fan_in)``). A wrapped offset reads or writes another row and misses these by orders of
magnitude (or faults).

Exit status 0 when every engine passes, 1 when one fails, 2 when the device is missing. Other shapes
(``--tokens`` etc.) serve small runs, e.g. on the CPU under ``TRITON_INTERPRET=1`` with ``--dtype
fp32`` (the interpreter has no bf16 arithmetic of its own).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict, dataclass, field

import torch

#: The shape of the check: Liger-Kernel's report of a wrapped int32 offset at T=140,000, K=8, I=1024.
DEFAULT_SHAPE = dict(tokens=140_000, top_k=8, experts=16, hidden=512, intermediate=1024)
INT32_LIMIT = 2**31
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
#: (rtol, atol) per dtype: the test suite's (tests/tolerances.py); atol is widened by rtol * max|reference|.
TOLERANCES = {torch.bfloat16: (1e-2, 1e-2), torch.float16: (2e-3, 2e-3), torch.float32: (1e-5, 1e-6)}


@dataclass
class EngineResult:
    engine: str
    ok: bool
    seconds: float = 0.0
    finite: bool = False
    #: max |triton - torch| over the sampled rows, and the bound it is held to, per tensor
    errors: dict[str, float] = field(default_factory=dict)
    bounds: dict[str, float] = field(default_factory=dict)
    #: ||dW_triton - dW_fp32|| / ||dW_fp32|| per expert weight (whole batch), and its bound (1e-2 or
    #: 1.25x the torch backend's own error in the check's dtype)
    weight_grad_rel: dict[str, float] = field(default_factory=dict)
    weight_grad_bounds: dict[str, float] = field(default_factory=dict)
    error: str | None = None


def make_inputs(tokens: int, top_k: int, experts: int, hidden: int, intermediate: int, dtype: torch.dtype,
                device: torch.device, seed: int = 0) -> dict[str, torch.Tensor]:
    """Activations, routing (softmax top-k of random logits, renormalised), expert weights scaled by
    ``1/sqrt(fan_in)`` (so that every intermediate is of order one and the tolerances mean something)
    and an output gradient, generated on ``device``."""
    g = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=g, device=device, dtype=torch.float32).to(dtype)
    logits = torch.randn(tokens, experts, generator=g, device=device)
    weights, idx = torch.topk(torch.softmax(logits, dim=-1), top_k, dim=-1)
    weights = (weights / weights.sum(-1, keepdim=True)).to(dtype)
    w_gu = (torch.randn(experts, 2 * intermediate, hidden, generator=g, device=device) * hidden**-0.5).to(dtype)
    w_d = (torch.randn(experts, hidden, intermediate, generator=g, device=device) * intermediate**-0.5).to(dtype)
    dout = torch.randn(tokens, hidden, generator=g, device=device, dtype=torch.float32).to(dtype)
    return dict(x=x, weights=weights, idx=idx, w_gu=w_gu, w_d=w_d, dout=dout)


def sample_tokens(idx: torch.Tensor, experts: int, n: int, seed: int = 0) -> torch.Tensor:
    """About ``n`` distinct token ids: the last ``n/4`` tokens routed to the last expert (its rows
    are the buffers' highest), the first ``n/8`` routed to expert 0, the first and last token and
    random ones; sorted."""
    T = idx.shape[0]
    last = torch.nonzero((idx == experts - 1).any(-1)).flatten()
    first = torch.nonzero((idx == 0).any(-1)).flatten()
    g = torch.Generator(device="cpu").manual_seed(seed)
    rand = torch.randint(0, T, (max(n - n // 4 - n // 8 - 2, 0),), generator=g).to(idx.device)
    ends = torch.tensor([0, T - 1], device=idx.device)
    picked = torch.cat([last[-(n // 4):], first[: n // 8], ends, rand]) if T else ends[:0]
    return torch.unique(picked)


def _layer(inputs: dict[str, torch.Tensor], backend: str, engine: str, tokens: torch.Tensor | None = None):
    """Forward and backward of stages 2-5 on ``inputs`` (or on the rows ``tokens`` of them): the
    output and the gradients of x, the routing weights and both expert weights."""
    from ..autograd.moe_experts import moe_experts_forward

    sel = (lambda t: t) if tokens is None else (lambda t: t[tokens])
    x = sel(inputs["x"]).detach().requires_grad_()
    w = sel(inputs["weights"]).detach().requires_grad_()
    w_gu = inputs["w_gu"].detach().requires_grad_()
    w_d = inputs["w_d"].detach().requires_grad_()
    out = moe_experts_forward(x, w, sel(inputs["idx"]), w_gu, w_d, backend=backend, gemm_engine=engine)
    out.backward(sel(inputs["dout"]))
    return {"out": out.detach(), "dx": x.grad, "dweights": w.grad, "dw_gate_up": w_gu.grad, "dw_down": w_d.grad}


def _sync(device: torch.device) -> None:
    if device.type in ("cuda", "xpu"):
        getattr(torch, device.type).synchronize()


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()


def weight_grad_reference(inputs: dict[str, torch.Tensor]) -> dict:
    """The weight gradients of the torch backend over the whole batch in fp32 (``fp32``), and that
    backend's own relative error against them in the inputs' dtype (``native_rel``)."""
    wide = {k: (v.float() if v.is_floating_point() else v) for k, v in inputs.items()}
    full = _layer(wide, "torch", "native")
    fp32 = {k: full[k] for k in ("dw_gate_up", "dw_down")}
    del full, wide
    native = _layer(inputs, "torch", "native")
    rel = {k: _rel(native[k], fp32[k]) for k in fp32}
    del native
    return {"fp32": fp32, "native_rel": rel}


def check_engine(inputs: dict[str, torch.Tensor], engine: str, tokens: torch.Tensor, weight_grads: bool,
                 reference: dict | None) -> EngineResult:
    """Run the Triton backend with ``engine`` over the whole batch; compare the sampled rows with
    the torch backend on those rows and, given ``reference`` (:func:`weight_grad_reference`), the
    weight gradients."""
    res = EngineResult(engine, ok=False)
    device = inputs["x"].device
    rtol, atol = TOLERANCES[inputs["x"].dtype]
    t0 = time.perf_counter()
    try:
        got = _layer(inputs, "triton", engine)
        _sync(device)
    except Exception as exc:  # a fault or a launcher error is this engine's result
        res.error = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
        res.seconds = time.perf_counter() - t0
        return res
    res.seconds = time.perf_counter() - t0
    res.finite = all(bool(torch.isfinite(v).all()) for v in got.values())
    want = _layer(inputs, "torch", "native", tokens)
    ok = res.finite
    for name in ("out", "dx", "dweights"):
        a, b = got[name][tokens].float(), want[name].float()
        err = (a - b).abs().max().item() if b.numel() else 0.0
        bound = atol + rtol * (b.abs().max().item() if b.numel() else 0.0)
        res.errors[name], res.bounds[name] = err, bound
        ok = ok and err <= bound
    if weight_grads and reference is not None:
        for name in ("dw_gate_up", "dw_down"):
            rel = _rel(got[name], reference["fp32"][name])
            bound = max(rtol, 1.25 * reference["native_rel"][name])
            res.weight_grad_rel[name], res.weight_grad_bounds[name] = rel, bound
            ok = ok and rel <= bound
    del got
    res.ok = ok
    return res


def run(tokens: int, top_k: int, experts: int, hidden: int, intermediate: int, *, device: str = "cuda",
        dtype: str = "bf16", engines: tuple[str, ...] | None = None, samples: int = 512, seed: int = 0,
        weight_grads: bool = True, progress=print) -> dict:
    """The check as a dict (``ok``, the shape, the largest buffer's element count, one entry per
    engine); see the module's description."""
    from ..kernels import registry

    dev = torch.device(device)
    dt = DTYPES[dtype]
    if engines is None:
        engines = tuple(e for e in ("triton", "triton_tma") if registry.unavailable_reason(e, "triton", dev, dt) is None)
    rows = tokens * top_k
    largest = rows * 2 * intermediate
    report = {"shape": dict(tokens=tokens, top_k=top_k, experts=experts, hidden=hidden, intermediate=intermediate),
              "dtype": dtype, "device": str(dev), "rows": rows, "gate_up_elements": largest,
              "past_int32": largest >= INT32_LIMIT, "engines": []}
    progress(f"T={tokens} K={top_k} E={experts} H={hidden} I={intermediate} {dtype} on {dev}: R={rows} rows, "
             f"gate_up [R, 2I] = {largest:,} elements ({'past' if largest >= INT32_LIMIT else 'below'} 2^31)")
    inputs = make_inputs(tokens, top_k, experts, hidden, intermediate, dt, dev, seed)
    sampled = sample_tokens(inputs["idx"], experts, samples, seed)
    report["sampled_tokens"] = int(sampled.numel())
    reference = None
    if weight_grads:
        t0 = time.perf_counter()
        reference = weight_grad_reference(inputs)
        _sync(dev)
        report["torch_weight_grad_rel"] = reference["native_rel"]
        progress(f"  torch backend over the batch in fp32 (weight-gradient reference) and in {dtype}: "
                 f"{time.perf_counter() - t0:.1f} s; {dtype} torch backend against fp32: " + ", ".join(
                     f"{k} rel {v:.2e}" for k, v in reference["native_rel"].items()))
    ok = True
    for engine in engines:
        res = check_engine(inputs, engine, sampled, weight_grads, reference)
        ok = ok and res.ok
        report["engines"].append(asdict(res))
        detail = res.error or (f"finite={res.finite} " + " ".join(
            f"{k}: {res.errors[k]:.3g} (<= {res.bounds[k]:.3g})" for k in res.errors) + "".join(
            f" {k}: rel {v:.2e} (<= {res.weight_grad_bounds[k]:.2e})" for k, v in res.weight_grad_rel.items()))
        progress(f"  triton@{engine}: {'ok' if res.ok else 'FAILED'} in {res.seconds:.1f} s; {detail}")
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    if not engines:
        ok = False
        progress("  no Triton engine runs here")
    report["ok"] = ok
    return report


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda", help="cuda (default), xpu, or cpu (TRITON_INTERPRET=1, small shapes)")
    ap.add_argument("--dtype", choices=tuple(DTYPES), default="bf16")
    for name, value in DEFAULT_SHAPE.items():
        ap.add_argument(f"--{name.replace('_', '-')}", type=int, default=value)
    ap.add_argument("--engines", nargs="+", default=None,
                    help="Triton GEMM engines to check (default: triton, and triton_tma where it runs)")
    ap.add_argument("--samples", type=int, default=512, help="tokens compared with the torch backend (default 512)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-weight-grads", action="store_true",
                    help="skip the whole-batch torch reference for the weight gradients")
    ap.add_argument("--json", metavar="PATH", help="also write the report as JSON")
    args = ap.parse_args(argv)
    dev = torch.device(args.device)
    if dev.type == "cuda" and not torch.cuda.is_available() or \
            dev.type == "xpu" and not (hasattr(torch, "xpu") and torch.xpu.is_available()):
        print(f"error: torch sees no {dev.type} device here; run on a GPU machine (or --device cpu with "
              "TRITON_INTERPRET=1 at a small shape)", file=sys.stderr)
        return 2
    report = run(args.tokens, args.top_k, args.experts, args.hidden, args.intermediate, device=args.device,
                 dtype=args.dtype, engines=tuple(args.engines) if args.engines else None, samples=args.samples,
                 seed=args.seed, weight_grads=not args.no_weight_grads, progress=lambda s: print(s, flush=True))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(report, f, indent=1)
    print("large rows:", "ok" if report["ok"] else "FAILED")
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
