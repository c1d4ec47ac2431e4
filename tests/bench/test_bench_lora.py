"""``python -m bench lora``: a tiny LoRA step of a family's experts layer, grouped_mm against fastmoe,
with CPU time, wall clock and the step's peak of allocator bytes."""
from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("peft")

from bench.studies.lora import main, peak_bytes  # noqa: E402


def test_peak_bytes_follows_the_allocator() -> None:
    """The running sum of allocations and frees: a 4 MB temporary freed before an 8 MB one peaks at
    8 MB above the start (plus the few bytes of scalars), not 12."""
    def fn() -> None:
        a = torch.empty(1 << 20)
        del a
        b = torch.empty(2 << 20)
        del b

    peak = peak_bytes(fn)
    assert 8 << 20 <= peak < (8 << 20) + 4096


def test_lora_bench_tiny(tmp_path, capsys) -> None:
    old = torch.get_num_threads()
    try:
        rc = main(["--family", "mixtral", "--scale", "64", "--tokens", "12", "--rounds", "1", "--low-rank", "loop",
                   "--handed-in", "--json", str(tmp_path / "lora.json")])
    finally:
        torch.set_num_threads(old)
    assert rc == 0
    printed = capsys.readouterr().out
    (r,) = json.loads((tmp_path / "lora.json").read_text())
    assert set(r["cpu_s"]) == {"grouped_mm", "fastmoe", "fastmoe (r-wide on loop)",
                                "fastmoe (adapters handed in)"}
    for name in r["cpu_s"]:
        assert r["cpu_s"][name] > 0 and r["wall_s"][name] > 0 and r["peak_bytes"][name] > 0
        assert f"| {name} |" in printed or name == "grouped_mm"
    assert all(err < 1e-5 for err in r["adapter_grad_rel_err"].values())


def test_lora_bench_tiny_and_decode_shapes(tmp_path, capsys) -> None:
    """``--shapes tiny decode``: the tiny models' experts (H=96, T=66) and a decode step (T=8) of the
    scaled bench shape, each printed with its speed-up over grouped_mm."""
    from bench.studies.lora import DECODE_TOKENS, TINY_TOKENS, cases

    assert [(c.hidden, c.experts, c.tokens) for c in cases(["tiny"], ["mixtral", "qwen3_moe", "olmoe"], 4, 1024)] == [
        (96, 6, TINY_TOKENS), (96, 10, TINY_TOKENS)]  # olmoe has no tiny shape
    (dec,) = cases(["decode"], ["olmoe"], 4, 1024)
    assert (dec.hidden, dec.tokens) == (512, DECODE_TOKENS)
    old = torch.get_num_threads()
    try:
        rc = main(["--shapes", "tiny", "decode", "--family", "mixtral", "--scale", "64", "--rounds", "1",
                   "--json", str(tmp_path / "lora.json")])
    finally:
        torch.set_num_threads(old)
    assert rc == 0
    printed = capsys.readouterr().out
    tiny, decode = json.loads((tmp_path / "lora.json").read_text())
    assert tiny["shape"]["shape_set"] == "tiny" and (tiny["shape"]["hidden"], tiny["shape"]["tokens"]) == (96, 66)
    assert decode["shape"]["shape_set"] == "decode /64" and decode["shape"]["tokens"] == DECODE_TOKENS
    for r in (tiny, decode):
        assert r["adapter_grad_rel_err"]["fastmoe"] < 1e-5
        ratio = r["cpu_s"]["grouped_mm"] / r["cpu_s"]["fastmoe"]
        assert f"| {ratio:.2f}x |" in printed
