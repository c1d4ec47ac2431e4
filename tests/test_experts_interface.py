"""The "fastmoe" experts implementation, case by case: each layout flag the decorator sets, the gates,
expert-parallel sentinels, edge shapes, save/load, and the patched OLMoE block answering
``set_experts_implementation``.

Each case builds one decorated experts module (a transformers family's own class where one has the
layout, else a small class decorated here) and compares ``fastmoe`` with the class's ``eager`` loop:
output, input gradient, router-weight gradient and every parameter gradient at fp32 1e-5.
"""
from __future__ import annotations

import copy
import inspect
from types import SimpleNamespace

import pytest
import torch
import torch.nn as nn

pytest.importorskip("transformers.integrations.moe")

import fastmoe_xpu  # noqa: E402
from fastmoe_xpu.integrations.experts import ExpertsLayoutError, describe_layout  # noqa: E402
from fastmoe_xpu.integrations.families import build_model, tiny_config  # noqa: E402
from transformers.activations import ACT2FN  # noqa: E402
from transformers.integrations.moe import use_experts_implementation  # noqa: E402

H, I, E = 16, 12, 4


def _config(impl: str = "eager", act: str = "silu") -> SimpleNamespace:
    return SimpleNamespace(_experts_implementation=impl, hidden_act=act)


def _make_class(**flags):
    """A decorated experts class of the given layout, with a plain per-expert eager loop that reads
    the same flags (transformers' batched/grouped functions define the layouts the same way)."""

    class Experts(nn.Module):
        def __init__(self, config):
            super().__init__()
            self.num_experts = E
            gated = flags.get("has_gate", True)
            up_out = 2 * I if gated else I
            up_shape = (E, H, up_out) if flags.get("is_transposed") else (E, up_out, H)
            down_shape = (E, I, H) if flags.get("is_transposed") else (E, H, I)
            setattr(self, "gate_up_proj" if gated else "up_proj", nn.Parameter(torch.randn(up_shape) * 0.3))
            self.down_proj = nn.Parameter(torch.randn(down_shape) * 0.3)
            if flags.get("has_bias"):
                setattr(self, ("gate_up_proj" if gated else "up_proj") + "_bias", nn.Parameter(torch.randn(E, up_out)))
                self.down_proj_bias = nn.Parameter(torch.randn(E, H))
            if flags.get("has_post_expert_norm"):
                self.post_expert_norm = nn.LayerNorm(H)
            self.act_fn = ACT2FN[config.hidden_act]

        def forward(self, hidden_states, top_k_index, top_k_weights):
            out = torch.zeros_like(hidden_states)
            for e in range(self.num_experts):
                tok, k = torch.where(top_k_index == e)
                if tok.numel() == 0:
                    continue
                x = hidden_states[tok]
                name = "gate_up_proj" if self.has_gate else "up_proj"
                w = getattr(self, name)[e]
                h = x @ w if self.is_transposed else x @ w.t()
                if self.has_bias:
                    h = h + getattr(self, name + "_bias")[e]
                h = self._apply_gate(h) if self.has_gate else self.act_fn(h)
                wd = self.down_proj[e]
                y = h @ wd if self.is_transposed else h @ wd.t()
                if self.has_bias:
                    y = y + self.down_proj_bias[e]
                if getattr(self, "has_post_expert_norm", False):  # the flag is newer than 5.17's decorator
                    y = self.post_expert_norm(y)
                out.index_add_(0, tok, y * top_k_weights[tok, k, None])
            return out

    return use_experts_implementation(Experts, **flags)


class _Interleaved:
    """A gate over interleaved [g0, u0, g1, u1, ...] columns (is_concatenated=False)."""

    def _apply_gate(self, gate_up: torch.Tensor) -> torch.Tensor:
        return self.act_fn(gate_up[..., ::2]) * gate_up[..., 1::2]


def _routing(T: int, K: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    idx = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)]) if T else torch.zeros(0, K, dtype=torch.long)
    w = torch.rand(T, K, generator=g)
    return idx, w


def _compare(module: nn.Module, x: torch.Tensor, idx: torch.Tensor, w: torch.Tensor) -> dict:
    results = {}
    for impl in ("eager", "fastmoe"):
        module.config._experts_implementation = impl
        module.zero_grad(set_to_none=True)
        xi, wi = x.clone().requires_grad_(), w.clone().requires_grad_()
        out = module(xi, idx, wi)
        (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum().backward()
        results[impl] = (out.detach(), xi.grad, wi.grad, {n: p.grad for n, p in module.named_parameters()})
    ref, got = results["eager"], results["fastmoe"]
    torch.testing.assert_close(got[0], ref[0], atol=1e-5, rtol=1e-5, msg=lambda m: f"output: {m}")
    for i, what in ((1, "d hidden"), (2, "d weights")):
        if ref[i] is None:
            assert got[i] is None or not got[i].any(), what
        else:
            torch.testing.assert_close(got[i], ref[i], atol=1e-5, rtol=1e-5, msg=lambda m, w=what: f"{w}: {m}")
    for n, g in ref[3].items():
        if g is None:
            assert got[3][n] is None or not got[3][n].any(), n
        else:
            torch.testing.assert_close(got[3][n], g, atol=1e-5, rtol=1e-5, msg=lambda m, n=n: f"grad {n}: {m}")
    return results


def _case(flags: dict, act: str = "silu", gate_mixin=None, T: int = 11, K: int = 2, idx=None):
    cls = _make_class(**flags)
    if gate_mixin is not None:
        cls = type("Experts", (gate_mixin, cls), {})
    torch.manual_seed(0)
    module = cls(_config(act=act))
    x = torch.randn(T, H)
    r_idx, w = _routing(T, K)
    return module, _compare(module, x, r_idx if idx is None else idx, w)


def test_concatenated_fused() -> None:
    module, _ = _case({})
    assert describe_layout(module)["fused"]


def test_interleaved() -> None:
    module, _ = _case({"is_concatenated": False}, gate_mixin=_Interleaved)
    assert not describe_layout(module)["fused"]


def test_transposed() -> None:
    _case({"is_transposed": True})


def test_biases() -> None:
    _case({"has_bias": True})


def test_no_gate() -> None:
    _case({"has_gate": False}, act="relu2")


def test_gelu() -> None:
    module, _ = _case({}, act="gelu")
    assert not describe_layout(module)["fused"]  # GELU runs on the plain path, SiLU is fused


_DECORATOR_FLAGS = inspect.signature(use_experts_implementation).parameters


@pytest.mark.skipif("has_post_expert_norm" not in _DECORATOR_FLAGS,
                    reason="this transformers' @use_experts_implementation has no has_post_expert_norm (added after 5.17)")
def test_post_expert_norm() -> None:
    _case({"has_post_expert_norm": True})


def test_decorator_without_post_expert_norm_flag() -> None:
    """transformers 5.17's decorator sets no has_post_expert_norm: a module without the attribute
    reads as one without a post-expert norm and gives the same result."""
    module = _make_class()(_config("fastmoe"))
    x, (idx, w) = torch.randn(7, H), _routing(7, 2)
    with torch.no_grad():
        ref = module(x, idx, w)
        if "has_post_expert_norm" in vars(module):
            del module.has_post_expert_norm
        flags = describe_layout(module)
        got = module(x, idx, w)
    assert flags["has_post_expert_norm"] is False and flags["fused"]
    torch.testing.assert_close(got, ref, atol=0, rtol=0)


def test_gpt_oss_clamped_swiglu() -> None:
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts

    cfg = tiny_config("gpt_oss")
    torch.manual_seed(0)
    module = GptOssExperts(cfg)
    for p in module.parameters():
        nn.init.normal_(p, std=0.5)  # large enough that the clamp at `limit` bites
    module.limit = 0.5
    x = torch.randn(9, cfg.hidden_size)
    idx = torch.stack([torch.randperm(module.num_experts)[:2] for _ in range(9)])
    flags = describe_layout(module)
    assert flags["custom_gate"] and flags["is_transposed"] and flags["has_bias"] and not flags["is_concatenated"]
    _compare(module, x, idx, torch.rand(9, 2))


@pytest.mark.parametrize("flags, act, gate_mixin", [
    ({"is_transposed": True, "has_bias": True}, "silu", None),
    ({"is_concatenated": False}, "silu", _Interleaved),
    ({"has_gate": False}, "relu2", None),
    ({}, "gelu", None),
], ids=["transposed-biased", "interleaved", "no-gate", "gelu"])
@pytest.mark.parametrize("one_piece", [True, False], ids=["plain-small", "route-combine"])
@pytest.mark.parametrize("torch_gmm", [True, False], ids=["torch-grouped-mm", "grouped-linear-op"])
def test_plain_path_small_layer_takes_the_untimed_engine(flags, act, gate_mixin, one_piece, torch_gmm,
                                                         monkeypatch) -> None:
    """With ``auto`` (not the suite's pinned "native"), a small layer on the plain path runs its two
    grouped GEMMs on the registry's untimed engine for its size, times nothing, and matches eager:
    output and every gradient. A module naming an engine keeps the base's own. ``one_piece``: its
    rows routed and combined by plain torch ops (``moe_experts._plain_small``, where the ops
    ``fastmoe::route`` and ``fastmoe::combine`` then never run); else by those ops. ``torch_gmm``:
    the GEMMs as torch's own differentiable grouped_mm (``PLAIN_TORCH_GROUPED_MM``); else through
    the ``fastmoe::grouped_linear`` op on the engine's launchers."""
    from fastmoe_xpu import settings
    from fastmoe_xpu.autograd import moe_experts, ops
    from fastmoe_xpu.integrations import experts as integration
    from fastmoe_xpu.kernels import grouped_mm, registry, timing

    monkeypatch.setattr(moe_experts, "PLAIN_ONE_PIECE", one_piece)
    monkeypatch.setattr(integration, "PLAIN_TORCH_GROUPED_MM", torch_gmm)
    gmms: list[int] = []
    gmm_op = grouped_mm.grouped_mm_op
    monkeypatch.setattr(grouped_mm, "grouped_mm_op", lambda: gmms.append(1) or gmm_op())
    staged: list[int] = []
    for name in ("route", "combine"):
        op = getattr(moe_experts, name)
        body = ops._BODY_OF[op]
        monkeypatch.setitem(ops._BODY_OF, op, lambda *a, __b=body: staged.append(1) or __b(*a))
    ran: list[str] = []
    kernels = ops.kernels
    monkeypatch.setattr(ops, "kernels", lambda name: ran.append(name) or kernels(name))
    monkeypatch.setattr(timing, "time_interleaved", lambda *a, **k: pytest.fail("a small layer was timed"))
    registry.forget_choices()
    engine_set = registry.kernel_set_name("torch", registry.SMALL_LAYER_ENGINE)
    with settings.override(gemm_engine="auto"):
        module, _ = _case(flags, act=act, gate_mixin=gate_mixin, T=13, K=3)
        assert not describe_layout(module)["fused"]
        assert bool(staged) != one_piece, staged
        assert (engine_set in ran) != torch_gmm and bool(gmms) == torch_gmm, (ran, gmms)
        ran.clear()
        module.fastmoe_gemm_engine = "loop"  # named: the plain path's own engine, as before
        module.config._experts_implementation = "fastmoe"
        module(torch.randn(5, H), *_routing(5, 2))
        assert engine_set not in ran and "torch" in ran
    registry.forget_choices()


@pytest.mark.parametrize("family", ["qwen2_moe", "deepseek_v3"])
def test_shared_experts_stay_the_familys(family: str) -> None:
    """The shared path is the family's own module; only the routed experts dispatch to us."""
    cfg = tiny_config(family)
    torch.manual_seed(0)
    model, _ = build_model(cfg, "fastmoe")
    mlp = model.model.layers[0].mlp
    shared = getattr(mlp, "shared_expert", None) or getattr(mlp, "shared_experts", None)
    assert shared is not None and not hasattr(shared, "has_gate")
    ids = torch.randint(3, cfg.vocab_size, (2, 5))
    out_f = model(input_ids=ids, labels=ids, use_cache=False)
    model.set_experts_implementation("eager")
    out_e = model(input_ids=ids, labels=ids, use_cache=False)
    torch.testing.assert_close(out_f.logits, out_e.logits, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("family", ["deepseek_v3", "glm4_moe"])
def test_sigmoid_group_limited_router(family: str) -> None:
    cfg = tiny_config(family, n_routed_experts=8, n_group=4, topk_group=2, num_experts_per_tok=3)
    torch.manual_seed(0)
    model, _ = build_model(cfg, "eager")
    ids = torch.randint(3, cfg.vocab_size, (2, 7))
    ref = model(input_ids=ids, labels=ids, use_cache=False)
    model.set_experts_implementation("fastmoe")
    got = model(input_ids=ids, labels=ids, use_cache=False)
    torch.testing.assert_close(got.logits, ref.logits, atol=1e-5, rtol=1e-5)


def test_ep_sentinels_skip_rows_this_rank_does_not_own() -> None:
    """Ids >= num_experts are other ranks' experts: no contribution, no router gradient."""
    cls = _make_class()
    torch.manual_seed(0)
    module = cls(_config())
    module._is_expert_parallel = True
    T, K = 10, 2
    idx, w = _routing(T, K)
    idx = idx.clone()
    idx[::3, 0] = E + 1  # sentinel slots
    x = torch.randn(T, H)
    # eager reference: the same module with sentinel slots dropped (weight 0, any own expert id)
    out_f = None
    module.config._experts_implementation = "fastmoe"
    wf = w.clone().requires_grad_()
    out_f = module(x, idx, wf)
    out_f.sum().backward()
    keep = idx < E
    module.config._experts_implementation = "eager"
    wr = (w * keep).detach().requires_grad_()
    out_r = module(x, torch.where(keep, idx, torch.zeros_like(idx)), wr)
    out_r.sum().backward()
    torch.testing.assert_close(out_f, out_r, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(wf.grad * keep, wr.grad * keep, atol=1e-5, rtol=1e-5)
    assert not wf.grad[~keep].any()


def test_out_of_range_ids_without_ep_raise() -> None:
    module = _make_class()(_config("fastmoe"))
    idx, w = _routing(4, 2)
    idx[0, 0] = E
    with pytest.raises(ValueError, match="_is_expert_parallel"):
        module(torch.randn(4, H), idx, w)


def test_k1() -> None:
    _case({}, K=1)


def test_all_tokens_on_one_expert() -> None:
    T = 9
    idx = torch.full((T, 1), 2)
    _case({"has_bias": True}, T=T, K=1, idx=idx)


def test_single_token() -> None:
    _case({}, T=1)
    _case({"is_transposed": True}, T=1)


def test_empty_batch() -> None:
    module = _make_class()(_config("fastmoe"))
    out = module(torch.zeros(0, H), torch.zeros(0, 2, dtype=torch.long), torch.zeros(0, 2))
    assert out.shape == (0, H)


def test_unknown_layout_raises_naming_the_attribute() -> None:
    module = _make_class()(_config("fastmoe"))
    del module.is_transposed
    with pytest.raises(ExpertsLayoutError, match="is_transposed"):
        module(torch.randn(3, H), *_routing(3, 2))
    module = _make_class(has_bias=True)(_config("fastmoe"))
    del module.down_proj_bias
    with pytest.raises(ExpertsLayoutError, match="down_proj_bias"):
        module(torch.randn(3, H), *_routing(3, 2))


def test_save_and_load_unchanged(tmp_path) -> None:
    cfg = tiny_config("qwen3_moe")
    torch.manual_seed(0)
    model, _ = build_model(cfg, "fastmoe")
    model.save_pretrained(tmp_path)
    from transformers import AutoModelForCausalLM

    loaded = AutoModelForCausalLM.from_pretrained(tmp_path, experts_implementation="fastmoe")
    assert loaded.config._experts_implementation == "fastmoe"
    ids = torch.randint(3, cfg.vocab_size, (1, 6))
    torch.testing.assert_close(loaded(input_ids=ids).logits, model(input_ids=ids).logits, atol=0, rtol=0)
    eager = AutoModelForCausalLM.from_pretrained(tmp_path, experts_implementation="eager")
    torch.testing.assert_close(eager(input_ids=ids).logits, model(input_ids=ids).logits, atol=1e-5, rtol=1e-5)
    assert set(eager.state_dict()) == set(model.state_dict())


@pytest.mark.slow
def test_saved_choice_loads_without_fastmoe_and_with_it(tmp_path) -> None:
    """A model saved after ``experts_implementation="fastmoe"`` loads in a process that never imports
    fastmoe_xpu (transformers' default implementation, the same logits), and comes back as fastmoe
    where fastmoe_xpu is imported, without naming it again."""
    import json
    import os
    import subprocess
    import sys

    from transformers import AutoModelForCausalLM

    from fastmoe_xpu.integrations.registration import SAVED_CHOICE_KEY

    cfg = tiny_config("qwen3_moe")
    torch.manual_seed(0)
    model, _ = build_model(cfg, "fastmoe")
    model.save_pretrained(tmp_path / "m")
    saved = json.loads((tmp_path / "m" / "config.json").read_text())
    assert saved.get(SAVED_CHOICE_KEY) == "fastmoe" and "experts_implementation" not in saved
    ids = torch.randint(3, cfg.vocab_size, (1, 6))
    torch.save(ids, tmp_path / "ids.pt")
    code = (
        "import sys, torch\n"
        "from transformers import AutoModelForCausalLM\n"
        f"m = AutoModelForCausalLM.from_pretrained({str(tmp_path / 'm')!r})\n"
        f"ids = torch.load({str(tmp_path / 'ids.pt')!r})\n"
        "with torch.no_grad():\n"
        f"    torch.save(m(input_ids=ids).logits, {str(tmp_path / 'logits.pt')!r})\n"
        "assert not any(n.startswith('fastmoe_xpu') for n in sys.modules), 'fastmoe_xpu was imported'\n"
        "print(m.config._experts_implementation)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().splitlines()[-1] != "fastmoe"
    with torch.no_grad():
        want = model(input_ids=ids).logits
    torch.testing.assert_close(torch.load(tmp_path / "logits.pt"), want, atol=1e-5, rtol=1e-5)
    # a fresh process that imports fastmoe_xpu first gets the saved choice back from config.json
    code = ("import fastmoe_xpu\nfrom transformers import AutoModelForCausalLM\n"
            f"print(AutoModelForCausalLM.from_pretrained({str(tmp_path / 'm')!r}).config._experts_implementation)\n")
    proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().splitlines()[-1] == "fastmoe"
    # here fastmoe_xpu is imported: the saved choice comes back, and an explicit one still wins
    again = AutoModelForCausalLM.from_pretrained(tmp_path / "m")
    assert again.config._experts_implementation == "fastmoe"
    with torch.no_grad():
        torch.testing.assert_close(again(input_ids=ids).logits, want, atol=0, rtol=0)
    other = AutoModelForCausalLM.from_pretrained(tmp_path / "m", experts_implementation="eager")
    assert other.config._experts_implementation == "eager"
    other.save_pretrained(tmp_path / "e")
    assert SAVED_CHOICE_KEY not in json.loads((tmp_path / "e" / "config.json").read_text())


def _unrouted_family_configs():
    """Tiny configs of families whose experts transformers does not route through the interface."""
    import transformers

    configs = []
    if hasattr(transformers, "Llama4TextConfig"):
        configs.append(transformers.Llama4TextConfig(
            hidden_size=32, intermediate_size=16, intermediate_size_mlp=16, num_hidden_layers=1, num_attention_heads=2,
            num_key_value_heads=2, vocab_size=64, num_local_experts=4, head_dim=16))
    if hasattr(transformers, "JetMoeConfig"):
        configs.append(transformers.JetMoeConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                                 kv_channels=16, intermediate_size=16, num_local_experts=4,
                                                 vocab_size=64))
    return configs


def test_fastmoe_where_the_family_does_not_run_it(tmp_path, monkeypatch) -> None:
    """A family whose experts never call the interface runs its own experts with one warning naming
    it, answers "eager", and no saved config names fastmoe; set_experts_implementation says the same."""
    import json
    import warnings

    from transformers import AutoModelForCausalLM

    from fastmoe_xpu.integrations import registration as experts_mod

    configs = _unrouted_family_configs()
    if not configs:
        pytest.skip("this transformers has none of the unrouted families")
    for cfg in configs:
        monkeypatch.setattr(experts_mod, "_WARNED", set())
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            model = AutoModelForCausalLM.from_config(cfg, experts_implementation="fastmoe")
        said = [str(w.message) for w in caught if "does not run" in str(w.message)]
        assert len(said) == 1 and cfg.model_type in said[0] and '"eager"' in said[0], said
        assert model.config._experts_implementation == "eager"
        model.save_pretrained(tmp_path / cfg.model_type)
        saved = json.loads((tmp_path / cfg.model_type / "config.json").read_text())
        assert "fastmoe" not in json.dumps(saved)
        monkeypatch.setattr(experts_mod, "_WARNED", set())
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            model.set_experts_implementation("fastmoe")
        assert [w for w in caught if "does not run" in str(w.message)]
        assert model.config._experts_implementation == "eager"


def test_precision_without_fastmoe_is_warned_once(monkeypatch) -> None:
    import warnings

    from transformers import AutoModelForCausalLM

    from fastmoe_xpu.integrations import registration as experts_mod

    monkeypatch.setattr(experts_mod, "_WARNED", set())
    cfg = tiny_config("qwen3_moe")
    cfg.fastmoe_expert_precision = "int8"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        AutoModelForCausalLM.from_config(cfg)
    said = [str(w.message) for w in caught if "has no effect" in str(w.message)]
    assert len(said) == 1 and "fastmoe_expert_precision='int8'" in said[0], said
    cfg = tiny_config("qwen3_moe")
    cfg.fastmoe_expert_precision = "int8"
    monkeypatch.setattr(experts_mod, "_WARNED", set())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = AutoModelForCausalLM.from_config(cfg, experts_implementation="fastmoe")
    assert not [w for w in caught if "has no effect" in str(w.message)]
    assert model.config._experts_implementation == "fastmoe"


def test_triton_plain_path_under_interpreter() -> None:
    """The plain path's grouped GEMMs and our stages on the Triton launchers (biases, transposed)."""
    pytest.importorskip("triton")
    cls = _make_class(has_bias=True, is_transposed=True)
    torch.manual_seed(0)
    module = cls(_config())
    module.fastmoe_backend = "triton"
    x = torch.randn(6, H)
    _compare(module, x, *_routing(6, 2))


# ---------------------------------------------------------------- the patched OLMoE block
def _patched_olmoe():
    from transformers import OlmoeConfig, OlmoeForCausalLM

    cfg = OlmoeConfig(vocab_size=97, hidden_size=32, intermediate_size=24, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=4, num_experts=6, num_experts_per_tok=2, max_position_embeddings=64)
    torch.manual_seed(0)
    ref = OlmoeForCausalLM(cfg).eval()
    fast = copy.deepcopy(ref)
    fastmoe_xpu.patch_olmoe(fast, backend="torch")
    return ref, fast


def test_patched_olmoe_experts_carry_the_decorator_attributes() -> None:
    _, fast = _patched_olmoe()
    experts = fast.model.layers[0].mlp.experts
    flags = describe_layout(experts)
    assert flags["fused"] and not flags["expert_parallel"]
    assert experts.config is fast.config and fast.config._experts_implementation == "fastmoe"


@pytest.mark.parametrize("impl", ["eager", "grouped_mm", "batched_mm", "fastmoe"])
def test_patched_olmoe_honours_set_experts_implementation(impl: str, monkeypatch) -> None:
    ref, fast = _patched_olmoe()
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    calls = []
    if impl != "eager":
        inner = ALL_EXPERTS_FUNCTIONS[impl]
        monkeypatch.setitem(ALL_EXPERTS_FUNCTIONS, impl, lambda *a, **k: calls.append(1) or inner(*a, **k))
    fast.set_experts_implementation(impl)
    assert fast.config._experts_implementation == impl
    ids = torch.randint(0, 97, (2, 7))
    expected = ref(input_ids=ids).logits
    calls.clear()  # the reference model may dispatch through the interface too
    torch.testing.assert_close(fast(input_ids=ids).logits, expected, atol=1e-5, rtol=1e-5)
    # the block dispatches a non-fastmoe name through the interface; "fastmoe" is its own stages
    assert len(calls) == (2 if impl not in ("eager", "fastmoe") else 0)


def test_patched_olmoe_unknown_implementation_raises() -> None:
    _, fast = _patched_olmoe()
    with pytest.raises(ValueError, match="not supported"):
        fast.set_experts_implementation("no_such_impl")


def test_id_guard_never_reads_the_device_off_the_cpu() -> None:
    """On an accelerator the guard is a device-side assert: a meta tensor (whose value cannot be read
    on the host) passes through it, where a host read would raise. The CPU keeps the immediate error."""
    from fastmoe_xpu.integrations.experts import check_ids

    check_ids(torch.zeros(4, 2, dtype=torch.long, device="meta"), E)
    with pytest.raises(ValueError, match="outside"):
        check_ids(torch.full((4, 2), E, dtype=torch.long), E)
    check_ids(torch.full((4, 2), E - 1, dtype=torch.long), E)


def test_id_guard_answer_is_reused_by_the_counting_stage(monkeypatch) -> None:
    """On the CPU the guard's one ``aminmax`` is the counting stage's "every id local" answer for the
    same ids: stages 2 and 3 then run without another; ids changed in place are asked about again."""
    from fastmoe_xpu.integrations.experts import check_ids
    from fastmoe_xpu.kernels import torch as torch_kernels
    from fastmoe_xpu.kernels.torch import counting

    idx = torch.tensor([[0, 1], [E - 1, 2]])
    check_ids(idx, E)
    calls = []
    aminmax = torch.aminmax
    monkeypatch.setattr(torch, "aminmax", lambda t: calls.append(t) or aminmax(t))
    c = torch_kernels.count_tokens(idx, 0, E, 8)
    torch_kernels.build_indices(idx, c.partial_cum_token_counts, c.cum_expert_counts, 0, E, 8)
    assert not calls
    idx[0, 0] = E  # in place: asked again, and refused
    with pytest.raises(ValueError, match="outside"):
        check_ids(idx, E)
    assert len(calls) == 1 and not counting.all_local(idx, 0, E)


def test_routed_rows_read_only_under_expert_parallelism() -> None:
    """Without EP every slot is routed: T * K, no device read (a meta tensor proves it); with EP
    sentinels the count is read back."""
    from fastmoe_xpu.integrations.experts import routed_rows

    assert routed_rows(torch.empty(E + 1, dtype=torch.int32, device="meta"), 7, 3, False) == 21
    assert routed_rows(torch.tensor([0, 2, 5], dtype=torch.int32), 7, 3, True) == 5
    with pytest.raises(Exception):
        routed_rows(torch.empty(E + 1, dtype=torch.int32, device="meta"), 7, 3, True)


def test_registration_is_lazy_and_in_place_before_first_use() -> None:
    """A fresh interpreter: importing fastmoe_xpu does not import transformers' MoE module, yet the
    first from_config asking for "fastmoe" finds it registered, and the block's experts carry
    transformers' default gate function."""
    import subprocess
    import sys
    from pathlib import Path

    code = (
        "import sys\n"
        "import fastmoe_xpu\n"
        "assert 'transformers.integrations.moe' not in sys.modules, 'imported eagerly'\n"
        "from transformers import AutoModelForCausalLM\n"
        # the precision keyword is the config's before the experts interface is imported
        "from transformers import Qwen3MoeConfig\n"
        "c, unused = Qwen3MoeConfig.from_dict({}, fastmoe_expert_precision='int8', return_unused_kwargs=True)\n"
        "assert unused == {} and c.fastmoe_expert_precision == 'int8', unused\n"
        "assert 'transformers.integrations.moe' not in sys.modules\n"
        "from fastmoe_xpu.integrations.families import tiny_config\n"
        "m = AutoModelForCausalLM.from_config(tiny_config('qwen3_moe'), experts_implementation='fastmoe')\n"
        "assert m.config._experts_implementation == 'fastmoe'\n"
        "from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS, _default_apply_gate\n"
        "assert ALL_EXPERTS_FUNCTIONS['fastmoe'] is fastmoe_xpu.fastmoe_experts_forward\n"
        "from fastmoe_xpu.block import Experts\n"
        "assert Experts._apply_gate is _default_apply_gate\n"
        "assert not any(type(f).__name__ == '_RegisterOnImport' for f in sys.meta_path)\n"
        "print('ok')\n"
    )
    root = Path(__file__).resolve().parents[1]
    res = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0 and res.stdout.strip() == "ok", res.stderr[-2000:]


@pytest.mark.parametrize("engine", ["auto", "native"])
def test_ids_outside_the_experts_raise(engine: str, monkeypatch) -> None:
    """Without expert parallelism an id outside [0, num_experts) is refused: on the padded op (a small
    layer with gemm_engine='auto', which reads it off its layout; a call without a backward whose ids
    are not all local leaves torch's grouped GEMM in one piece for it) and on the staged chain
    (checked first). In-range ids run, on the path the test names: with 'auto', a call without a
    backward in one piece on torch's grouped GEMM, one with a backward on the padded op."""
    from fastmoe_xpu import settings
    from fastmoe_xpu.kernels import grouped_mm
    from fastmoe_xpu.kernels.torch import padded

    calls = []
    real, real_small = padded.experts_forward, grouped_mm._small_forward
    monkeypatch.setattr(padded, "experts_forward", lambda *a: calls.append("padded") or real(*a))
    monkeypatch.setattr(grouped_mm, "_small_forward", lambda *a: calls.append("small") or real_small(*a))
    module = _make_class()(_config("fastmoe"))
    module.fastmoe_gemm_engine = engine
    x, (idx, w) = torch.randn(7, H), _routing(7, 2)
    with settings.override(gemm_engine=None), torch.no_grad():
        for bad in (E, E + 5, -1):
            wrong = idx.clone()
            wrong[3, 1] = bad
            with pytest.raises(ValueError, match=r"outside \[0, 4\)"):
                module(x, wrong, w)
        assert "small" not in calls
        calls.clear()
        module(x, idx, w)
    assert calls == (["small"] if engine == "auto" and grouped_mm.unsupported_reason("cpu", torch.float32) is None
                     else ["padded"] if engine == "auto" else [])
    calls.clear()
    with settings.override(gemm_engine=None):
        module(x.requires_grad_(), idx, w).sum().backward()
    assert calls == (["padded"] if engine == "auto" else [])


def test_layout_flags_follow_the_module() -> None:
    """The flags are answered from the first call while what they depend on is unchanged: a swapped
    activation, a flag that now claims biases the module lacks, a weight of another expert count
    are each seen on the next call (and the numbers follow); the answer is read-only."""
    module = _make_class()(_config("fastmoe"))
    flags = describe_layout(module)
    assert flags["fused"] and describe_layout(module) is flags
    with pytest.raises(TypeError):
        flags["fused"] = False  # type: ignore[index]
    module.act_fn = ACT2FN["gelu"]
    assert not describe_layout(module)["fused"]
    x, (idx, w) = torch.randn(9, H), _routing(9, 2)
    _compare(module, x, idx, w)  # GELU's numbers, not a SiLU kept from the first answer
    module.act_fn = ACT2FN["silu"]
    assert describe_layout(module)["fused"]
    module.has_bias = True
    with pytest.raises(ExpertsLayoutError, match="no tensor"):
        describe_layout(module)
    module.has_bias = False
    down = module.down_proj
    module.down_proj = nn.Parameter(torch.randn(E + 1, H, I))
    with pytest.raises(ExpertsLayoutError, match="holds 5 experts"):
        describe_layout(module)
    module.down_proj = down
    assert describe_layout(module)["fused"]


def _no_grad_pair(module: nn.Module, x: torch.Tensor, idx: torch.Tensor, w: torch.Tensor) -> tuple:
    """``(fastmoe's, the eager loop's)`` outputs of one call without autograd."""
    out = {}
    with torch.no_grad():
        for impl in ("fastmoe", "eager"):
            module.config._experts_implementation = impl
            out[impl] = module(x, idx, w)
    return out["fastmoe"], out["eager"]


@pytest.mark.parametrize("T,K", [(2, 1), (3, 3), (5, 2), (13, 4)])
def test_calls_without_a_backward_match_the_loop(T: int, K: int) -> None:
    """Decoding several sequences (a few tokens, no autograd): the output equals the eager loop's at
    token and choice counts that leave experts empty, shared and full."""
    torch.manual_seed(T)
    module = _make_class()(_config("fastmoe"))
    idx, w = _routing(T, K, seed=T)
    got, ref = _no_grad_pair(module, torch.randn(T, H), idx, w)
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)


@pytest.mark.filterwarnings("ignore:fastmoe_xpu. quantized expert weights")
def test_what_a_call_derives_from_the_module_follows_it(monkeypatch) -> None:
    """The fused path derives its weights, backend, engine and precision from the module once and
    keeps them while nothing they come from changes: a replaced weight, a precision set on the
    config, an engine or backend set on the module and a settings override are each seen by the next
    call (the numbers, and the engine asked for, follow)."""
    from fastmoe_xpu import settings
    from fastmoe_xpu.autograd import moe_experts as me
    from fastmoe_xpu.integrations import experts as ix

    torch.manual_seed(0)
    module = _make_class()(_config("fastmoe"))
    x, (idx, w) = torch.randn(6, H), _routing(6, 2)
    got, ref = _no_grad_pair(module, x, idx, w)
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)
    first = ix._call_memo(module)
    assert first is not None and ix._call_memo(module) is first
    module.gate_up_proj = nn.Parameter(torch.randn(E, 2 * I, H) * 0.3)  # a new weight: new numbers
    got, ref = _no_grad_pair(module, x, idx, w)
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)
    assert ix._call_memo(module) is not first and ix._call_memo(module).w_up is module.gate_up_proj
    with torch.no_grad():
        module.down_proj.mul_(2.0)  # in place: the same tensor, read afresh
    got, ref = _no_grad_pair(module, x, idx, w)
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)
    asked = []
    real, resolved = me.moe_experts_forward, me.resolved_forward
    monkeypatch.setattr(ix, "moe_experts_forward", lambda *a, **k: asked.append(
        (k["gemm_engine"], k["backend"], k["expert_precision"])) or real(*a, **k))
    # A memo whose engine and precision were found valid enters past those checks, with the CPU's
    # kernel backend resolved (the sixth argument).
    monkeypatch.setattr(ix, "resolved_forward", lambda *a, **k: asked.append(
        (k["gemm_engine"], a[5], k["expert_precision"])) or resolved(*a, **k))
    module.config._experts_implementation = "fastmoe"
    with torch.no_grad():
        module.fastmoe_expert_precision = "int8"
        int8 = module(x, idx, w)
        assert asked[-1][2] == "int8" and not torch.equal(int8, ref)
        del module.fastmoe_expert_precision
        module.fastmoe_gemm_engine = "loop"
        module(x[:1], idx[:1], w[:1])
        assert asked[-1][0] == "loop"
        module.fastmoe_backend = "torch"
        module(x[:1], idx[:1], w[:1])
        assert asked[-1][:2] == ("loop", "torch")
        with settings.override(expert_precision="int8"):
            module(x[:1], idx[:1], w[:1])
            assert asked[-1][2] == "int8"
        module(x[:1], idx[:1], w[:1])
        assert asked[-1][2] is None


def test_no_warning_from_our_code_under_torch_compile() -> None:
    """A compiled forward and backward of a family on "fastmoe" warns about nothing of ours (dynamo
    warned about every functools.lru_cache-wrapped function it traced in the experts function)."""
    import warnings

    from transformers import AutoModelForCausalLM

    cfg = tiny_config("qwen3_moe")
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, experts_implementation="fastmoe")
    ids = torch.randint(3, cfg.vocab_size, (2, 8))
    torch._dynamo.reset()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.compile(model)(input_ids=ids).logits.sum().backward()
    ours = [f"{w.filename}:{w.lineno}: {w.message}" for w in caught
            if "fastmoe_xpu" in w.filename or "fastmoe" in str(w.message) or "lru_cache" in str(w.message)]
    assert not ours, ours


def test_a_module_whose_attributes_refer_back_to_it_is_collected() -> None:
    """What the experts function keeps per module keeps nothing of the module alive: a module with a
    hook that closes over it (a reference cycle through its attributes) is collected once dropped,
    and its entry goes with it."""
    import gc
    import weakref

    from fastmoe_xpu.integrations import experts as ix

    module = _make_class()(_config("fastmoe"))
    module.register_forward_hook(lambda mod, args, out, owner=module: None)
    module.itself = module.forward  # a bound method in the instance dict
    x, (idx, w) = torch.randn(3, H), _routing(3, 2)
    with torch.no_grad():
        module(x, idx, w)
    assert ix._call_memo(module) is not None
    ref, before = weakref.ref(module), len(ix._MEMOS)
    del module
    gc.collect()
    assert ref() is None and len(ix._MEMOS) == before - 1
