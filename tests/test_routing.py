"""Router losses against transformers, and the router itself against OlmoeTopKRouter."""
import pytest
import torch

from fastmoe_xpu import load_balancing_loss, router_z_loss
from fastmoe_xpu.routing import TopKRouter, forced_uniform_routing, uniform_routing_indices
from tests.tolerances import assert_close

transformers = pytest.importorskip("transformers", reason="transformers is needed to compare router losses")
from transformers import OlmoeConfig  # noqa: E402
from transformers.models.olmoe.modeling_olmoe import OlmoeTopKRouter, load_balancing_loss_func  # noqa: E402


@pytest.mark.parametrize("E,K,layers", [(8, 2, 3), (5, 5, 1), (7, 1, 2)])  # K<E, K=E, K=1 with prime E
def test_load_balancing_matches_transformers(E, K, layers):
    torch.manual_seed(E)
    logits = tuple(torch.randn(12, E) for _ in range(layers))
    want = load_balancing_loss_func(logits, E, K)
    assert_close(load_balancing_loss(logits, E, K), want)


def test_load_balancing_with_attention_mask():
    torch.manual_seed(0)
    logits = tuple(torch.randn(2 * 5, 6) for _ in range(2))
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]])
    assert_close(load_balancing_loss(logits, 6, 2, mask), load_balancing_loss_func(logits, 6, 2, mask))


def test_load_balancing_is_minimal_for_uniform_routing():
    # Equal probabilities and equal counts give the minimum value 1 (K=1).
    logits = torch.zeros(8, 4)
    logits[torch.arange(8), torch.arange(8) % 4] = 1e-3
    assert abs(load_balancing_loss(logits, 4, 1).item() - 1.0) < 1e-2
    skewed = torch.zeros(8, 4)
    skewed[:, 0] = 5.0
    assert load_balancing_loss(skewed, 4, 1).item() > 3.0


def test_z_loss_value_and_gradient():
    logits = torch.tensor([[0.0, 0.0], [1.0, -1.0]], requires_grad=True)
    want = (torch.logsumexp(logits, -1) ** 2).mean()
    z = router_z_loss([logits])
    assert_close(z, want)
    z.backward()
    assert logits.grad.abs().sum() > 0


def test_losses_reject_bad_input():
    with pytest.raises(ValueError):
        load_balancing_loss([], 4, 2)
    with pytest.raises(ValueError):
        load_balancing_loss(torch.randn(3, 4), 4, 5)
    with pytest.raises(ValueError):
        load_balancing_loss(torch.randn(3, 5), 4, 2)


@pytest.mark.parametrize("norm", [False, True])
def test_router_identical_to_transformers(norm):
    cfg = OlmoeConfig(hidden_size=10, num_experts=6, num_experts_per_tok=3, norm_topk_prob=norm)
    mine, theirs = TopKRouter(cfg), OlmoeTopKRouter(cfg)
    torch.nn.init.normal_(theirs.weight)
    mine.load_state_dict(theirs.state_dict())
    x = torch.randn(7, 10)
    for a, b in zip(mine(x), theirs(x)):
        assert torch.equal(a, b)


def test_uniform_routing_pattern():
    idx = uniform_routing_indices(5, 4, 2, "cpu")
    assert idx.tolist() == [[0, 1], [2, 3], [0, 1], [2, 3], [0, 1]]
    w, i = forced_uniform_routing(torch.randn(5, 4), 2, True)
    assert torch.equal(i, idx)
    assert_close(w.sum(-1), torch.ones(5))
