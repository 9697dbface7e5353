"""Megatron-style MoE layer: dispatcher round trip, capacity dropping, expert bias, naive reference, losses."""

from __future__ import annotations

import math

import pytest

torch = pytest.importorskip("torch")

from hps_service.errors import InvalidArgumentError
from hps_service.trainer.moe import (
    MoEConfig,
    MoELayer,
    TopKRouter,
    expert_capacity,
    permute,
    router_z_loss,
    switch_load_balancing_loss,
    topk_routing,
    unpermute,
)


def _layer(hidden: int = 8, seed: int = 0, **kw) -> MoELayer:
    torch.manual_seed(seed)
    return MoELayer(hidden, MoEConfig(**kw))


@pytest.mark.parametrize("top_k", [1, 2, 3])
def test_dispatcher_round_trip_with_probs_one_over_k_reproduces_input(top_k: int) -> None:
    torch.manual_seed(1)
    tokens = torch.randn(37, 6)
    logits = torch.randn(37, 5)
    idx = torch.topk(logits, top_k, dim=-1).indices
    routing_map = torch.zeros_like(logits, dtype=torch.bool).scatter(1, idx, True)
    probs = routing_map.float() / top_k
    permuted, sorted_indices = permute(tokens, routing_map)
    assert permuted.shape == (37 * top_k, 6)
    counts = routing_map.sum(dim=0)
    expert_of_row = torch.repeat_interleave(torch.arange(5), counts)
    assert bool(routing_map[sorted_indices, expert_of_row].all())  # grouped by expert
    restored = unpermute(permuted, sorted_indices, probs, routing_map, num_tokens=37)
    torch.testing.assert_close(restored, tokens, rtol=0, atol=1e-6)


def _naive_routing(logits: torch.Tensor, cfg: MoEConfig) -> torch.Tensor:
    """Per-token routing written the obvious way: (T, E) weights of the chosen experts."""
    weights = torch.zeros_like(logits)
    for t in range(logits.shape[0]):
        row = logits[t]
        if cfg.score_function == "softmax":
            if cfg.pre_softmax:
                scores = torch.softmax(row, 0)
                top = torch.topk(scores, cfg.top_k).indices
                weights[t, top] = scores[top]
            else:
                top = torch.topk(row, cfg.top_k).indices
                weights[t, top] = torch.softmax(row[top], 0)
        else:
            scores = torch.sigmoid(row)
            top = torch.topk(scores, cfg.top_k).indices
            w = scores[top]
            weights[t, top] = w / w.sum() if cfg.top_k > 1 else w
    return weights


@pytest.mark.parametrize(
    "kw",
    [
        {"score_function": "softmax", "pre_softmax": False, "top_k": 2},
        {"score_function": "softmax", "pre_softmax": True, "top_k": 2},
        {"score_function": "sigmoid", "top_k": 2},
        {"score_function": "sigmoid", "top_k": 1},
        {"score_function": "softmax", "top_k": 2, "shared_expert_hidden": 12},
    ],
)
def test_layer_equals_naive_per_token_reference(kw: dict) -> None:
    layer = _layer(hidden=8, num_experts=4, ffn_hidden=16, **kw)
    x = torch.randn(29, 8)
    with torch.no_grad():
        out = layer(x).output
        logits = x @ layer.router.weight.T
        weights = _naive_routing(logits, layer.config)
        ref = torch.zeros_like(x)
        for t in range(x.shape[0]):
            for e in range(layer.config.num_experts):
                if weights[t, e] != 0:
                    h = torch.nn.functional.gelu(x[t] @ layer.experts.w1[e])
                    ref[t] += weights[t, e] * (h @ layer.experts.w2[e])
            if layer.shared_expert is not None:
                ref[t] += layer.shared_expert.fc2(torch.nn.functional.gelu(layer.shared_expert.fc1(x[t])))
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def test_dropped_tokens_come_back_as_zero_and_lowest_probabilities_are_dropped() -> None:
    layer = _layer(hidden=8, num_experts=4, top_k=1, ffn_hidden=16, capacity_factor=0.5)
    x = torch.randn(64, 8)
    with torch.no_grad():
        result = layer(x)
    routing = result.routing
    capacity = expert_capacity(64, 4, 1, 0.5)
    assert capacity == 8
    assert int(routing.routing_map.sum(dim=0).max()) <= capacity
    dropped = routing.topk_map.any(dim=1) & ~(routing.routing_map & routing.topk_map).any(dim=1)
    assert int(dropped.sum()) >= 64 - 4 * capacity  # at most 32 tokens fit
    assert torch.equal(result.output[dropped], torch.zeros_like(result.output[dropped]))
    assert bool((result.output[~dropped].abs().sum(dim=1) > 0).all())
    assert float(routing.dropped_fraction) == pytest.approx(float(dropped.float().mean()))
    # per expert, every kept token has a probability no lower than any dropped token of that expert
    logits = (x @ layer.router.weight.T).detach()
    full_probs, _, topk_map, _ = topk_routing(logits, MoEConfig(num_experts=4, top_k=1, ffn_hidden=16))
    for e in range(4):
        kept = routing.routing_map[:, e]
        lost = topk_map[:, e] & ~kept
        if lost.any() and kept.any():
            assert float(full_probs[kept, e].min()) >= float(full_probs[lost, e].max())


def test_padding_to_capacity_gives_every_expert_capacity_rows_and_same_output() -> None:
    plain = _layer(hidden=8, num_experts=4, top_k=2, ffn_hidden=16, capacity_factor=0.75)
    padded = _layer(hidden=8, num_experts=4, top_k=2, ffn_hidden=16, capacity_factor=0.75, pad_to_capacity=True)
    x = torch.randn(40, 8)
    with torch.no_grad():
        a, b = plain(x), padded(x)
    capacity = expert_capacity(40, 4, 2, 0.75)
    assert b.routing.routing_map.sum(dim=0).tolist() == [capacity] * 4
    torch.testing.assert_close(a.output, b.output, rtol=1e-5, atol=1e-6)
    assert torch.equal(a.routing.tokens_per_expert, b.routing.tokens_per_expert)


def test_expert_bias_moves_load_toward_balance() -> None:
    torch.manual_seed(3)
    cfg = MoEConfig(num_experts=4, top_k=1, score_function="sigmoid", expert_bias=True, bias_update_rate=1e-3)
    router = TopKRouter(8, cfg)
    with torch.no_grad():
        router.weight[0] += 0.3  # expert 0 scores higher for most tokens
    router.train()
    x = torch.randn(256, 8).abs()

    def imbalance() -> float:
        with torch.no_grad():
            load = router(x).tokens_per_expert.float()
        router.local_tokens_per_expert.zero_()
        return float(load.max() / load.mean())

    before = imbalance()
    for _ in range(300):
        router(x)
        router.update_expert_bias()
    after = imbalance()
    assert before > 2.0
    assert after < before - 0.5
    assert float(router.expert_bias[0]) < 0  # the over-loaded expert was pushed down
    # the bias changes selection only: weights of the chosen experts are the unbiased sigmoid scores
    logits = x @ router.weight.T
    probs, _, topk_map, _ = topk_routing(logits, cfg, router.expert_bias)
    torch.testing.assert_close(probs[topk_map], torch.sigmoid(logits)[topk_map])


def test_aux_and_z_loss_values_on_known_inputs() -> None:
    tokens, experts, k, coeff = 8, 4, 2, 0.01
    uniform = torch.full((tokens, experts), 1.0 / experts)
    balanced = torch.full((experts,), tokens * k / experts)
    assert float(switch_load_balancing_loss(uniform, balanced, k, coeff)) == pytest.approx(coeff)
    collapsed = torch.zeros(tokens, experts)
    collapsed[:, 0] = 1.0
    assert float(switch_load_balancing_loss(collapsed, torch.tensor([8.0, 0, 0, 0]), 1, coeff)) == pytest.approx(
        experts * coeff
    )
    assert float(router_z_loss(torch.zeros(5, experts), 1e-3)) == pytest.approx(1e-3 * math.log(experts) ** 2)
    logits = torch.tensor([[0.0, math.log(3.0)], [math.log(7.0), 0.0]])
    assert float(router_z_loss(logits, 1.0)) == pytest.approx((math.log(4.0) ** 2 + math.log(8.0) ** 2) / 2)
    router = TopKRouter(3, MoEConfig(num_experts=4, top_k=2, aux_loss_coeff=coeff, z_loss_coeff=1e-3))
    with torch.no_grad():
        router.weight.zero_()
        result = router(torch.randn(tokens, 3))
    assert float(result.aux_loss) == pytest.approx(coeff)
    assert float(result.z_loss) == pytest.approx(1e-3 * math.log(4) ** 2)


def test_gradients_reach_router_and_experts() -> None:
    layer = _layer(hidden=8, num_experts=4, top_k=2, ffn_hidden=16, shared_expert_hidden=8)
    out = layer(torch.randn(32, 8))
    (out.output.square().sum() + out.routing.aux_loss + out.routing.z_loss).backward()
    for p in (layer.router.weight, layer.experts.w1, layer.experts.w2, layer.shared_expert.fc1.weight):
        assert p.grad is not None and float(p.grad.abs().sum()) > 0


def test_invalid_configs_are_rejected() -> None:
    with pytest.raises(InvalidArgumentError, match="top_k"):
        MoEConfig(num_experts=4, top_k=5)
    with pytest.raises(InvalidArgumentError, match="pad_to_capacity"):
        MoEConfig(pad_to_capacity=True)
    with pytest.raises(InvalidArgumentError, match="tokens"):
        _layer(hidden=8)(torch.randn(3, 5))
