"""Autocast from the first call: the probes and timings the package runs when a layer first meets a
shape run outside the caller's autocast (a oneDNN probe comparing fp32 with a bf16 product raised
``Float did not match BFloat16`` on the first call inside ``torch.autocast("cpu", torch.bfloat16)``).
Every case starts from a fresh engine choice (``gemm_engine="auto"``, in-process choices and the
probes' caches dropped, an empty disk cache)."""
from __future__ import annotations

import pytest
import torch

from fastmoe_xpu import FastSparseMoeBlock
from fastmoe_xpu.kernels import registry
from fastmoe_xpu.kernels.quantized import core
from fastmoe_xpu.kernels.torch import onednn
from tolerances import assert_close

DTYPES = [torch.bfloat16, torch.float16]


@pytest.fixture
def fresh_choices(monkeypatch, tmp_path):
    monkeypatch.setenv("FASTMOE_GEMM_CACHE", str(tmp_path / "engines.json"))
    monkeypatch.delenv("FASTMOE_GEMM_ENGINE", raising=False)
    from fastmoe_xpu import settings

    with settings.reloaded():
        registry.forget_choices()
        onednn._probe.cache_clear()
        core._probe.cache_clear()
        yield
        registry.forget_choices()


@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp16"])
def test_block_trains_under_cpu_autocast_from_the_first_call(fresh_choices, dtype):
    """The block against transformers' OLMoE block under the same autocast (its router's linear runs
    in the autocast dtype in both)."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.OlmoeConfig(hidden_size=64, intermediate_size=32, num_experts=8, num_experts_per_tok=2)
    from transformers.models.olmoe.modeling_olmoe import OlmoeSparseMoeBlock

    theirs = OlmoeSparseMoeBlock(cfg)
    with torch.no_grad():  # a module built alone is not initialised by transformers
        for p in theirs.parameters():
            p.normal_(0.0, 0.1)
    ours = FastSparseMoeBlock.from_hf(theirs, gemm_engine="auto")
    x = torch.randn(8, 64, 64)
    out = {}
    for name, block in (("fastmoe", ours), ("transformers", theirs)):
        xi = x.clone().requires_grad_()
        with torch.autocast("cpu", dtype=dtype):
            y = block(xi)
        y = y[0] if isinstance(y, tuple) else y
        y.float().sum().backward()
        out[name] = (y.detach().float(), xi.grad, {n: p.grad for n, p in block.named_parameters()})
    assert_close(out["fastmoe"][0], out["transformers"][0], dtype, "output")
    assert_close(out["fastmoe"][1], out["transformers"][1], dtype, "input gradient")
    for name, g in out["fastmoe"][2].items():
        assert_close(g, out["transformers"][2][name], dtype, name)


@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp16"])
def test_family_model_under_cpu_autocast_matches_transformers(fresh_choices, dtype):
    pytest.importorskip("transformers.integrations.moe")
    import copy

    import fastmoe_xpu  # noqa: F401  (registers "fastmoe")
    from transformers import AutoModelForCausalLM

    from fastmoe_xpu.integrations.families import tiny_config

    cfg = tiny_config("qwen3_moe")
    torch.manual_seed(0)
    ours = AutoModelForCausalLM.from_config(cfg, experts_implementation="fastmoe")
    theirs = copy.deepcopy(ours)
    theirs.set_experts_implementation("grouped_mm")
    ids = torch.randint(3, cfg.vocab_size, (4, 16))
    out = {}
    for name, model in (("fastmoe", ours), ("grouped_mm", theirs)):
        with torch.autocast("cpu", dtype=dtype):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        out[name] = (loss.detach(), [p.grad for p in model.parameters()])
    assert_close(out["fastmoe"][0], out["grouped_mm"][0], dtype, "loss")
    for (name, _), g, h in zip(ours.named_parameters(), out["fastmoe"][1], out["grouped_mm"][1]):
        assert_close(g, h, dtype, name)
