"""LoRA on the routed experts: one A/B pair per expert (or one factor shared by a layer's experts),
computed with the same grouped GEMMs as the experts themselves.

Layout of megatron's grouped weights: w1 (experts x hidden x ffn[/etp], gated: [gate | up] per
expert-TP rank) and w2 (experts x ffn[/etp] x hidden). The adapter mirrors it, and under expert
tensor parallelism (the dispatcher hands every expert-TP rank the same tokens and sums their fc2
outputs):

- fc1: A1 (hidden x r) whole, B1 (r x ffn/etp; gate and up kept apart so each splits like its
  half of w1). A1's gradient is partial over expert TP: summed there in the backward.
- fc2: A2 (ffn/etp x r) split like w2, B2 (r x hidden) whole. Each rank adds B2 applied to its
  partial A2 product; the dispatcher's sum over expert TP completes it. B2's gradient is partial
  over expert TP: summed there.

A shared factor (`peft.share_expert_factor`: one A or one B per layer) is a dense parameter:
every rank of a stage adds its experts' part of its gradient, summed over TP here and over
data-parallel ranks by megatron's DDP (it needs expert TP 1; validation says so).
"""

from __future__ import annotations

import torch
from megatron.core import parallel_state

from moe_sft.kernels import wgrad
from moe_sft.layers.experts import grouped_matmul
from moe_sft.peft.parallel import mark_expert, mark_replicated_over, mark_sharded, sum_grad_over
from moe_sft.runtime.device import host_to_device


class ExpertAdapter(torch.nn.Module):
    def __init__(self, experts, *, rank: int, alpha: float, dropout: float, share: str):
        super().__init__()
        cfg = experts.config
        n, hidden = experts.num_local_experts, cfg.hidden_size
        ffn = experts.weight2.numel() // n // hidden  # this expert-TP rank's share
        kw = dict(device=experts.weight1.device, dtype=experts.weight1.dtype)
        self.gated = bool(cfg.gated_linear_unit)
        self.share, self.scale, self.rank = share, alpha / rank, rank
        self.dropout = torch.nn.Dropout(dropout) if dropout > 0 else torch.nn.Identity()
        self.etp_group = parallel_state.get_expert_tensor_parallel_group()
        self.tp_group = parallel_state.get_tensor_model_parallel_group()
        a_n = 1 if share == "a" else n
        b_n = 1 if share == "b" else n
        self.lora_A1 = torch.nn.Parameter(torch.empty(a_n, hidden, rank, **kw))
        self.lora_A2 = torch.nn.Parameter(torch.empty(a_n, ffn, rank, **kw))
        halves = ("gate", "up") if self.gated else ("",)
        self.b1_names = [f"lora_B1_{h}" if h else "lora_B1" for h in halves]
        for name in self.b1_names:
            self.register_parameter(name, torch.nn.Parameter(torch.zeros(b_n, rank, ffn, **kw)))
        self.lora_B2 = torch.nn.Parameter(torch.zeros(b_n, rank, hidden, **kw))
        mark_sharded(self.lora_A2, 1)
        for name in self.b1_names:
            mark_sharded(getattr(self, name), 2)
        for name, param in self.named_parameters():
            if not self._shared(name):
                mark_expert(param)
                if name in ("lora_A1", "lora_B2"):
                    mark_replicated_over(param, self.etp_group)

    def _shared(self, name: str) -> bool:
        return name.startswith(f"lora_{self.share.upper()}") if self.share != "none" else False

    def reset_a(self, initial_a, etp_rank: int, ep_offset: int) -> None:
        """A1/A2 from `initial_a(name, experts, full_in)` (every expert, the whole input dim),
        sliced to this rank's experts and expert-TP slice of A2: the same adapters at every layout."""
        first = 0 if self.share == "a" else ep_offset
        for name, split in (("lora_A1", False), ("lora_A2", True)):
            a = getattr(self, name)
            full_in = a.shape[1] * (self._etp_size() if split else 1)
            in_offset = etp_rank * a.shape[1] if split else 0
            with torch.no_grad():
                a.copy_(initial_a(name, full_in)[first : first + a.shape[0], in_offset : in_offset + a.shape[1]])

    def _etp_size(self) -> int:
        return torch.distributed.get_world_size(self.etp_group)

    def _param(self, name: str, replicated_over_etp: bool) -> torch.Tensor:
        param = getattr(self, name)
        if self._shared(name):
            return sum_grad_over(param, self.tp_group)
        return sum_grad_over(param, self.etp_group) if replicated_over_etp else param

    def _apply(self, x, weight, tokens_per_expert):
        if weight.shape[0] == 1:  # shared by the layer's experts: one GEMM over all rows
            return x @ weight[0]
        if wgrad.kernel_wgrad_applies(x) and weight.requires_grad:
            ends = torch.cumsum(host_to_device(tokens_per_expert, x.device), 0, dtype=torch.int32)
            return wgrad.GroupedMatmulKernelWgrad.apply(x.contiguous(), weight, ends)
        return grouped_matmul(x, weight, tokens_per_expert)

    # The scale multiplies the rank-wide product, not the output: a pass over rows x rank instead of
    # rows x ffn (fc1) or rows x hidden (fc2), whose adapters' passes are memory-bound at rank 16.
    def fc1(self, x: torch.Tensor, tokens_per_expert: torch.Tensor) -> torch.Tensor:
        t = self._apply(self.dropout(x), self._param("lora_A1", True), tokens_per_expert) * self.scale
        b1 = [self._param(name, False) for name in self.b1_names]
        # gate and up as one grouped GEMM: [gate | up] per expert is w1's local column layout
        return self._apply(t, b1[0] if len(b1) == 1 else torch.cat(b1, dim=-1), tokens_per_expert)

    def fc2(self, h: torch.Tensor, tokens_per_expert: torch.Tensor) -> torch.Tensor:
        t = self._apply(self.dropout(h), self._param("lora_A2", False), tokens_per_expert) * self.scale
        return self._apply(t, self._param("lora_B2", True), tokens_per_expert)

    def zero_contribution(self) -> torch.Tensor:
        """0, with every factor in the graph: a rank whose experts got no token still runs the
        backward's gradient sums the other ranks run."""
        names = ["lora_A1", "lora_A2", "lora_B2", *self.b1_names]
        replicated = {"lora_A1", "lora_B2"}
        return sum(self._param(n, n in replicated).sum() for n in names) * 0

    def delta_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """scale * A @ B per local expert, in w1's and w2's layouts (experts x in x out)."""
        b1 = torch.cat([getattr(self, n) for n in self.b1_names], dim=-1)
        return self.lora_A1 @ b1 * self.scale, self.lora_A2 @ self.lora_B2 * self.scale
