"""Gemma 4's feed-forward block: a dense MLP and routed experts side by side, each between its own
norms, and their router (transformers 5.24 models/gemma4/modeling_gemma4.py, Gemma4TextDecoderLayer's
second half, Gemma4TextRouter):

    dense  = post_shared_layernorm(mlp(pre_shared_layernorm(h)))
    probs  = router(h)                                # the un-normed residual
    routed = post_experts_layernorm(experts(pre_experts_layernorm(h), probs))
    out    = post_layernorm(dense + routed)           # the layer adds h

The dense MLP is megatron's shared expert, so it is tensor-parallel like any dense MLP while the
experts are expert-parallel; megatron 0.16.1's MoELayer.forward calls shared_experts_compute,
route, preprocess, dispatch, routed_experts_compute, combine and postprocess in turn, and the block
overrides the three that see the norms (route already gets the raw residual: the layer's
pre_mlp_layernorm is an identity).
"""

from __future__ import annotations

import torch
from megatron.core.transformer.moe.moe_layer import MoELayer

from moe_sft.layers.gemma4_math import router_input
from moe_sft.layers.norm import Gemma4RMSNorm
from moe_sft.layers.router import FamilyRouter

NORMS = (
    "pre_shared_layernorm",
    "post_shared_layernorm",
    "pre_experts_layernorm",
    "post_experts_layernorm",
    "post_layernorm",
)


class Gemma4Router(FamilyRouter):
    """Gemma4TextRouter: logits of the scale-free RMS-normed input times a learned `scale` and
    hidden_size ** -0.5; softmax over all experts in fp32, top-k, renormalised (megatron's default
    softmax rule computes the same), then each chosen weight times its expert's `per_expert_scale`."""

    def __init__(self, config, pg_collection=None):
        super().__init__(config=config, pg_collection=pg_collection)
        self.scale = torch.nn.Parameter(torch.ones(config.hidden_size, dtype=config.params_dtype))
        self.per_expert_scale = torch.nn.Parameter(torch.ones(config.num_moe_experts, dtype=config.params_dtype))
        for p in (self.scale, self.per_expert_scale):  # replicated over TP, fed its sequence shard
            p.sequence_parallel = config.sequence_parallel

    def gating(self, input: torch.Tensor) -> torch.Tensor:
        return super().gating(router_input(input, self.scale, self.config.layernorm_epsilon))

    def routing(self, logits: torch.Tensor, padding_mask: torch.Tensor | None = None):
        probs, routing_map = super().routing(logits, padding_mask)
        return probs * self.per_expert_scale, routing_map


class Gemma4MoELayer(MoELayer):
    """megatron's MoELayer with Gemma 4's five norms around its shared expert (the dense MLP) and
    its routed experts (module docstring)."""

    def __init__(self, config, submodules=None, layer_number=None, pg_collection=None):
        # The overlap runs the shared expert inside the dispatcher, where its norms cannot be put;
        # a latent projection would sit between the experts and their post-norm.
        for name in ("moe_shared_expert_overlap", "moe_latent_size"):
            if getattr(config, name):
                raise ValueError(f"{name}={getattr(config, name)!r}: not supported by Gemma 4's MoE block; unset it")
        super().__init__(config, submodules, layer_number=layer_number, pg_collection=pg_collection)
        if not self.use_shared_expert:
            raise ValueError("Gemma 4's MoE block needs its dense MLP: set moe_shared_expert_intermediate_size")
        for name in NORMS:
            setattr(self, name, Gemma4RMSNorm(config, config.hidden_size, config.layernorm_epsilon))

    def shared_experts_compute(self, hidden_states: torch.Tensor) -> torch.Tensor:
        dense = super().shared_experts_compute(self.pre_shared_layernorm(hidden_states))
        return self.post_shared_layernorm(dense)

    def preprocess(self, hidden_states: torch.Tensor, probs: torch.Tensor, routing_map: torch.Tensor):
        return super().preprocess(self.pre_experts_layernorm(hidden_states), probs, routing_map)

    def postprocess(self, output: torch.Tensor, shared_expert_output: torch.Tensor) -> torch.Tensor:
        routed = self.post_experts_layernorm(self.token_dispatcher.combine_postprocess(output))
        return self.post_layernorm(routed + shared_expert_output)
