"""Per-layer MoE routing statistics of each training step: expert load, max/mean load, dead
experts, routing entropy, expert-bias drift.

Each megatron `TopKRouter` gets its `routing(logits, padding_mask)` wrapped (an instance
attribute; the router's math is untouched): after megatron computes `routing_map` [tokens,
experts] (the experts each token is dispatched to, after capacity dropping if any), the wrapper
adds, on device and without a host sync, per expert the number of real tokens routed to it
(`routing_map & ~padding` summed over tokens: same result as a bincount of the top-k indices,
which the router does not return, and unlike CUDA's bincount it never syncs), the summed
entropy of the router's probability distribution over experts, and the real token count.

Counted exactly once per micro-batch, as megatron counts tokens for the expert bias: only when
the router is in training mode with grad enabled. An activation-recomputed layer runs its first
forward under no_grad and its recomputation with grad, so it is counted once; evaluation
(no_grad or eval mode) is not counted. Padding tokens (megatron's `padding_mask`, True = pad)
are excluded, as megatron excludes them from the aux loss and the bias update.

One all-reduce per step (Telemetry) sums the [layers, experts + 2] accumulator over the world:
pipeline stages hold different layers (each layer's row is non-zero on its stage only), and
data/context/sequence-parallel and expert-parallel ranks route different tokens. Tensor-parallel
ranks without sequence parallelism route the same tokens, so only TP rank 0 contributes.
"""

from __future__ import annotations

import math

import torch
from megatron.core.transformer.moe.router import TopKRouter

from moe_sft.trainer.metrics import Histogram


def router_distribution(logits: torch.Tensor, score_function: str) -> torch.Tensor:
    """The router's probability distribution over experts [tokens, E] (fp32).

    softmax routers: softmax(logits). sigmoid routers (DeepSeek-V3): sigmoid scores normalised to
    sum to 1 (without the expert bias, which only steers the top-k selection).
    """
    logits = logits.float()
    if score_function == "sigmoid":
        scores = torch.sigmoid(logits)
        return scores / scores.sum(-1, keepdim=True)
    return torch.softmax(logits, dim=-1)


class MoERoutingStats:
    """Accumulates routing statistics of the routers in `model_chunks` until `take()`."""

    def __init__(self, model_chunks, config, device):
        self.num_experts = int(config.num_moe_experts)
        # megatron's router.layer_number is 1-based over decoder layers then MTP layers
        self.num_slots = config.num_layers + (config.mtp_num_layers or 0)
        self.score_function = config.moe_router_score_function
        self.acc = torch.zeros(self.num_slots, self.num_experts + 2, dtype=torch.float64, device=device)
        self.routers = [m for chunk in model_chunks for m in chunk.modules() if isinstance(m, TopKRouter)]
        for router in self.routers:
            self._wrap(router)
        self.initial_bias = {
            r.layer_number: r.expert_bias.detach().float().clone() for r in self.routers if r.expert_bias is not None
        }

    @property
    def has_expert_bias(self) -> bool:
        return bool(self.initial_bias)

    def _wrap(self, router: TopKRouter) -> None:
        routing = router.routing  # the bound method of megatron's class

        def routing_with_stats(logits, padding_mask=None):
            probs, routing_map = routing(logits, padding_mask=padding_mask)
            if router.training and torch.is_grad_enabled():
                self.record(router.layer_number, logits, routing_map, padding_mask)
            return probs, routing_map

        router.routing = routing_with_stats

    @torch.no_grad()
    def record(
        self, layer_number: int, logits: torch.Tensor, routing_map: torch.Tensor, padding_mask: torch.Tensor | None
    ) -> None:
        """Add one micro-batch of one layer: logits [.., E], routing_map [tokens, E], padding [..]."""
        if not 1 <= layer_number <= self.num_slots:
            raise ValueError(f"router layer_number={layer_number} outside 1..{self.num_slots}")
        experts = self.num_experts
        logits = logits.detach().reshape(-1, experts)
        routing_map = routing_map.reshape(-1, experts)
        entropy = torch.special.entr(router_distribution(logits, self.score_function)).sum(-1)
        tokens = routing_map.shape[0]
        if padding_mask is not None:
            real = ~padding_mask.reshape(-1)
            routing_map = routing_map & real[:, None]
            entropy = entropy * real
            tokens = real.sum()
        slot = self.acc[layer_number - 1]  # in-place adds of device tensors or Python ints: no sync
        slot[:experts].add_(routing_map.sum(0))
        slot[experts : experts + 1].add_(entropy.sum())
        slot[experts + 1 :].add_(tokens)

    def take(self, tokens_weight: float, bias_weight: float) -> torch.Tensor:
        """This rank's share of the step's statistics, flattened for the all-reduce; resets.

        Layout: [slots, E + 2] (counts, entropy sum, tokens) * tokens_weight, then [slots, 2]
        (L2 norm and max |.| of the expert-bias change since the start of the run) * bias_weight.
        """
        drift = torch.zeros(self.num_slots, 2, dtype=torch.float64, device=self.acc.device)
        for router in self.routers:
            if router.expert_bias is not None:
                delta = (router.expert_bias.detach().float() - self.initial_bias[router.layer_number]).double()
                drift[router.layer_number - 1] = torch.stack([delta.norm(), delta.abs().max()])
        out = torch.cat([(self.acc * tokens_weight).flatten(), (drift * bias_weight).flatten()])
        self.acc.zero_()
        return out

    def size(self) -> int:
        return self.num_slots * (self.num_experts + 4)

    def metrics(self, reduced: torch.Tensor) -> dict:
        """Metrics from the all-reduced `take()` layout (a CPU float64 tensor)."""
        split = self.num_slots * (self.num_experts + 2)
        acc = reduced[:split].view(self.num_slots, self.num_experts + 2)
        drift = reduced[split:].view(self.num_slots, 2) if self.has_expert_bias else None
        return routing_metrics(acc[:, :-2], acc[:, -2], acc[:, -1], drift)


def layer_stats(counts: torch.Tensor, entropy_sum: float, tokens: float) -> dict[str, float]:
    """One layer's statistics from its expert load `counts` [E] (see docs/telemetry.md)."""
    experts = counts.numel()
    total = float(counts.sum())
    share = counts / total
    return {
        "max_load_ratio": float(counts.max()) / (total / experts),
        "dead_experts": float((counts == 0).sum()),
        "router_entropy": entropy_sum / tokens / math.log(experts),
        "load_entropy": float(torch.special.entr(share).sum()) / math.log(experts),
    }


def routing_metrics(
    counts: torch.Tensor, entropy_sum: torch.Tensor, tokens: torch.Tensor, drift: torch.Tensor | None = None
) -> dict:
    """Per-layer and summary metrics; rows with no routed tokens (dense layers, MTP when not run)
    are skipped. Per-layer names: moe/layer_{i}/... with i the 0-based layer index as in HF
    (MTP layer k is num_layers + k). Summaries: worst max/mean load, total dead experts, mean
    entropies, largest bias change."""
    out: dict = {}
    layers = []
    for i in range(counts.shape[0]):
        if tokens[i] <= 0:
            continue
        stats = layer_stats(counts[i], float(entropy_sum[i]), float(tokens[i]))
        if drift is not None:
            stats.update(bias_drift_l2=float(drift[i, 0]), bias_drift_max=float(drift[i, 1]))
        layers.append(stats)
        for name, value in stats.items():
            out[f"moe/layer_{i}/{name}"] = value
        out[f"moe/layer_{i}/expert_load"] = Histogram(counts[i].tolist())
    if not layers:
        return out
    out["moe/max_load_ratio"] = max(s["max_load_ratio"] for s in layers)
    out["moe/dead_experts"] = sum(s["dead_experts"] for s in layers)
    out["moe/router_entropy"] = sum(s["router_entropy"] for s in layers) / len(layers)
    out["moe/summary/load_entropy"] = sum(s["load_entropy"] for s in layers) / len(layers)
    if drift is not None:
        out["moe/bias_drift"] = max(s["bias_drift_max"] for s in layers)
    return out
