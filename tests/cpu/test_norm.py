"""Our RMSNorm against transformers' own (Qwen3-MoE's), in fp32 and bf16, forward and backward."""

import pytest
import torch
from megatron.core.transformer.transformer_config import TransformerConfig
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeRMSNorm

from moe_sft.layers.norm import RMSNorm


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rmsnorm_matches_transformers(dtype):
    config = TransformerConfig(num_layers=1, hidden_size=64, num_attention_heads=4, params_dtype=dtype)
    ours, theirs = RMSNorm(config, 64, eps=1e-6), Qwen3MoeRMSNorm(64, eps=1e-6).to(dtype)
    weight = torch.randn(64).to(dtype)
    ours.weight.data.copy_(weight)
    theirs.weight.data.copy_(weight)
    x = (torch.randn(5, 3, 64) * 3).to(dtype)
    xa, xb = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    ya, yb = ours(xa), theirs(xb)
    assert ya.dtype == yb.dtype == dtype
    exact = 0.0 if dtype == torch.bfloat16 else 1e-6  # bf16: both round the fp32 result once
    torch.testing.assert_close(ya, yb, rtol=exact, atol=exact)
    g = torch.randn_like(ya)
    ya.backward(g)
    yb.backward(g)
    tol = dict(rtol=2e-2, atol=2e-2) if dtype == torch.bfloat16 else dict(rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(xa.grad, xb.grad, **tol)
    torch.testing.assert_close(ours.weight.grad, theirs.weight.grad, **tol)
