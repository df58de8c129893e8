"""RMSNorm for the torch-native spec that works with sequence parallelism.

megatron's `WrappedTorchNorm` refuses `sequence_parallel=True`, which MoE with TP>1 requires.
RMSNorm is per-token, so under sequence parallelism each TP rank simply normalizes its slice;
the only extra duty is marking the weight `sequence_parallel` so megatron's
`finalize_model_grads` all-reduces its gradient across the TP group (as TE's norms do).
"""

from __future__ import annotations

import torch
from megatron.core.transformer.transformer_config import TransformerConfig


class RMSNorm(torch.nn.Module):
    """y = x / sqrt(mean(x^2) + eps) * weight, computed in fp32 like HF's Qwen3/Mixtral/DeepSeek."""

    def __init__(self, config: TransformerConfig, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.config = config
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.ones(hidden_size, dtype=config.params_dtype))
        if config.sequence_parallel:
            self.weight.sequence_parallel = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)
