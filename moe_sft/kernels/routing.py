"""Which rule a routing call follows: megatron's, or transformers' where the running router says so.

Two choices of transformers' routers have no megatron switch (layers/config.py's
SFTTransformerConfig fields):
- group-limited routing ranks a group by the sum of its best `moe_router_group_score_topk` scores
  (DeepSeek-V3: 2, whatever the top-k); megatron uses topk // group_topk. They agree only when
  that ratio is 2 (the released V3: 8 // 4).
- the chosen weights are renormalised exactly when `moe_router_normalize_topk` (HF
  `norm_topk_prob`); megatron's sigmoid router does it exactly when topk > 1, and its config
  refuses a renormalised softmax top-1 (weight 1: the main loss gives the router no gradient, its
  aux loss still does, as in transformers).

The router running now (layers/router.py's FamilyRouter) states its choice with `following`; the
routing function megatron calls (router_topk.py) reads it with `routing_rule` and runs megatron's
own code whenever the rule is megatron's, else the Triton kernel or `torch_topk_routing`. The rule
lives here, below the layers, because the kernel and the router both read it.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass

import torch

# (group_score_topk, normalize) of the router whose routing() is running; None elsewhere.
_ACTIVE: ContextVar[tuple[int | None, bool | None] | None] = ContextVar("moe_sft_routing", default=None)


@contextmanager
def following(group_score_topk: int | None, normalize: bool | None) -> Iterator[None]:
    """Routing calls inside the block follow this choice (None: megatron's for that field)."""
    token = _ACTIVE.set((group_score_topk, normalize))
    try:
        yield
    finally:
        _ACTIVE.reset(token)


@dataclass(frozen=True)
class RoutingRule:
    group_score_topk: int | None  # None without group-limited routing
    normalize: bool
    is_megatrons: bool  # megatron's own function computes exactly this


def routing_rule(topk: int, pre_softmax: bool, num_groups, group_topk, score_function: str) -> RoutingRule:
    """The rule of the router running now, resolved against megatron's defaults."""
    group_score_topk, normalize = _ACTIVE.get() or (None, None)
    megatron_normalize = topk > 1 if score_function == "sigmoid" else not pre_softmax
    normalize = megatron_normalize if normalize is None else bool(normalize)
    if not group_topk:
        return RoutingRule(None, normalize, normalize == megatron_normalize)
    megatron_per_group = topk // group_topk
    per_group = group_score_topk or megatron_per_group
    # Which groups win does not matter when every group is kept.
    same_groups = per_group == megatron_per_group or group_topk >= num_groups
    return RoutingRule(per_group, normalize, same_groups and normalize == megatron_normalize)


def _limit_to_groups(choice: torch.Tensor, num_groups: int, group_topk: int, per_group: int) -> torch.Tensor:
    tokens, experts = choice.shape
    grouped = choice.view(tokens, num_groups, experts // num_groups)
    group_scores = grouped.topk(per_group, dim=-1)[0].sum(dim=-1)
    kept = torch.zeros_like(group_scores, dtype=torch.bool).scatter(
        1, torch.topk(group_scores, k=group_topk, dim=-1, sorted=False)[1], True
    )
    return grouped.masked_fill(~kept[:, :, None], float("-inf")).view(tokens, experts)


def torch_topk_routing(
    logits: torch.Tensor,
    topk: int,
    rule: RoutingRule,
    num_groups,
    group_topk,
    scaling_factor,
    score_function: str,
    expert_bias,
) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' routing (Qwen3-MoE, Mixtral, DeepSeek-V3 routers) with megatron's outputs:
    scores of every expert, the choice (expert bias and groups for the choice only), the chosen
    scores, renormalised when the rule says so, times the scaling factor; dense probs [T, E] and
    the routing map."""
    if score_function == "sigmoid":
        scores = torch.sigmoid(logits.float()).type_as(logits)
        choice = scores if expert_bias is None else scores + expert_bias
    else:
        scores = torch.softmax(logits, dim=-1, dtype=torch.float32).type_as(logits)
        choice = scores
    if group_topk:
        choice = _limit_to_groups(choice, num_groups, group_topk, rule.group_score_topk)
    chosen = torch.topk(choice, k=topk, dim=-1)[1]
    probs = scores.gather(1, chosen)
    if rule.normalize:
        probs = probs / (probs.sum(dim=-1, keepdim=True) + 1e-20)
    if scaling_factor:
        probs = probs * scaling_factor
    routing_probs = torch.zeros_like(logits).scatter(1, chosen, probs)
    routing_map = torch.zeros_like(logits, dtype=torch.bool).scatter(1, chosen, True)
    return routing_probs, routing_map
