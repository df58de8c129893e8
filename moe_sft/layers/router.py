"""megatron's TopKRouter, routing exactly as the HF model does where megatron's rule differs.

`FamilyRouter.routing` makes its config's choices (SFTTransformerConfig's
`moe_router_group_score_topk`, `moe_router_normalize_topk`) visible to the routing function
megatron calls (installed by kernels/router_topk.use_fused_routing) for the duration of the call;
the rule and what it means are in kernels/routing.py. megatron's own code runs whenever the rule
is megatron's.
"""

from __future__ import annotations

import torch
from megatron.core.transformer.moe.router import TopKRouter

from moe_sft.kernels.routing import following


class FamilyRouter(TopKRouter):
    def routing(self, logits: torch.Tensor, padding_mask: torch.Tensor | None = None):
        with following(
            getattr(self.config, "moe_router_group_score_topk", None),
            getattr(self.config, "moe_router_normalize_topk", None),
        ):
            return super().routing(logits, padding_mask)
