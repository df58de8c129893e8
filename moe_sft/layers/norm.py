"""RMSNorm for the torch-native spec that works with sequence parallelism.

megatron's `WrappedTorchNorm` refuses `sequence_parallel=True`, which MoE with TP>1 requires.
RMSNorm is per-token, so under sequence parallelism each TP rank simply normalizes its slice;
the only extra duty is marking the weight `sequence_parallel` so megatron's
`finalize_model_grads` all-reduces its gradient across the TP group (as TE's norms do).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
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
        # torch's rms_norm normalizes in fp32 and rounds once to x's dtype (one fused kernel on
        # CUDA, forward and backward); the weight is applied after the rounding, as HF does.
        # Spelled out in fp32 ops it was 8% of an H200 training step (docs/benchmarks.md).
        return self.weight * F.rms_norm(x, (x.shape[-1],), eps=self.eps)
