"""Block F+B on the CPU, eager, this tree against an earlier revision, in one process.

``python scripts/eager_block_before_after.py [REV]`` (default ``HEAD~1``): extracts REV's
``fastmoe_xpu`` with ``git archive`` under another package name, builds both blocks with the same
weights and times forward+backward interleaved, min over rounds (one thread).
"""
from __future__ import annotations

import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


def main(rev: str = "HEAD~1") -> None:
    tmp = Path(tempfile.mkdtemp(prefix="fastmoe_before_"))
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", rev, "fastmoe_xpu"], check=True, capture_output=True)
    subprocess.run(["tar", "-x", "-C", str(tmp)], input=archive.stdout, check=True)
    (tmp / "fastmoe_xpu").rename(tmp / "fastmoe_xpu_before")  # the package imports itself relatively
    sys.path.insert(0, str(ROOT))
    sys.path.append(str(tmp))
    from transformers import OlmoeConfig

    from fastmoe_xpu import FastSparseMoeBlock as New
    from fastmoe_xpu_before import FastSparseMoeBlock as Old

    torch.set_num_threads(1)
    print(f"block F+B, eager, fp32, min over 7 rounds of 10; before = {rev}")
    for H, I, E, K, T in [(16, 8, 4, 2, 10), (128, 64, 8, 2, 64), (512, 256, 32, 4, 256)]:
        cfg = OlmoeConfig(hidden_size=H, intermediate_size=I, num_experts=E, num_experts_per_tok=K)
        torch.manual_seed(0)
        new = New(cfg, backend="torch")
        old = Old(cfg, backend="torch")
        old.load_state_dict(new.state_dict())
        x = torch.randn(T, H, requires_grad=True)
        best = {"before": float("inf"), "after": float("inf")}
        for _ in range(7):
            for name, m in (("before", old), ("after", new)):
                t0 = time.perf_counter()
                for _ in range(10):
                    m(x).sum().backward()
                best[name] = min(best[name], (time.perf_counter() - t0) / 10)
        print(f"H={H} I={I} E={E} K={K} T={T}: before {best['before'] * 1e3:.3f} ms, after "
              f"{best['after'] * 1e3:.3f} ms, after/before {best['after'] / best['before']:.3f}")


if __name__ == "__main__":
    main(*sys.argv[1:2])
