"""What one FastSparseMoeBlock forward keeps for backward, on both kernel backends: the input, the
gate/up pre-activation [R, 2I], the router's own saved tensors and O(T*K) routing metadata. Never
h [R, I] or the expert outputs y [R, H] (h is recomputed from gate/up in the down GEMM's backward,
which also forms the router-weight gradient). Eager and under torch.compile alike."""
from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before the first 'import triton' of this process

from types import SimpleNamespace

import pytest
import torch

from fastmoe_xpu import FastSparseMoeBlock

B, S, H, I, E, K = 2, 9, 24, 10, 6, 2
T = B * S


def _saved(block: FastSparseMoeBlock, x: torch.Tensor) -> list[torch.Tensor]:
    """Every distinct storage saved during one forward, as the saved tensors (parameters left out)."""
    params = {p.untyped_storage().data_ptr() for p in block.parameters()}
    seen: dict[int, torch.Tensor] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        ptr = t.untyped_storage().data_ptr()
        if ptr not in params and ptr not in seen:
            seen[ptr] = t
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = block(x)
    out.sum().backward()  # the saved set is a working one
    return list(seen.values())


def _block(backend: str) -> FastSparseMoeBlock:
    torch.manual_seed(0)
    cfg = SimpleNamespace(hidden_size=H, intermediate_size=I, num_experts=E, num_experts_per_tok=K,
                          norm_topk_prob=True, hidden_act="silu")
    return FastSparseMoeBlock(cfg, backend=backend)


def _wide(saved: list[torch.Tensor]) -> list[tuple[int, ...]]:
    """Shapes of the saved floating tensors wider than the router's (E < I < H here)."""
    return sorted(tuple(t.shape) for t in saved if t.dtype.is_floating_point and t.shape[-1] > E)


# Compiled: the graph runs the fastmoe custom ops (fastmoe_xpu/ops.py) and AOTAutograd decides what
# the compiled forward hands its backward; the hooks see that set (CompiledFunction saves it).
# Inductor's partitioner may recompute cheap ops, so it is checked as well (torch backend: its
# compile is the slow part).
@pytest.mark.parametrize("backend, compiler", [
    ("torch", None), ("triton", None), ("torch", "aot_eager"), ("triton", "aot_eager"), ("torch", "inductor"),
])
def test_saved_set_is_input_preactivation_router_and_metadata(backend, compiler):
    if backend == "triton":
        pytest.importorskip("triton")
    block = _block(backend)
    x = torch.randn(B, S, H, requires_grad=True)
    module = block
    if compiler is not None:
        torch._dynamo.reset()
        module = torch.compile(block, fullgraph=True, backend=compiler)
    saved = _saved(module, x)
    if compiler is not None:
        # The same wide tensors as the eager layer keeps.
        assert _wide(saved) == _wide(_saved(block, x)), (compiler, _wide(saved))
    # Row buffers: RT rows on the torch backend, the worst case T*K on the Triton one.
    R = T * K
    floats = sorted((tuple(t.shape), t.dtype) for t in saved if t.dtype.is_floating_point)
    ints = [t for t in saved if not t.dtype.is_floating_point]
    big = [s for s, _ in floats if s[-1] > E]  # E < I < H here: the router's tensors are never this wide
    # The input (the router's saved copy of x is the same storage) and the pre-activation, nothing else wide.
    assert sorted(big) == sorted([(T, H), (R, 2 * I)]), floats
    assert not any(s[-1] == I and len(s) == 2 for s, _ in floats), f"h [R, I] saved: {floats}"
    assert not any(s == (R, H) for s, _ in floats), f"expert outputs [R, H] saved: {floats}"
    # The router's own tensors ([T, E] probabilities, [T, K] weights, [T, 1] norms): O(T*E).
    small = [s for s, _ in floats if s not in big]
    assert all(len(s) == 2 and s[0] == T and s[1] <= E for s in small), small
    assert any(s == (T, K) for s in small), "the router weights are saved for their gradient"
    # Routing metadata: O(T*K) integers.
    assert all(t.numel() <= T * K + 1 for t in ints), [tuple(t.shape) for t in ints]
    metadata_elems = sum(t.numel() for t in ints)
    assert metadata_elems <= 8 * (T * K + T + E + 1)


def test_saved_set_of_the_padded_path():
    """Small eager layers run the registry's ``padded`` experts op (with ``gemm_engine="auto"``,
    which the tests' conftest otherwise pins to ``native``): it keeps the same set."""
    from fastmoe_xpu import settings
    from fastmoe_xpu.kernels import registry

    with settings.override(gemm_engine="auto"):
        assert registry.whole_layer("torch", "auto", "cpu", torch.float32, (T, K, H, I, E)) == "padded"
        with torch.profiler.profile() as prof:
            _saved(_block("torch"), torch.randn(B, S, H, requires_grad=True))
        assert "fastmoe::experts" in {e.key for e in prof.key_averages()}
        test_saved_set_is_input_preactivation_router_and_metadata("torch", None)
