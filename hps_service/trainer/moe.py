"""A Mixture-of-Experts layer that follows Megatron Core's MoE rules: top-k router, token dispatcher, stacked experts.

Router (``megatron/core/transformer/moe/router.py`` and ``moe_utils.py``): softmax (pre- or post-top-k) or sigmoid
scores, group-limited top-k, a top-k scaling factor, the switch load-balancing aux loss and the sequence-level aux
loss (DeepSeek-V2/V3), the router z-loss, aux-loss-free balancing with a per-expert bias (DeepSeek-V3:
``bias += rate * sign(mean load - load)`` after each step, sigmoid scores only), and a capacity factor that drops
tokens by lowest probability or by position, optionally padding every expert to capacity, in training only:
evaluation and serving (eval mode) route dropless, as Megatron Core's inference path does. The aux losses count
tokens from the unbiased top-k of the scores, as Megatron does. Dispatcher: permute the tokens grouped by expert,
run all experts as batched matmuls over stacked weights, unpermute with the routing probabilities as weights. A
shared expert sees every token. The router runs in fp32 whatever the autocast.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from hps_service.errors import InvalidArgumentError


@dataclass(frozen=True)
class MoEConfig:
    """Hyper-parameters of one MoE layer; names follow Megatron's ``--moe-*`` options, defaults are DeepSeek-V3's.

    ``seq_length``: the MoE's tokens are samples, and the sequence aux loss treats each run of ``seq_length``
    consecutive samples of a batch as one sequence.
    """

    num_experts: int = 4
    top_k: int = 2
    ffn_hidden: int = 32
    score_function: Literal["softmax", "sigmoid"] = "sigmoid"
    pre_softmax: bool = False
    num_groups: int | None = None
    group_topk: int | None = None
    topk_scaling_factor: float | None = None
    aux_loss_coeff: float = 0.0
    seq_aux_loss_coeff: float = 1e-4
    seq_length: int = 32
    z_loss_coeff: float = 0.0
    expert_bias: bool = True
    bias_update_rate: float = 1e-3
    capacity_factor: float | None = None
    drop_policy: Literal["probs", "position"] = "probs"
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
        # Megatron Core: "Please use --moe-router-pre-softmax when topk is 1."
        if self.top_k == 1 and self.score_function == "softmax" and not self.pre_softmax:
            raise InvalidArgumentError(
                "top-k 1 with post-softmax scores gives every chosen expert weight 1.0 and the router no gradient; "
                "use pre-softmax or sigmoid scores (Megatron Core refuses this too)"
            )
        # Megatron Core: expert bias only with sigmoid (or sqrtsoftplus) scores.
        if self.expert_bias and self.score_function == "softmax":
            raise InvalidArgumentError(
                "the expert bias (aux-loss-free balancing) needs sigmoid scores, not softmax "
                "(DeepSeek-V3's recipe; Megatron Core refuses this too)"
            )
        if self.group_topk is not None or self.num_groups is not None:
            if not self.group_topk or not self.num_groups:
                raise InvalidArgumentError("group-limited routing needs both num_groups and group_topk (>= 1)")
            if self.num_experts % self.num_groups:
                raise InvalidArgumentError(
                    f"num_experts ({self.num_experts}) must be divisible by num_groups ({self.num_groups})"
                )
            if self.group_topk > self.num_groups:
                raise InvalidArgumentError(
                    f"group_topk ({self.group_topk}) must be <= num_groups ({self.num_groups})"
                )
            per_group = self.num_experts // self.num_groups
            if self.top_k // self.group_topk < 1 or self.group_topk * per_group < self.top_k:
                raise InvalidArgumentError(
                    f"top_k ({self.top_k}) must be >= group_topk ({self.group_topk}) and fit in the selected "
                    f"groups ({self.group_topk} x {per_group} experts)"
                )
        if self.topk_scaling_factor is not None and self.topk_scaling_factor <= 0:
            raise InvalidArgumentError(f"topk_scaling_factor must be > 0, got {self.topk_scaling_factor}")
        if self.capacity_factor is not None and self.capacity_factor <= 0:
            raise InvalidArgumentError(f"capacity_factor must be > 0 or None, got {self.capacity_factor}")
        if self.drop_policy not in ("probs", "position"):
            raise InvalidArgumentError(f"drop_policy must be probs or position, got {self.drop_policy!r}")
        if self.pad_to_capacity and self.capacity_factor is None:
            raise InvalidArgumentError("pad_to_capacity needs a capacity_factor")
        if min(self.aux_loss_coeff, self.seq_aux_loss_coeff, self.z_loss_coeff, self.bias_update_rate) < 0:
            raise InvalidArgumentError("aux, sequence aux and z loss coefficients and the bias rate must be >= 0")
        if self.seq_length < 1:
            raise InvalidArgumentError(f"seq_length must be >= 1, got {self.seq_length}")
        if self.shared_expert_hidden < 0:
            raise InvalidArgumentError(f"shared_expert_hidden must be >= 0, got {self.shared_expert_hidden}")


@dataclass
class RoutingResult:
    """What the router decided for a batch of tokens."""

    probs: torch.Tensor  # (T, E) weight of each kept (token, expert) pair, zero elsewhere
    routing_map: torch.Tensor  # (T, E) bool: the pairs sent to experts (kept top-k, plus padding if padded)
    topk_map: torch.Tensor  # (T, E) bool: the router's (biased) top-k choice before capacity dropping
    aux_map: torch.Tensor  # (T, E) bool: the unbiased top-k the aux losses count
    aux_loss: torch.Tensor  # switch aux loss + sequence aux loss (zero when both coefficients are)
    z_loss: torch.Tensor

    @property
    def tokens_per_expert(self) -> torch.Tensor:
        """Pairs each expert really serves (kept top-k choices, padding excluded)."""
        return (self.routing_map & self.topk_map).sum(dim=0)

    @property
    def routed_pairs(self) -> int:
        """(token, expert) pairs computed for real: the model FLOPs of the routed experts scale with this."""
        return int((self.routing_map & self.topk_map).sum())

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


def sequence_load_balancing_loss(
    scores: torch.Tensor, aux_map: torch.Tensor, seq_length: int, top_k: int, coeff: float
) -> torch.Tensor:
    """DeepSeek's sequence-wise aux loss: the switch loss of each run of ``seq_length`` tokens, averaged over runs.

    Equal to Megatron's ``seq_aux_loss`` when the tokens are whole sequences; a last shorter run counts with its
    own length.
    """
    num_tokens, num_experts = scores.shape
    seq = torch.arange(num_tokens, device=scores.device) // seq_length
    num_seqs = int(seq[-1]) + 1 if num_tokens else 0
    if num_seqs == 0:
        return scores.new_zeros(())
    prob_sums = scores.new_zeros(num_seqs, num_experts).index_add(0, seq, scores)
    counts = scores.new_zeros(num_seqs, num_experts).index_add(0, seq, aux_map.to(scores.dtype))
    lengths = torch.bincount(seq, minlength=num_seqs).to(scores.dtype)
    per_seq = (prob_sums * counts).sum(dim=1) * (num_experts * coeff / top_k) / lengths.square()
    return per_seq.mean()


def router_z_loss(logits: torch.Tensor, coeff: float) -> torch.Tensor:
    """ST-MoE z-loss: coeff * mean over tokens of logsumexp(logits)^2; keeps router logits small."""
    return torch.mean(torch.square(torch.logsumexp(logits, dim=-1))) * coeff


def expert_capacity(num_tokens: int, num_experts: int, top_k: int, capacity_factor: float) -> int:
    """Tokens one expert may take: ceil(T * k / E * capacity_factor) (Megatron's ``get_capacity``)."""
    return max(1, math.ceil(num_tokens * top_k / num_experts * capacity_factor))


def _group_limited_topk(scores: torch.Tensor, config: MoEConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k within the ``group_topk`` groups whose best ``top_k // group_topk`` scores sum highest."""
    num_tokens, num_experts = scores.shape
    groups, chosen = config.num_groups or 1, config.group_topk or 1
    group_scores = scores.view(num_tokens, groups, -1).topk(config.top_k // chosen, dim=-1).values.sum(dim=-1)
    group_idx = torch.topk(group_scores, k=chosen, dim=-1, sorted=False).indices
    group_mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter(1, group_idx, True)
    expert_mask = group_mask.unsqueeze(-1).expand(num_tokens, groups, num_experts // groups).reshape(num_tokens, -1)
    return torch.topk(scores.masked_fill(~expert_mask, float("-inf")), k=config.top_k, dim=-1)


def _topk(scores: torch.Tensor, config: MoEConfig) -> tuple[torch.Tensor, torch.Tensor]:
    if config.group_topk:
        return _group_limited_topk(scores, config)
    return torch.topk(scores, k=config.top_k, dim=-1)


def topk_routing(
    logits: torch.Tensor, config: MoEConfig, expert_bias: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Megatron's ``topk_routing_with_score_function``: (probs (T, E), routing_map (T, E) bool) of the top-k.

    The expert bias only changes which experts are selected; the weights come from the unbiased scores.
    """
    logits = logits.float()
    if config.score_function == "softmax":
        if config.pre_softmax:
            probs, top_idx = _topk(torch.softmax(logits, dim=-1), config)
        else:
            top_logits, top_idx = _topk(logits, config)
            probs = torch.softmax(top_logits, dim=-1)
    else:
        scores = torch.sigmoid(logits)
        if expert_bias is not None:
            _, top_idx = _topk(scores + expert_bias.float(), config)
            top_scores = torch.gather(scores, 1, top_idx)
        else:
            top_scores, top_idx = _topk(scores, config)
        probs = top_scores / (top_scores.sum(dim=-1, keepdim=True) + 1e-20) if config.top_k > 1 else top_scores
    if config.topk_scaling_factor:
        probs = probs * config.topk_scaling_factor
    routing_probs = torch.zeros_like(logits).scatter(1, top_idx, probs)
    routing_map = torch.zeros_like(logits, dtype=torch.bool).scatter(1, top_idx, True)
    return routing_probs, routing_map


def scores_for_aux_loss(logits: torch.Tensor, config: MoEConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """Megatron's ``compute_routing_scores_for_aux_loss``: (routing map of the plain unbiased top-k, scores).

    Scores are the softmax, or the sigmoid normalised over all experts; no bias, no groups.
    """
    logits = logits.float()
    if config.score_function == "softmax":
        scores = torch.softmax(logits, dim=-1)
    else:
        scores = torch.sigmoid(logits)
        scores = scores / (scores.sum(dim=-1, keepdim=True) + 1e-20)
    top_idx = torch.topk(scores, k=config.top_k, dim=1).indices
    return torch.zeros_like(logits, dtype=torch.bool).scatter(1, top_idx, True), scores


def apply_token_dropping(
    probs: torch.Tensor, routing_map: torch.Tensor, config: MoEConfig
) -> tuple[torch.Tensor, torch.Tensor]:
    """Megatron's ``apply_router_token_dropping``: keep at most the capacity per expert; (probs, routing map).

    ``probs`` keeps each expert's highest-probability tokens, ``position`` its earliest tokens. With padding the
    map is the capacity mask itself (every expert gets exactly ``capacity`` rows).
    """
    if config.capacity_factor is None:
        return probs, routing_map
    num_tokens, num_experts = probs.shape
    capacity = expert_capacity(num_tokens, num_experts, config.top_k, config.capacity_factor)
    if capacity >= num_tokens:
        capacity_mask = torch.ones_like(routing_map)
    elif config.drop_policy == "probs":
        keep_idx = torch.topk(probs, capacity, dim=0, sorted=False).indices
        capacity_mask = torch.zeros_like(routing_map).scatter(0, keep_idx, True)
    else:
        # earliest tokens first: the routed ones in token order, then (for padding) the earliest others
        order = routing_map.long() * (2 * num_tokens) - torch.arange(num_tokens, device=probs.device).unsqueeze(1)
        keep_idx = torch.topk(order, capacity, dim=0, sorted=False).indices
        capacity_mask = torch.zeros_like(routing_map).scatter(0, keep_idx, True)
    final_map = capacity_mask if config.pad_to_capacity else routing_map & capacity_mask
    return probs * final_map, final_map


class TopKRouter(nn.Module):
    """Linear gate over the hidden state, top-k selection, aux and z losses, and the aux-loss-free expert bias."""

    expert_bias: torch.Tensor | None  # buffers, registered in __init__
    local_tokens_per_expert: torch.Tensor

    def __init__(self, hidden: int, config: MoEConfig) -> None:
        super().__init__()
        self.config = config
        self.weight = nn.Parameter(torch.empty(config.num_experts, hidden))
        nn.init.normal_(self.weight, std=1.0 / math.sqrt(hidden))
        self.register_buffer("expert_bias", torch.zeros(config.num_experts) if config.expert_bias else None)
        self.register_buffer("local_tokens_per_expert", torch.zeros(config.num_experts), persistent=False)

    def forward(self, hidden: torch.Tensor) -> RoutingResult:
        cfg = self.config
        with torch.autocast(hidden.device.type, enabled=False):
            logits = F.linear(hidden.float(), self.weight.float())
            probs, topk_map = topk_routing(logits, cfg, self.expert_bias)
            # dropless outside training: a sample's score never depends on what else is in its batch
            probs, routing_map = apply_token_dropping(probs, topk_map, cfg) if self.training else (probs, topk_map)
            aux_map, aux_scores = scores_for_aux_loss(logits, cfg)
            aux = logits.new_zeros(())
            if cfg.aux_loss_coeff > 0:
                aux = aux + switch_load_balancing_loss(aux_scores, aux_map.sum(dim=0), cfg.top_k, cfg.aux_loss_coeff)
            if cfg.seq_aux_loss_coeff > 0:
                aux = aux + sequence_load_balancing_loss(
                    aux_scores, aux_map, cfg.seq_length, cfg.top_k, cfg.seq_aux_loss_coeff
                )
            z = router_z_loss(logits, cfg.z_loss_coeff) if cfg.z_loss_coeff > 0 else logits.new_zeros(())
        if self.expert_bias is not None and self.training and torch.is_grad_enabled():
            with torch.no_grad():  # Megatron counts the final routing map (after dropping) for the bias update
                self.local_tokens_per_expert += routing_map.sum(dim=0).to(self.local_tokens_per_expert.dtype)
        return RoutingResult(probs=probs, routing_map=routing_map, topk_map=topk_map, aux_map=aux_map,
                             aux_loss=aux, z_loss=z)

    @torch.no_grad()
    def update_expert_bias(self, all_reduce: Callable[[torch.Tensor], None] | None = None) -> None:
        """DeepSeek-V3 rule after an optimizer step: raise the bias of under-loaded experts, lower the over-loaded.

        ``all_reduce`` sums the counts over data-parallel ranks first, so every rank applies the same update.
        """
        if self.expert_bias is not None:
            load = self.local_tokens_per_expert
            if all_reduce is not None:
                all_reduce(load)
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
        w1, w2 = self.w1.to(permuted.dtype), self.w2.to(permuted.dtype)
        padded = permuted.new_zeros(num_experts, capacity, permuted.shape[-1])
        padded = padded.index_put((expert_of_row, slot), permuted)
        hidden = F.gelu(torch.bmm(padded, w1))
        return torch.bmm(hidden, w2)[expert_of_row, slot]


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

    def router_flops_per_token(self) -> int:
        """Router GEMM plus the shared expert: work every token costs whatever the routing."""
        h, c = self.hidden, self.config
        flops = 2 * h * c.num_experts
        if self.shared_expert is not None:
            flops += 2 * (2 * h * c.shared_expert_hidden)
        return flops

    def expert_flops_per_pair(self) -> int:
        """One routed (token, expert) pair: the expert's two GEMMs."""
        return 2 * (2 * self.hidden * self.config.ffn_hidden)
