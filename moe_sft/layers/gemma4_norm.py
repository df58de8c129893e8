"""Gemma 4's RMSNorm as a megatron norm module (the signature megatron's specs build norms with).

transformers' Gemma4RMSNorm multiplies the fp32 normalised x by the fp32 weight and rounds once
(gemma4_math.rms_norm); layers/norm.py's RMSNorm rounds x̂ to x's dtype before the weight (Qwen's
order). Equal in fp32, not in bf16, so every Gemma 4 norm is this one.
"""

from __future__ import annotations

import torch
from megatron.core.transformer.transformer_config import TransformerConfig

from moe_sft.layers.gemma4_math import rms_norm


class Gemma4RMSNorm(torch.nn.Module):
    """y = fp32(x) * (mean(x²) + eps) ** -0.5 * fp32(weight), rounded once to x's dtype."""

    def __init__(self, config: TransformerConfig, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.config = config
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.ones(hidden_size, dtype=config.params_dtype))
        if config.sequence_parallel:  # per-token, so each TP rank's gradient is over its own tokens
            self.weight.sequence_parallel = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.eps, self.weight)
