"""Mixture-of-experts routing: which experts each token goes to, and with what weights.

The families route in one of three ways (``RouterSpec.scoring``):

- ``softmax`` (Mixtral, Qwen3-MoE, DeepSeek-V2): probabilities over all experts, the top k kept,
  renormalised to sum to 1 where the family does (``renormalize``);
- ``topk_softmax`` (GPT-OSS): the top k logits (the router has a bias), softmax over those k;
- ``sigmoid`` (DeepSeek-V3): independent sigmoid scores; the choice adds a learned correction
  bias (``correction_bias``), the weights do not; renormalised.

DeepSeek limits each token to the best ``topk_group`` of ``n_group`` expert groups before the
top k, scoring a group by its best expert (V2, ``group_score="max"``) or by the sum of its best
two (V3, ``"top2_sum"``). Every family's weights are then multiplied by ``scaling``
(``routed_scaling_factor``).

Ties go to the lower expert (and the lower group) id: the choice is a stable sort, so a
batch's routing does not depend on how a top-k kernel breaks them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

Scoring = Literal["softmax", "topk_softmax", "sigmoid"]


@dataclass(frozen=True)
class RouterSpec:
    """How a family's router turns logits into each token's experts and weights."""

    num_experts: int
    top_k: int
    scoring: Scoring = "softmax"
    renormalize: bool = False  # the k weights divided by their sum
    n_group: int = 1  # DeepSeek: experts in n_group equal groups ...
    topk_group: int = 1  # ... of which each token may use the best topk_group
    group_score: Literal["max", "top2_sum"] = "max"
    scaling: float = 1.0  # routed_scaling_factor
    bias: bool = False  # GPT-OSS: the router's linear layer has a bias
    correction_bias: bool = False  # DeepSeek-V3: e_score_correction_bias, added for the choice only

    def __post_init__(self) -> None:
        if not 0 < self.top_k <= self.num_experts:
            raise ValueError(f"num_experts_per_tok must be in 1..{self.num_experts} (num_experts), got {self.top_k}")
        if self.n_group < 1 or self.num_experts % self.n_group:
            raise ValueError(f"n_group {self.n_group} must divide num_experts {self.num_experts}")
        if not 0 < self.topk_group <= self.n_group:
            raise ValueError(f"topk_group must be in 1..{self.n_group} (n_group), got {self.topk_group}")
        if self.n_group > 1 and self.top_k > self.topk_group * (self.num_experts // self.n_group):
            raise ValueError(f"num_experts_per_tok {self.top_k} is more than the {self.topk_group} groups a token may use hold")


def _top(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the ``k`` largest scores of each row, ties to the lower index."""
    return torch.sort(scores, dim=-1, descending=True, stable=True).indices[..., :k]


def route(logits: torch.Tensor, spec: RouterSpec, correction_bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Each token's expert weights (fp32 ``[T, k]``) and expert ids (int64 ``[T, k]``) from its router logits ``[T, E]``."""
    logits = logits.float()
    if spec.scoring == "topk_softmax":
        ids = _top(logits, spec.top_k)
        return torch.softmax(logits.gather(1, ids), dim=-1) * spec.scaling, ids
    scores = torch.softmax(logits, dim=-1) if spec.scoring == "softmax" else torch.sigmoid(logits)
    choice = scores if correction_bias is None else scores + correction_bias.float()
    if spec.n_group > 1:
        choice = _within_best_groups(choice, spec)
    ids = _top(choice, spec.top_k)
    weights = scores.gather(1, ids)
    if spec.renormalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + (1e-20 if spec.scoring == "sigmoid" else 0.0))
    return weights * spec.scaling if spec.scaling != 1.0 else weights, ids


def _within_best_groups(choice: torch.Tensor, spec: RouterSpec) -> torch.Tensor:
    """``choice`` with every expert outside each token's best ``topk_group`` groups set below any score."""
    tokens = choice.shape[0]
    grouped = choice.view(tokens, spec.n_group, -1)
    if spec.group_score == "max":
        group_scores = grouped.max(dim=-1).values
    else:
        group_scores = grouped.topk(min(2, grouped.shape[-1]), dim=-1).values.sum(dim=-1)
    keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, _top(group_scores, spec.topk_group), True)
    floor = 0.0 if spec.group_score == "max" else float("-inf")  # as V2 (masked scores are 0) and V3 (-inf) mask them
    return grouped.masked_fill(~keep.unsqueeze(-1), floor).view(tokens, -1)


class Router(nn.Module):
    """The router's linear layer (kept out of weight quantization: a rounded logit changes an expert) and its rule."""

    def __init__(self, hidden_size: int, spec: RouterSpec) -> None:
        super().__init__()
        self.spec = spec
        self.weight = nn.Parameter(torch.empty(spec.num_experts, hidden_size))
        self.bias = nn.Parameter(torch.zeros(spec.num_experts)) if spec.bias else None
        self.correction_bias = nn.Parameter(torch.zeros(spec.num_experts)) if spec.correction_bias else None

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Weights (fp32 ``[T, k]``) and expert ids (``[T, k]``) of the tokens ``x`` ``[T, hidden]``."""
        weight = self.weight
        if x.dtype == weight.dtype == torch.float32:
            logits = F.linear(x, weight, self.bias)
        else:  # logits in fp32 whatever the activations' dtype
            logits = F.linear(x.float(), weight.float(), None if self.bias is None else self.bias.float())
        return route(logits, self.spec, self.correction_bias)
