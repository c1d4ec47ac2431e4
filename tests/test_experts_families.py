"""Every transformers family whose experts use ``@use_experts_implementation``, run with
``experts_implementation="fastmoe"`` against the family's own ``"eager"``: logits (or the base
model's hidden states), loss and every gradient at fp32 1e-5, the forward at bf16 1e-2.

One tiny config per family (hidden 32, 4 experts, top-2, two layers, MoE in both); the families
that cannot be built tiny are strict xfails with their reason, so the list in
``fastmoe_xpu.integrations.families.NOT_BUILT_TINY`` (and docs/families.md) stays true.
"""
from __future__ import annotations

import pytest
import torch
import transformers

pytest.importorskip("transformers.integrations.moe")

import fastmoe_xpu  # noqa: E402  (registers "fastmoe")
from family_util import family_params  # noqa: E402
from fastmoe_xpu.integrations.families import (  # noqa: E402
    NOT_BUILT_TINY, _models_dir, build_model, discover_families, tiny_config,
)
from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS  # noqa: E402

FAMILIES = discover_families()
#: Families whose own eager model does not run in bf16 on the CPU: their bf16 comparison checks only
#: that this is still so.
NO_BF16_EAGER = {
    "inkling2": "its router casts activations to fp32 but keeps bf16 weights (a dtype error in eager)",
    "inkling2_loop": "the same router as inkling2 (fp32 activations, bf16 weights)",
}


def _params() -> list:
    return family_params(FAMILIES)


@pytest.fixture
def fastmoe_calls(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Counts calls of the registered function, so a family whose experts never ran cannot pass."""
    calls = [0]

    def counting(*args, **kwargs):
        calls[0] += 1
        return fastmoe_xpu.fastmoe_experts_forward(*args, **kwargs)

    monkeypatch.setitem(ALL_EXPERTS_FUNCTIONS, "fastmoe", counting)
    return calls


def _run(model, ids: torch.Tensor, is_lm: bool, backward: bool = True):
    torch.manual_seed(1)
    model.zero_grad(set_to_none=True)
    if is_lm:
        out = model(input_ids=ids, labels=ids, use_cache=False)
        lead, loss = out.logits, out.loss
    else:  # base model: a loss on the hidden states reaches every parameter all the same
        lead = model(input_ids=ids, use_cache=False).last_hidden_state
        loss = lead.float().pow(2).mean()
    if backward:
        loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters()}
    return lead.detach().float(), loss.detach().float(), grads


def test_walk_covers_the_known_families() -> None:
    names = {f.name for f in FAMILIES}
    # The families the issue names, found by reading the sources; the walk is not an empty loop.
    assert {"olmoe", "qwen2_moe", "qwen3_moe", "mixtral", "deepseek_v3", "gpt_oss", "nemotron_h"} <= names
    gpt_oss = next(f for f in FAMILIES if f.name == "gpt_oss")
    assert gpt_oss.flags == {"is_concatenated": False, "is_transposed": True, "has_bias": True} and gpt_oss.custom_gate


@pytest.mark.parametrize("family", sorted(NOT_BUILT_TINY))
def test_not_built_tiny_lists_only_decorated_families(family: str) -> None:
    """Each family listed as not built tiny is one the walk finds: a family whose folder is in
    transformers without decorated experts is a stale entry. A family this transformers does not
    ship at all (added in a later release) has nothing to check."""
    if not (_models_dir() / family).is_dir():
        pytest.skip(f"transformers {transformers.__version__} has no {family} family (a later release added it)")
    assert family in {f.name for f in FAMILIES}, f"{family} is listed as not built tiny but has no decorated experts"


def _assert_same_step(family: str, got: tuple, ref: tuple) -> None:
    """Logits, loss and every parameter's gradient of one step (``_run``'s results) equal at fp32 1e-5."""
    torch.testing.assert_close(got[0], ref[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got[1], ref[1], atol=1e-5, rtol=1e-5)
    for name, g_ref in ref[2].items():
        g = got[2][name]
        assert (g is None) == (g_ref is None), f"{family}: {name} has a gradient in one implementation only"
        if g is not None:
            torch.testing.assert_close(g, g_ref, atol=1e-5, rtol=1e-5, msg=lambda m: f"{family} grad {name}: {m}")


@pytest.mark.parametrize("family", _params())
def test_family_matches_eager(family: str, fastmoe_calls: list[int]) -> None:
    cfg = tiny_config(family)
    torch.manual_seed(0)
    model, is_lm = build_model(cfg, "eager")
    model.float().train()
    ids = torch.randint(3, cfg.vocab_size, (2, 9))
    ref = _run(model, ids, is_lm)
    assert fastmoe_calls[0] == 0
    model.set_experts_implementation("fastmoe")
    got = _run(model, ids, is_lm)
    assert fastmoe_calls[0] >= 1, f"{family}: the fastmoe experts function never ran"
    _assert_same_step(family, got, ref)

    # bf16 forward, same weights
    model.to(torch.bfloat16).set_experts_implementation("eager")
    if family in NO_BF16_EAGER:
        with pytest.raises(RuntimeError), torch.no_grad():
            _run(model, ids, is_lm, backward=False)
        return
    with torch.no_grad():
        ref16 = _run(model, ids, is_lm, backward=False)
        model.set_experts_implementation("fastmoe")
        got16 = _run(model, ids, is_lm, backward=False)
    # 1e-2, with rtol at one bf16 ulp (2**-6): base models compare hidden states of size ~2, where
    # 1e-2 is below bf16 resolution. Where a family's own bf16 noise is larger (a post-expert norm
    # amplifies it), transformers' grouped_mm is off by as much: then ours may be off by at most twice that.
    err = (got16[0] - ref16[0]).abs()
    if bool((err > 1e-2 + 1.6e-2 * ref16[0].abs()).any()):
        model.set_experts_implementation("grouped_mm")
        with torch.no_grad():
            hf16 = _run(model, ids, is_lm, backward=False)
        hf_err = (hf16[0] - ref16[0]).abs().max().item()
        assert err.max().item() <= 2 * hf_err, f"{family} bf16: fastmoe off by {err.max().item()}, grouped_mm by {hf_err}"


#: The families ``fastmoe-bench --family-models`` runs (bench/studies/families.py).
SMALL_FAMILIES = [f for f in ("qwen3_moe", "mixtral", "deepseek_v3", "gpt_oss", "olmoe") if f in {x.name for x in FAMILIES}]


@pytest.mark.parametrize("family", SMALL_FAMILIES)
def test_family_small_auto_layers_match_eager(family: str, fastmoe_calls: list[int],
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """At the size a family is first tried at (hidden 128, 8 experts, 4 x 64 tokens: above the
    padded op's budget, within the untimed engine's) with the engine left to ``auto``, as a user's
    model runs: a fused layout runs each layer in one piece (``grouped_mm.small_layer``); logits,
    loss and every gradient are eager's at fp32 1e-5."""
    from fastmoe_xpu import settings
    from fastmoe_xpu.kernels import grouped_mm

    pieces = [0]
    small_layer = grouped_mm.small_layer

    def counting(*args):
        pieces[0] += 1
        return small_layer(*args)

    monkeypatch.setattr(grouped_mm, "small_layer", counting)
    base = tiny_config(family)
    fields = {"hidden_size": 128, "num_experts": 8, "num_local_experts": 8, "n_routed_experts": 8}
    cfg = tiny_config(family, **{k: v for k, v in fields.items() if hasattr(base, k)})
    torch.manual_seed(0)
    model, is_lm = build_model(cfg, "eager")
    model.float().train()
    ids = torch.randint(3, cfg.vocab_size, (4, 64), generator=torch.Generator().manual_seed(1))
    ref = _run(model, ids, is_lm)
    model.set_experts_implementation("fastmoe")
    with settings.override(gemm_engine="auto"):
        got = _run(model, ids, is_lm)
    assert fastmoe_calls[0] >= 1
    if family != "gpt_oss":  # GPT-OSS's own gate between the GEMMs: the plain path
        assert pieces[0] >= 1, f"{family}: no layer ran in one piece"
    _assert_same_step(family, got, ref)
