"""A Mixture-of-Experts layer in the style of Megatron Core's MoE: top-k router, token dispatcher, stacked experts.

Router: softmax (pre- or post-top-k) or sigmoid scores, switch load-balancing aux loss, router z-loss, optional
aux-loss-free balancing with a per-expert bias (DeepSeek-V3: bias += rate * sign(mean load - load) after each step),
capacity factor with token dropping by lowest probability and optional padding to capacity. Dispatcher: permute the
tokens grouped by expert, run all experts as batched matmuls over stacked weights, unpermute with the routing
probabilities as weights. A shared expert sees every token.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from hps_service.errors import InvalidArgumentError


@dataclass(frozen=True)
class MoEConfig:
    """Hyper-parameters of one MoE layer (names follow Megatron's ``--moe-*`` options)."""

    num_experts: int = 4
    top_k: int = 2
    ffn_hidden: int = 32
    score_function: Literal["softmax", "sigmoid"] = "softmax"
    pre_softmax: bool = False
    aux_loss_coeff: float = 1e-2
    z_loss_coeff: float = 1e-3
    expert_bias: bool = False
    bias_update_rate: float = 1e-3
    capacity_factor: float | None = None
    pad_to_capacity: bool = False
    shared_expert_hidden: int = 0

    def __post_init__(self) -> None:
        if self.num_experts < 1:
            raise InvalidArgumentError(f"num_experts must be >= 1, got {self.num_experts}")
        if not 1 <= self.top_k <= self.num_experts:
            raise InvalidArgumentError(f"top_k must be in [1, num_experts={self.num_experts}], got {self.top_k}")
        if self.ffn_hidden < 1:
            raise InvalidArgumentError(f"ffn_hidden must be >= 1, got {self.ffn_hidden}")
        if self.score_function not in ("softmax", "sigmoid"):
            raise InvalidArgumentError(f"score_function must be softmax or sigmoid, got {self.score_function!r}")
        if self.capacity_factor is not None and self.capacity_factor <= 0:
            raise InvalidArgumentError(f"capacity_factor must be > 0 or None, got {self.capacity_factor}")
        if self.pad_to_capacity and self.capacity_factor is None:
            raise InvalidArgumentError("pad_to_capacity needs a capacity_factor")
        if self.aux_loss_coeff < 0 or self.z_loss_coeff < 0 or self.bias_update_rate < 0:
            raise InvalidArgumentError("aux_loss_coeff, z_loss_coeff and bias_update_rate must be >= 0")
        if self.shared_expert_hidden < 0:
            raise InvalidArgumentError(f"shared_expert_hidden must be >= 0, got {self.shared_expert_hidden}")


@dataclass
class RoutingResult:
    """What the router decided for a batch of tokens."""

    probs: torch.Tensor  # (T, E) weight of each kept (token, expert) pair, zero elsewhere
    routing_map: torch.Tensor  # (T, E) bool: the pairs sent to experts (kept top-k, plus padding if padded)
    topk_map: torch.Tensor  # (T, E) bool: the router's top-k choice before capacity dropping
    aux_loss: torch.Tensor
    z_loss: torch.Tensor

    @property
    def tokens_per_expert(self) -> torch.Tensor:
        """Pairs each expert really serves (kept top-k choices, padding excluded)."""
        return (self.routing_map & self.topk_map).sum(dim=0)

    @property
    def dropped_fraction(self) -> torch.Tensor:
        """Share of top-k choices dropped by the capacity limit."""
        chosen = self.topk_map.sum()
        return 1.0 - (self.routing_map & self.topk_map).sum() / chosen.clamp(min=1)


def switch_load_balancing_loss(
    scores: torch.Tensor, tokens_per_expert: torch.Tensor, top_k: int, coeff: float
) -> torch.Tensor:
    """Switch-Transformer aux loss as Megatron computes it: E * coeff * sum_e(P_e * f_e) / (T^2 * k).

    ``scores``: (T, E) normalised router scores over all experts; ``tokens_per_expert``: (E,) top-k counts.
    Equals ``coeff`` when routing is uniform and balanced.
    """
    num_tokens, num_experts = scores.shape
    per_expert = scores.sum(dim=0)
    return torch.sum(per_expert * tokens_per_expert) * (num_experts * coeff / (num_tokens * num_tokens * top_k))


def router_z_loss(logits: torch.Tensor, coeff: float) -> torch.Tensor:
    """ST-MoE z-loss: coeff * mean over tokens of logsumexp(logits)^2; keeps router logits small."""
    return torch.mean(torch.square(torch.logsumexp(logits, dim=-1))) * coeff


def expert_capacity(num_tokens: int, num_experts: int, top_k: int, capacity_factor: float) -> int:
    """Tokens one expert may take: ceil(T * k / E * capacity_factor), at most T."""
    return min(num_tokens, max(1, math.ceil(num_tokens * top_k / num_experts * capacity_factor)))


def topk_routing(
    logits: torch.Tensor, config: MoEConfig, expert_bias: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Top-k selection with capacity; returns (probs, routing_map, topk_map, scores for the aux loss).

    The expert bias only changes which experts are selected; the weights come from the unbiased scores.
    """
    num_tokens, num_experts = logits.shape
    k = config.top_k
    logits = logits.float()
    bias = expert_bias
    if config.score_function == "softmax":
        aux_scores = torch.softmax(logits, dim=-1)
        if config.pre_softmax:
            selection = aux_scores if bias is None else aux_scores + bias
            top_idx = torch.topk(selection, k, dim=-1).indices
            top_probs = torch.gather(aux_scores, 1, top_idx)
        else:
            selection = logits if bias is None else logits + bias
            top_idx = torch.topk(selection, k, dim=-1).indices
            top_probs = torch.softmax(torch.gather(logits, 1, top_idx), dim=-1)
    else:
        scores = torch.sigmoid(logits)
        aux_scores = scores / (scores.sum(dim=-1, keepdim=True) + 1e-20)
        selection = scores if bias is None else scores + bias
        top_idx = torch.topk(selection, k, dim=-1).indices
        top_probs = torch.gather(scores, 1, top_idx)
        if k > 1:
            top_probs = top_probs / (top_probs.sum(dim=-1, keepdim=True) + 1e-20)
    probs = torch.zeros_like(logits).scatter(1, top_idx, top_probs)
    topk_map = torch.zeros_like(logits, dtype=torch.bool).scatter(1, top_idx, True)
    routing_map = topk_map
    if config.capacity_factor is not None:
        capacity = expert_capacity(num_tokens, num_experts, k, config.capacity_factor)
        keep_idx = torch.topk(probs, capacity, dim=0, sorted=False).indices  # per expert: highest-probability tokens
        capacity_mask = torch.zeros_like(topk_map).scatter(0, keep_idx, True)
        routing_map = capacity_mask if config.pad_to_capacity else topk_map & capacity_mask
        probs = probs * (topk_map & capacity_mask)
    return probs, routing_map, topk_map, aux_scores


class TopKRouter(nn.Module):
    """Linear gate over the hidden state, top-k selection, aux and z losses, and the aux-loss-free expert bias."""

    def __init__(self, hidden: int, config: MoEConfig) -> None:
        super().__init__()
        self.config = config
        self.weight = nn.Parameter(torch.empty(config.num_experts, hidden))
        nn.init.normal_(self.weight, std=1.0 / math.sqrt(hidden))
        self.register_buffer("expert_bias", torch.zeros(config.num_experts) if config.expert_bias else None)
        self.register_buffer("local_tokens_per_expert", torch.zeros(config.num_experts))

    def forward(self, hidden: torch.Tensor) -> RoutingResult:
        logits = F.linear(hidden, self.weight)
        probs, routing_map, topk_map, aux_scores = topk_routing(logits, self.config, self.expert_bias)
        if self.training and torch.is_grad_enabled():
            with torch.no_grad():
                self.local_tokens_per_expert += topk_map.sum(dim=0).to(self.local_tokens_per_expert.dtype)
        aux = switch_load_balancing_loss(aux_scores, topk_map.sum(dim=0), self.config.top_k,
                                         self.config.aux_loss_coeff)
        z = router_z_loss(logits, self.config.z_loss_coeff)
        return RoutingResult(probs=probs, routing_map=routing_map, topk_map=topk_map, aux_loss=aux, z_loss=z)

    @torch.no_grad()
    def update_expert_bias(self) -> None:
        """DeepSeek-V3 rule after an optimizer step: raise the bias of under-loaded experts, lower the over-loaded."""
        if self.expert_bias is not None:
            load = self.local_tokens_per_expert
            offset = load.mean() - load
            self.expert_bias += torch.sign(offset) * self.config.bias_update_rate
        self.local_tokens_per_expert.zero_()


def permute(tokens: torch.Tensor, routing_map: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Copy each token once per expert it goes to, grouped by expert; returns (permuted, source token index)."""
    num_tokens = tokens.shape[0]
    token_idx = torch.arange(num_tokens, device=tokens.device).unsqueeze(0).expand(routing_map.shape[1], -1)
    sorted_indices = token_idx.masked_select(routing_map.T.contiguous())
    return tokens.index_select(0, sorted_indices), sorted_indices


def unpermute(
    permuted: torch.Tensor, sorted_indices: torch.Tensor, probs: torch.Tensor, routing_map: torch.Tensor,
    num_tokens: int,
) -> torch.Tensor:
    """Weight each expert output by its routing probability and sum it back into its token's row."""
    weights = probs.T.contiguous().masked_select(routing_map.T.contiguous()).to(permuted.dtype)
    weighted = permuted * weights.unsqueeze(-1)
    out = permuted.new_zeros(num_tokens, permuted.shape[-1])
    return out.index_add(0, sorted_indices, weighted)


class StackedExperts(nn.Module):
    """All routed experts' two-layer MLPs held as stacked weights and run as two batched matmuls."""

    def __init__(self, num_experts: int, hidden: int, ffn_hidden: int) -> None:
        super().__init__()
        self.w1 = nn.Parameter(torch.empty(num_experts, hidden, ffn_hidden))
        self.w2 = nn.Parameter(torch.empty(num_experts, ffn_hidden, hidden))
        nn.init.normal_(self.w1, std=1.0 / math.sqrt(hidden))
        nn.init.normal_(self.w2, std=1.0 / math.sqrt(ffn_hidden))

    def forward(self, permuted: torch.Tensor, tokens_per_expert: torch.Tensor) -> torch.Tensor:
        """``permuted``: rows grouped by expert, ``tokens_per_expert[e]`` rows for expert e."""
        num_experts = self.w1.shape[0]
        if permuted.shape[0] == 0:
            return permuted.new_zeros(0, self.w2.shape[-1])
        counts = tokens_per_expert.to(torch.long)
        expert_of_row = torch.repeat_interleave(torch.arange(num_experts, device=permuted.device), counts)
        starts = torch.cumsum(counts, 0) - counts
        slot = torch.arange(permuted.shape[0], device=permuted.device) - starts[expert_of_row]
        capacity = int(counts.max())
        padded = permuted.new_zeros(num_experts, capacity, permuted.shape[-1])
        padded = padded.index_put((expert_of_row, slot), permuted)
        hidden = F.gelu(torch.bmm(padded, self.w1))
        return torch.bmm(hidden, self.w2)[expert_of_row, slot]


class SharedExpert(nn.Module):
    """A dense MLP every token passes through, added to the routed output."""

    def __init__(self, hidden: int, ffn_hidden: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(hidden, ffn_hidden, bias=False)
        self.fc2 = nn.Linear(ffn_hidden, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


@dataclass
class MoEOutput:
    """The layer's output and the router's health for this batch."""

    output: torch.Tensor
    routing: RoutingResult


class MoELayer(nn.Module):
    """Router -> permute -> stacked experts -> weighted unpermute (+ shared expert); one token per row."""

    def __init__(self, hidden: int, config: MoEConfig) -> None:
        super().__init__()
        if hidden < 1:
            raise InvalidArgumentError(f"MoE hidden size must be >= 1, got {hidden}")
        self.config = config
        self.hidden = hidden
        self.router = TopKRouter(hidden, config)
        self.experts = StackedExperts(config.num_experts, hidden, config.ffn_hidden)
        self.shared_expert = SharedExpert(hidden, config.shared_expert_hidden) if config.shared_expert_hidden else None

    def forward(self, x: torch.Tensor) -> MoEOutput:
        if x.dim() != 2 or x.shape[1] != self.hidden:
            raise InvalidArgumentError(f"MoE input must be (tokens, {self.hidden}), got {tuple(x.shape)}")
        routing = self.router(x)
        permuted, sorted_indices = permute(x, routing.routing_map)
        expert_out = self.experts(permuted, routing.routing_map.sum(dim=0))
        out = unpermute(expert_out, sorted_indices, routing.probs, routing.routing_map, x.shape[0])
        if self.shared_expert is not None:
            out = out + self.shared_expert(x)
        return MoEOutput(output=out, routing=routing)

    def flops_per_token(self) -> int:
        """Forward multiply-adds x2 of the router GEMM, the k routed expert MLPs and the shared expert."""
        h, c = self.hidden, self.config
        flops = 2 * h * c.num_experts + c.top_k * 2 * (2 * h * c.ffn_hidden)
        if self.shared_expert is not None:
            flops += 2 * (2 * h * c.shared_expert_hidden)
        return flops
