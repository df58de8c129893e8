"""Our RMSNorm against transformers' own (Qwen3-MoE's), in fp32 and bf16, forward and backward."""

import pytest
import torch
from megatron.core.transformer.transformer_config import TransformerConfig
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeRMSNorm

from moe_sft.layers.norm import RMSNorm


@pytest.mark.parametrize("zero_centred", [False, True], ids=["qwen3", "zero_centred"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rmsnorm_matches_transformers(dtype, zero_centred):
    """Qwen3-MoE's norm, and Qwen3.5 / Qwen3-Next's zero-centred one (weight stored around 0, fp32
    x-hat times fp32 (1 + w), rounded once) through the same autograd function: forward bit-equal
    to transformers' in bf16, gradients within a rounding."""
    from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeRMSNorm

    config = TransformerConfig(
        num_layers=1,
        hidden_size=64,
        num_attention_heads=4,
        params_dtype=dtype,
        layernorm_zero_centered_gamma=zero_centred,
    )
    theirs = (Qwen3_5MoeRMSNorm if zero_centred else Qwen3MoeRMSNorm)(64, eps=1e-6).to(dtype)
    ours = RMSNorm(config, 64, eps=1e-6)
    weight = (torch.randn(64) * (0.1 if zero_centred else 1.0)).to(dtype)
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


def test_backward_is_the_derivative_in_fp64():
    """The hand-written backward (shared by the CPU ops and the Triton kernels) against finite
    differences, through a strided input like k of a split QKV output."""
    from moe_sft.layers.norm import rms_norm

    qkv = torch.randn(3, 2, 6 * 16, dtype=torch.float64)
    x = qkv.split([4 * 16, 16, 16], dim=-1)[1].detach().requires_grad_(True)
    weight = torch.randn(16, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda x, w: rms_norm(x, w, 1e-6, use_triton=False), (x, weight))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_keeps_the_input_and_one_fp32_per_row_and_equals_torch_rms_norm(dtype):
    """What the planner's `_norm` counts (input + 1/rms per row); the forward is bit-equal to
    `weight * F.rms_norm(x)` (the op this module replaced), the gradients within a rounding of it
    (its weight gradient rounds dy * w to bf16 before the norm's backward; ours keeps fp32)."""
    import torch.nn.functional as F

    from moe_sft.layers.norm import rms_norm
    from moe_sft.plan.memory import _norm

    x = (torch.randn(6, 5, 256) * 3).to(dtype).requires_grad_(True)
    weight = torch.randn(256).to(dtype).requires_grad_(True)
    storages = {}

    def pack(t):
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = rms_norm(x, weight, 1e-6, use_triton=False)
    storages.pop(weight.untyped_storage().data_ptr())
    assert sum(storages.values()) == (_norm(30, 256) if dtype == torch.bfloat16 else 30 * (4 * 256 + 4))
    xb, wb = x.detach().clone().requires_grad_(True), weight.detach().clone().requires_grad_(True)
    reference = wb * F.rms_norm(xb, (256,), eps=1e-6)
    assert torch.equal(y, reference)
    g = torch.randn_like(y)
    y.backward(g)
    reference.backward(g)
    tol = dict(rtol=2**-7, atol=1e-2) if dtype == torch.bfloat16 else dict(rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(x.grad, xb.grad, **tol)
    # dw sums 30 products with cancellation: bound by a rounding of each term (bf16: 2^-8 relative)
    # plus one of the result
    y_hat = F.rms_norm(xb.detach(), (256,), eps=1e-6)
    terms = (g.double() * y_hat.double()).reshape(-1, 256).abs().sum(0)
    unit = 2**-8 if dtype == torch.bfloat16 else 2**-20
    assert ((weight.grad.double() - wb.grad.double()).abs() <= unit * (terms + wb.grad.double().abs())).all()


def test_round_once_backward_is_the_derivative_in_fp64():
    from moe_sft.layers.norm import rms_norm

    x = torch.randn(4, 3, 16, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(16, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(
        lambda x, w: rms_norm(x, w, 1e-6, use_triton=False, offset=1.0, round_hat=False), (x, weight)
    )
