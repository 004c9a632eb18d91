"""Mixture-of-Experts routing replay in the trainer's forward (model.Routing), on a tiny qwen3_moe with 16
experts and top-4 routing: the experts used are exactly the replayed ones in every layer, replaying the
router's own choice changes nothing, the router's gradient still flows, gradient checkpointing's recompute
replays the same experts, and dense models are refused.

    python -m pytest tests/test_routing.py -q      # seconds
"""
import pytest
import torch

import model as model_lib
import tiny

pytestmark = pytest.mark.usefixtures("one_thread")


def moe():
    return tiny.make_moe_model(tiny.make_tokenizer(), experts=16, top_k=4)


IDS = torch.tensor([[3, 4, 5, 6, 7, 8, 9, 10, 3, 4, 5]])


def random_routes(layers, tokens, experts=16, k=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.stack([torch.randperm(experts, generator=g)[:k] for _ in range(tokens)]) for _ in range(layers)]


def test_replay_uses_the_given_experts_with_the_routers_weights():
    lm = moe()
    routing = model_lib.Routing(lm)
    routing.recorded = []
    own_logits = lm(IDS).logits
    own = list(routing.recorded)
    assert len(own) == 2 and own[0].shape == (IDS.numel(), 4)
    routing.replay, routing.recorded = own, []  # the router's own choice, replayed: nothing changes
    assert torch.equal(lm(IDS).logits, own_logits)
    routes = random_routes(2, IDS.numel())
    routes[1][:3] = -1  # the first 3 tokens of layer 1 keep the router's own choice
    routing.replay, routing.recorded = routes, []
    replayed_logits = lm(IDS).logits
    used = routing.recorded
    assert torch.equal(used[0], routes[0]) and torch.equal(used[1][3:], routes[1][3:])
    assert not torch.equal(replayed_logits, own_logits)
    assert model_lib.routing_mismatch(own[0], used[0]) > 0.5 and model_lib.routing_mismatch(own[0], own[0]) == 0
    # the router still learns: its weight gets a gradient through the replayed experts' gate weights
    replayed_logits.sum().backward()
    assert all(g.weight.grad is not None and g.weight.grad.abs().sum() > 0 for g in routing.gates)


def test_routing_mismatch_by_hand():
    own = torch.tensor([[1, 2], [3, 4], [5, 6]])
    other = torch.tensor([[2, 1], [3, 5], [5, 6]])  # the same set in another order counts as agreeing
    assert model_lib.routing_mismatch(own, other) == pytest.approx(1 / 3)


def test_checkpointing_recomputes_with_the_replayed_experts():
    """The backward's recompute of each layer runs the router again; it must replay the same experts, or the
    gradients would belong to another forward."""
    routes = random_routes(2, IDS.numel(), seed=1)
    grads = []
    for checkpointing in (False, True):
        lm = moe()
        if checkpointing:
            lm.gradient_checkpointing_enable()
        lm.train()
        routing = model_lib.Routing(lm)
        routing.replay = routes
        lm(IDS).logits.square().mean().backward()
        grads.append(torch.cat([p.grad.flatten() for p in lm.parameters() if p.grad is not None]))
    assert torch.allclose(grads[0], grads[1], atol=1e-7, rtol=1e-5)


def test_dense_models_are_refused():
    with pytest.raises(ValueError, match="no Mixture-of-Experts layers"):
        model_lib.Routing(tiny.make_model(tiny.make_tokenizer()))
