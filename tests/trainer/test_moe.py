"""The MoE layer against Megatron Core's formulas (router.py / moe_utils.py), written out from their definitions."""

from __future__ import annotations

import math

import pytest

torch = pytest.importorskip("torch")

from hps_service.errors import InvalidArgumentError
from hps_service.trainer.moe import (
    MoEConfig,
    MoELayer,
    TopKRouter,
    apply_token_dropping,
    expert_capacity,
    permute,
    router_z_loss,
    scores_for_aux_loss,
    sequence_load_balancing_loss,
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


def _megatron_token_weights(row: torch.Tensor, cfg: MoEConfig, bias: torch.Tensor | None) -> torch.Tensor:
    """Megatron's topk_routing_with_score_function for ONE token, from its definition (E,) weights."""
    E, k = row.numel(), cfg.top_k
    if cfg.score_function == "softmax":
        select = torch.softmax(row, 0) if cfg.pre_softmax else row.clone()
    else:
        select = torch.sigmoid(row) + (bias if bias is not None else 0.0)
    allowed = torch.ones(E, dtype=torch.bool)
    if cfg.group_topk:  # groups ranked by the sum of their best k / group_topk selection scores
        size = E // cfg.num_groups
        sums = [sorted(select[g * size:(g + 1) * size].tolist(), reverse=True)[: k // cfg.group_topk]
                for g in range(cfg.num_groups)]
        best = sorted(range(cfg.num_groups), key=lambda g: -sum(sums[g]))[: cfg.group_topk]
        allowed[:] = False
        for g in best:
            allowed[g * size:(g + 1) * size] = True
    top = sorted((e for e in range(E) if allowed[e]), key=lambda e: -float(select[e]))[:k]
    out = torch.zeros(E)
    if cfg.score_function == "softmax":
        w = torch.softmax(row, 0)[top] if cfg.pre_softmax else torch.softmax(row[top], 0)
    else:
        w = torch.sigmoid(row)[top]
        w = w / w.sum() if k > 1 else w
    out[top] = w * (cfg.topk_scaling_factor or 1.0)
    return out


ROUTERS = [
    {"score_function": "softmax", "pre_softmax": False, "top_k": 2, "expert_bias": False},
    {"score_function": "softmax", "pre_softmax": True, "top_k": 2, "expert_bias": False},
    {"score_function": "softmax", "pre_softmax": True, "top_k": 1, "expert_bias": False},
    {"score_function": "sigmoid", "top_k": 2},
    {"score_function": "sigmoid", "top_k": 1},
    {"score_function": "sigmoid", "top_k": 2, "num_groups": 2, "group_topk": 1},
    {"score_function": "sigmoid", "top_k": 4, "num_groups": 4, "group_topk": 2, "topk_scaling_factor": 2.5},
    {"score_function": "softmax", "top_k": 2, "num_groups": 2, "group_topk": 1, "expert_bias": False},
]


@pytest.mark.parametrize("kw", ROUTERS)
def test_routing_equals_megatron_per_token_definition(kw: dict) -> None:
    cfg = MoEConfig(num_experts=8, **kw)
    torch.manual_seed(2)
    logits = torch.randn(41, 8)
    bias = torch.randn(8) * 0.2 if cfg.expert_bias else None
    probs, routing_map = topk_routing(logits, cfg, bias)
    ref = torch.stack([_megatron_token_weights(logits[t], cfg, bias) for t in range(41)])
    torch.testing.assert_close(probs, ref, rtol=1e-6, atol=1e-6)
    assert torch.equal(routing_map, ref != 0)
    assert routing_map.sum(dim=1).tolist() == [cfg.top_k] * 41


@pytest.mark.parametrize("kw", [ROUTERS[0], ROUTERS[3], {**ROUTERS[5], "shared_expert_hidden": 12}])
def test_layer_equals_naive_per_token_reference(kw: dict) -> None:
    layer = _layer(hidden=8, num_experts=8, ffn_hidden=16, **kw)
    if layer.router.expert_bias is not None:
        layer.router.expert_bias.copy_(torch.randn(8) * 0.1)
    x = torch.randn(29, 8)
    with torch.no_grad():
        out = layer(x).output
        logits = x @ layer.router.weight.T
        ref = torch.zeros_like(x)
        for t in range(x.shape[0]):
            weights = _megatron_token_weights(logits[t], layer.config, layer.router.expert_bias)
            for e in torch.nonzero(weights).flatten().tolist():
                h = torch.nn.functional.gelu(x[t] @ layer.experts.w1[e])
                ref[t] += weights[e] * (h @ layer.experts.w2[e])
            if layer.shared_expert is not None:
                ref[t] += layer.shared_expert.fc2(torch.nn.functional.gelu(layer.shared_expert.fc1(x[t])))
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("policy", ["probs", "position"])
def test_token_dropping_keeps_capacity_by_probability_or_position(policy: str) -> None:
    torch.manual_seed(4)
    cfg = MoEConfig(num_experts=4, top_k=2, capacity_factor=0.5, drop_policy=policy)
    logits = torch.randn(64, 4)
    probs, topk_map = topk_routing(logits, cfg, None)
    kept_probs, kept = apply_token_dropping(probs, topk_map, cfg)
    capacity = expert_capacity(64, 4, 2, 0.5)
    assert capacity == math.ceil(64 * 2 / 4 * 0.5) == 16
    for e in range(4):
        routed = torch.nonzero(topk_map[:, e]).flatten()
        if policy == "probs":  # Megatron: topk of the probs over tokens, per expert
            expected = routed[torch.argsort(probs[routed, e], descending=True)[:capacity]]
        else:  # the earliest tokens routed to the expert
            expected = routed[:capacity]
        assert sorted(torch.nonzero(kept[:, e]).flatten().tolist()) == sorted(expected.tolist())
    assert torch.equal(kept_probs, probs * kept)
    padded_cfg = MoEConfig(num_experts=4, top_k=2, capacity_factor=0.5, drop_policy=policy, pad_to_capacity=True)
    _, padded = apply_token_dropping(probs, topk_map, padded_cfg)
    assert padded.sum(dim=0).tolist() == [capacity] * 4 and bool((padded | ~kept).all())


def test_dropped_tokens_come_back_as_zero_and_padding_changes_nothing() -> None:
    layer = _layer(hidden=8, num_experts=4, top_k=1, ffn_hidden=16, capacity_factor=0.5)
    padded = _layer(hidden=8, num_experts=4, top_k=1, ffn_hidden=16, capacity_factor=0.5, pad_to_capacity=True)
    x = torch.randn(64, 8)
    with torch.no_grad():
        result, result_padded = layer(x), padded(x)
    routing = result.routing
    dropped = ~(routing.routing_map & routing.topk_map).any(dim=1)
    assert int(dropped.sum()) >= 64 - 4 * 8
    assert torch.equal(result.output[dropped], torch.zeros_like(result.output[dropped]))
    assert float(routing.dropped_fraction) == pytest.approx(float(dropped.float().mean()))
    assert routing.routed_pairs == 64 - int(dropped.sum())
    torch.testing.assert_close(result.output, result_padded.output, rtol=1e-5, atol=1e-6)
    assert torch.equal(result.routing.tokens_per_expert, result_padded.routing.tokens_per_expert)


def _megatron_aux_loss(scores: torch.Tensor, routing_map: torch.Tensor, k: int, coeff: float) -> torch.Tensor:
    """loss = E * sum_i f_i * P_i * coeff, f_i = tokens_i / (T k), P_i = mean score of expert i."""
    T, E = scores.shape
    f = routing_map.sum(dim=0).float() / (T * k)
    P = scores.sum(dim=0) / T
    return E * torch.sum(f * P) * coeff


def _megatron_seq_aux_loss(scores: torch.Tensor, routing_map: torch.Tensor, S: int, k: int, coeff: float):
    """Megatron's _apply_seq_aux_loss on [seq, batch]-ordered tokens: reshape (S, B*E), switch loss / B."""
    E = scores.shape[1]
    B = scores.shape[0] // S
    s2 = scores.reshape(S, B * E)
    m2 = routing_map.reshape(S, B * E)
    tokens_per_expert = m2.sum(dim=0).float()
    return torch.sum(s2.sum(dim=0) * tokens_per_expert) * (E * coeff / (k * S * S)) / B


def test_aux_and_sequence_losses_equal_megatrons_formulas_and_count_the_unbiased_topk() -> None:
    torch.manual_seed(5)
    S, B, E, k, coeff = 8, 6, 4, 2, 1e-2
    cfg = MoEConfig(num_experts=E, top_k=k, aux_loss_coeff=coeff, seq_aux_loss_coeff=coeff, seq_length=S)
    logits_sb = torch.randn(S, B, E)  # Megatron's token layout
    aux_map_sb, scores_sb = scores_for_aux_loss(logits_sb.reshape(S * B, E), cfg)
    sig = torch.sigmoid(logits_sb.reshape(S * B, E))
    torch.testing.assert_close(scores_sb, sig / sig.sum(dim=1, keepdim=True))
    # ours: a sequence is seq_length consecutive samples, i.e. tokens in [batch, seq] order
    logits = logits_sb.transpose(0, 1).reshape(B * S, E)
    aux_map, scores = scores_for_aux_loss(logits, cfg)
    ours_seq = sequence_load_balancing_loss(scores, aux_map, S, k, coeff)
    ref_seq = _megatron_seq_aux_loss(scores_sb, aux_map_sb, S, k, coeff)
    torch.testing.assert_close(ours_seq, ref_seq)
    ours_aux = switch_load_balancing_loss(scores, aux_map.sum(dim=0), k, coeff)
    torch.testing.assert_close(ours_aux, _megatron_aux_loss(scores, aux_map, k, coeff))
    # the router adds both; a bias that forces expert 0 into every top-k changes selection, not the aux counts
    router = TopKRouter(3, cfg)
    x = torch.randn(B * S, 3)
    plain = router(x)
    router.expert_bias.copy_(torch.tensor([5.0, 0.0, 0.0, 0.0]))
    biased = router(x)
    assert bool(biased.topk_map[:, 0].all()) and not bool(plain.topk_map[:, 0].all())
    assert torch.equal(biased.aux_map, plain.aux_map)
    torch.testing.assert_close(biased.aux_loss, plain.aux_loss)
    logits_x = (x @ router.weight.T).detach()
    am, sc = scores_for_aux_loss(logits_x, cfg)
    expected = _megatron_aux_loss(sc, am, k, coeff) + sequence_load_balancing_loss(sc, am, S, k, coeff)
    torch.testing.assert_close(biased.aux_loss.detach(), expected)


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
    router = TopKRouter(3, MoEConfig(num_experts=4, top_k=2, score_function="softmax", expert_bias=False,
                                     aux_loss_coeff=coeff, seq_aux_loss_coeff=0.0, z_loss_coeff=1e-3))
    with torch.no_grad():
        router.weight.zero_()
        result = router(torch.randn(tokens, 3))
    assert float(result.aux_loss) == pytest.approx(coeff)
    assert float(result.z_loss) == pytest.approx(1e-3 * math.log(4) ** 2)


def test_expert_bias_follows_deepseek_rule_and_moves_load_toward_balance() -> None:
    torch.manual_seed(3)
    cfg = MoEConfig(num_experts=4, top_k=1, bias_update_rate=1e-3)
    router = TopKRouter(8, cfg)
    with torch.no_grad():
        router.weight[0] += 0.3  # expert 0 scores higher for most tokens
    x = torch.randn(256, 8).abs()
    out = router(x)
    load = out.routing_map.sum(dim=0).float()
    before_bias = router.expert_bias.clone()
    summed = []
    router.update_expert_bias(all_reduce=lambda t: (summed.append(t.clone()), t.mul_(2)))  # a 2-rank sum
    torch.testing.assert_close(summed[0], load)
    expected = before_bias + torch.sign(2 * load.mean() - 2 * load) * 1e-3
    torch.testing.assert_close(router.expert_bias, expected)
    assert float(router.local_tokens_per_expert.sum()) == 0

    def imbalance() -> float:
        with torch.no_grad():
            counts = router(x).tokens_per_expert.float()
        return float(counts.max() / counts.mean())

    before = imbalance()
    for _ in range(300):
        router(x)
        router.update_expert_bias()
    assert before > 2.0 and imbalance() < before - 0.5
    assert float(router.expert_bias[0]) < 0  # the over-loaded expert was pushed down
    logits = x @ router.weight.T
    probs, topk_map = topk_routing(logits, cfg, router.expert_bias)
    torch.testing.assert_close(probs[topk_map], torch.sigmoid(logits)[topk_map])  # weights stay unbiased


def test_gradients_reach_router_and_experts() -> None:
    layer = _layer(hidden=8, num_experts=4, top_k=2, ffn_hidden=16, shared_expert_hidden=8, z_loss_coeff=1e-3)
    out = layer(torch.randn(32, 8))
    (out.output.square().sum() + out.routing.aux_loss + out.routing.z_loss).backward()
    for p in (layer.router.weight, layer.experts.w1, layer.experts.w2, layer.shared_expert.fc1.weight):
        assert p.grad is not None and float(p.grad.abs().sum()) > 0


def test_the_default_is_deepseek_v3s_recipe() -> None:
    cfg = MoEConfig()
    assert (cfg.score_function, cfg.expert_bias, cfg.bias_update_rate) == ("sigmoid", True, 1e-3)
    assert cfg.aux_loss_coeff == 0 and 0 < cfg.seq_aux_loss_coeff <= 1e-3


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        ({"top_k": 1, "score_function": "softmax", "expert_bias": False}, "top-k 1 with post-softmax"),
        ({"score_function": "softmax", "expert_bias": True}, "expert bias"),
        ({"num_experts": 4, "top_k": 5}, "top_k"),
        ({"pad_to_capacity": True}, "pad_to_capacity"),
        ({"num_experts": 6, "num_groups": 4, "group_topk": 1}, "divisible"),
        ({"num_experts": 8, "num_groups": 2, "group_topk": 3}, "group_topk"),
        ({"num_experts": 8, "num_groups": 2}, "both"),
        ({"drop_policy": "random", "capacity_factor": 1.0}, "drop_policy"),
    ],
)
def test_refused_combinations(kw: dict, match: str) -> None:
    with pytest.raises(InvalidArgumentError, match=match):
        MoEConfig(**kw)


def test_wrong_input_shape_is_refused() -> None:
    with pytest.raises(InvalidArgumentError, match="tokens"):
        _layer(hidden=8)(torch.randn(3, 5))
