"""Both kernel backends, and the torch backend with each CPU engine's stage 4, satisfy the launcher
contract: every launcher, same parameter names and defaults."""
import inspect

import pytest

from fastmoe_xpu.kernels import contract, kernels


def _params(fn, drop_self: bool) -> list[tuple[str, object]]:
    params = list(inspect.signature(fn).parameters.values())
    if drop_self:
        params = params[1:]
    return [(p.name, p.default) for p in params]


def test_protocol_lists_every_launcher():
    members = {n for n, v in vars(contract.KernelBackend).items() if inspect.isfunction(v) and not n.startswith("_")}
    assert members == set(contract.LAUNCHERS)


@pytest.mark.parametrize("backend", ["torch", "triton", "torch+grouped_mm", "torch+onednn"])
def test_backend_satisfies_the_contract(backend):
    if backend == "triton":
        pytest.importorskip("triton")
    ops = kernels(backend)
    assert ops.NAME == backend
    for name in contract.LAUNCHERS:
        fn = getattr(ops, name, None)
        assert callable(fn), f"{backend} backend lacks {name}"
        want = _params(getattr(contract.KernelBackend, name), drop_self=True)
        assert _params(fn, drop_self=False) == want, f"{backend}.{name} differs from the contract"


def test_kernels_rejects_an_unknown_backend():
    with pytest.raises(ValueError, match="unknown kernel backend"):
        kernels("cuda")
