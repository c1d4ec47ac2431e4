"""Activation memory of one MoE layer: bytes saved for backward, and what saving less costs in time.

For every Mula preset's layer shape (H, I, K and the rank's NR local experts, see ``presets.py``)
at T tokens, one fp32 forward of the whole block (router included) is run under
``torch.autograd.graph.saved_tensors_hooks``; every distinct storage saved is counted once, the
parameters left out, the input counted (a dense MLP saves it too). Contestants:

* ``fastmoe``: :class:`fastmoe_xpu.FastSparseMoeBlock` of this tree (saves x, gate/up [R, 2I], the
  router's tensors and the routing metadata);
* ``fastmoe@BASE``: the same block from git revision BASE (``--base``; revisions before the fused pair of Functions also saved
  h [R, I] and the expert outputs y [R, H]), imported from ``git archive`` as a second package;
* ``transformers``: transformers' ``OlmoeSparseMoeBlock`` (v5, its default experts implementation).

Beside them: the dense-equivalent ``T*H + 2*T*K*I`` elements (the input and the gate/up
pre-activation of a dense MLP of the same active size) and the routing metadata measured in the
fastmoe block (integer tensors). ``--precision int8 fp8`` measures the same block with quantized expert
GEMMs (``expert_precision``, same weights and input) beside it: the bytes it saves for backward and,
apart, the bytes of the weight codes it keeps from the forward for the backward (1 byte per expert
weight and one fp32 scale per output channel, outside autograd's saved tensors). ``--time`` also times forward+backward of ``fastmoe`` and
``fastmoe@BASE`` in the same process, interleaved, min over rounds, same weights and input.

    python -m fastmoe_bench saved --base dc12205 --tokens 128 2048 --time --rounds 3
    python -m fastmoe_bench saved --preset mula-7b-a1b --tokens 2048 --precision int8 fp8
"""
from __future__ import annotations

import importlib
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Callable

import torch
import torch.nn as nn

from ..harness.presets import PRESETS, Preset
from ..harness.usage import Parser, count

MULA = [p for name, p in PRESETS.items() if name.startswith("mula")]


def _config(p: Preset) -> SimpleNamespace:
    return SimpleNamespace(hidden_size=p.hidden, intermediate_size=p.intermediate, num_experts=p.local_experts,
                           num_experts_per_tok=p.top_k, norm_topk_prob=False, hidden_act="silu")


def load_base(rev: str) -> object:
    """The ``fastmoe_xpu`` package of git revision ``rev``, imported as ``fastmoe_xpu_base`` (its
    imports are relative, so a renamed copy is a second, independent package)."""
    root = Path(__file__).resolve().parents[1]
    dest = Path(tempfile.mkdtemp(prefix="fastmoe_base_"))
    tar = subprocess.run(["git", "-C", str(root), "archive", rev, "fastmoe_xpu"], check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(dest)], input=tar, check=True)
    (dest / "fastmoe_xpu").rename(dest / "fastmoe_xpu_base")
    sys.path.insert(0, str(dest))
    return importlib.import_module("fastmoe_xpu_base")


def saved(block: nn.Module, x: torch.Tensor) -> tuple[int, int]:
    """``(all bytes, integer-tensor bytes)`` saved by one forward; storages once, parameters left out."""
    params = {p.untyped_storage().data_ptr() for p in block.parameters()}
    seen: dict[int, tuple[int, bool]] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        st = t.untyped_storage()
        if st.data_ptr() not in params:
            seen[st.data_ptr()] = (st.nbytes(), not t.dtype.is_floating_point)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = block(x)
    del out
    return sum(n for n, _ in seen.values()), sum(n for n, i in seen.values() if i)


def weight_code_bytes() -> int:
    """Bytes of the quantized weights kept for the backward (codes and scales), all blocks together."""
    from fastmoe_xpu.kernels.quantized import core

    return sum(e[4].codes.nbytes + e[4].scales.nbytes for e in core._WEIGHTS.values() if e[0]() is not None)


def precision_bytes(p: Preset, block: nn.Module, x: torch.Tensor, precision: str) -> tuple[int, int]:
    """``(bytes saved for backward, weight-code bytes kept)`` of ``block``'s twin (same weights) with
    ``expert_precision=precision`` on input ``x``."""
    from fastmoe_xpu import FastSparseMoeBlock
    from fastmoe_xpu.kernels.quantized import core

    core.forget_weights()
    q = FastSparseMoeBlock(_config(p), backend="torch", expert_precision=precision)
    q.load_state_dict(block.state_dict())
    try:
        return saved(q, x.clone().requires_grad_())[0], weight_code_bytes()
    finally:
        del q
        core.forget_weights()


def _hf_block(p: Preset) -> nn.Module | None:
    try:
        from transformers import OlmoeConfig
        from transformers.models.olmoe.modeling_olmoe import OlmoeSparseMoeBlock
    except Exception:  # transformers missing: the column says so
        return None
    cfg = OlmoeConfig(hidden_size=p.hidden, intermediate_size=p.intermediate, num_experts=p.local_experts,
                      num_experts_per_tok=p.top_k, norm_topk_prob=False)
    return OlmoeSparseMoeBlock(cfg)


def _fb(block: nn.Module, x: torch.Tensor, g: torch.Tensor) -> Callable[[], float]:
    def run() -> float:
        xx = x.detach().requires_grad_()
        t0 = time.perf_counter()
        block(xx).backward(g)
        return time.perf_counter() - t0
    return run


def _columns(precisions: list[str], timed: bool) -> list[tuple[str, str, str, Callable[[dict], Any]]]:
    """The table's columns: ``(title, alignment and width, number format, the value of a row)``."""
    mib, nan = 2.0 ** 20, float("nan")
    cols = [
        ("preset", "<18", "", lambda r: r["preset"]),
        ("T", ">5", "", lambda r: r["T"]),
        ("dense MiB", ">10", ".2f", lambda r: r["dense"] / mib),
        ("meta MiB", ">9", ".3f", lambda r: r["metadata"] / mib),
        ("fastmoe MiB", ">12", ".2f", lambda r: r["fastmoe"] / mib),
        ("x(dense+meta)", ">13", ".3f", lambda r: r["fastmoe"] / (r["dense"] + r["metadata"])),
        ("base MiB", ">9", ".2f", lambda r: r.get("base", nan) / mib),
        ("hf MiB", ">9", ".2f", lambda r: r.get("hf", nan) / mib),
        ("fastmoe/hf", ">10", ".3f", lambda r: r["fastmoe"] / r["hf"] if "hf" in r else nan),
    ]
    for prec in precisions:
        cols += [(f"{prec} MiB", ">9", ".2f", lambda r, k=prec: r[k] / mib),
                 (f"{prec} codes MiB", ">15", ".2f", lambda r, k=f"{prec}_weight_codes": r[k] / mib)]
    if timed:
        cols += [("F+B new s", ">10", ".3f", lambda r: r["fb_new"]),
                 ("F+B base s", ">11", ".3f", lambda r: r["fb_base"]),
                 ("new/base", ">9", ".3f", lambda r: r["fb_new"] / r["fb_base"])]
    return cols


def _table(rows: list[dict], precisions: list[str], timed: bool) -> list[str]:
    """The header line and one line a row, every column in its width."""
    cols = _columns(precisions, timed)
    lines = [" ".join(format(title, width) for title, width, _, _ in cols)]
    lines += [" ".join(format(value(r), width + fmt) for _, width, fmt, value in cols) for r in rows]
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = Parser(prog="fastmoe-bench saved", description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", nargs="+", default=[p.name for p in MULA], choices=sorted(PRESETS))
    ap.add_argument("--tokens", nargs="+", type=count, default=[128, 2048])
    ap.add_argument("--base", default=None, help="git revision whose block is measured beside this tree's")
    ap.add_argument("--time", action="store_true", help="also time F+B of this tree's block and --base's")
    ap.add_argument("--rounds", type=count, default=3)
    ap.add_argument("--precision", nargs="+", default=[], choices=["int8", "fp8"],
                    help="also measure the block with these expert-GEMM precisions (saved bytes, weight codes kept)")
    ap.add_argument("--no-progress", action="store_true")
    args = ap.parse_args(argv)
    if any(t < 1 for t in args.tokens):
        raise ValueError(f"--tokens must be positive, got {args.tokens}")
    if args.time and args.base is None:
        raise ValueError("--time compares with --base: give a git revision")
    from fastmoe_xpu import FastSparseMoeBlock

    base = load_base(args.base) if args.base else None
    try:
        from tqdm import tqdm
    except ImportError:  # progress bars are optional
        tqdm = None
    jobs = [(p, t) for p in (PRESETS[n] for n in args.preset) for t in args.tokens]
    bar = tqdm(jobs, desc="layers", disable=args.no_progress) if tqdm else jobs
    rows = []
    for p, T in bar:
        torch.manual_seed(0)
        new = FastSparseMoeBlock(_config(p), backend="torch")
        x = torch.randn(1, T, p.hidden)  # [B, S, H]: transformers' block wants three dims
        dense = (T * p.hidden + 2 * T * p.top_k * p.intermediate) * 4
        row = {"preset": p.name, "T": T, "dense": dense}
        row["fastmoe"], row["metadata"] = saved(new, x.clone().requires_grad_())
        for prec in args.precision:
            row[prec], row[f"{prec}_weight_codes"] = precision_bytes(p, new, x, prec)
        if base is not None:
            old = base.FastSparseMoeBlock(_config(p), backend="torch")
            old.load_state_dict(new.state_dict())
            row["base"] = saved(old, x.clone().requires_grad_())[0]
        hf = _hf_block(p)
        if hf is not None:
            with torch.no_grad():
                hf.gate.weight.copy_(new.gate.weight)
            row["hf"] = saved(hf, x.clone().requires_grad_())[0]
            del hf
        if args.time:
            g = torch.randn(1, T, p.hidden)
            runs = {"new": _fb(new, x, g), "base": _fb(old, x, g)}
            times: dict[str, list[float]] = {k: [] for k in runs}
            for k in runs:  # one cold call each
                runs[k]()
            for _ in range(args.rounds):
                for k in runs:  # interleaved, so drift on the shared machine hits both
                    times[k].append(runs[k]())
            row["fb_new"], row["fb_base"] = min(times["new"]), min(times["base"])
        rows.append(row)
        if base is not None:
            del old
        del new
    for line in _table(rows, args.precision, args.time):
        print(line)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
