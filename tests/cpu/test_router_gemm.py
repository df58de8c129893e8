"""moe_sft/kernels/router_gemm.py on CPU: the installed function, the fallback, the gradient split
(the bf16 GEMMs themselves run on CUDA only: tests/gpu/test_gpu_router.py)."""

import torch
from megatron.core.transformer.moe import moe_utils, router

from moe_sft.kernels import router_gemm


def test_the_router_uses_it_after_megatron_fixes_and_cpu_tensors_take_megatron_s_path():
    from moe_sft.config import KernelsConfig
    from moe_sft.kernels import install
    from moe_sft.runtime import megatron_fixes

    megatron_fixes.apply_megatron_fixes()
    install.install(KernelsConfig())
    assert router.router_gating_linear is router_gemm.router_gating_linear
    x = torch.randn(6, 1, 16).to(torch.bfloat16).requires_grad_(True)
    w = torch.randn(4, 16).to(torch.bfloat16).requires_grad_(True)
    assert not router_gemm._uses_bf16_gemms(x, w, None, torch.float32)  # CPU
    logits = router_gemm.router_gating_linear(x, w, None, torch.float32)
    torch.testing.assert_close(logits, moe_utils.RouterGatingLinearFunction.apply(x, w, None, torch.float32))
    assert logits.dtype == torch.float32


def test_the_gradient_split_keeps_16_significant_bits():
    g = torch.randn(4000, generator=torch.Generator().manual_seed(0)) * torch.logspace(-30, 30, 4000)
    hi, lo = router_gemm._split_bf16(g)
    assert hi.dtype == lo.dtype == torch.bfloat16
    assert ((hi.float() + lo.float() - g).abs() <= g.abs() * 2**-16).all()


def test_a_frozen_router_computes_no_weight_gradient():
    """LoRA freezes the router: the logits and the input's gradient are megatron's, and the backward
    runs one GEMM (the input's), not megatron's two."""
    from torch.utils.flop_counter import FlopCounterMode

    g = torch.Generator().manual_seed(0)
    x = torch.randn(6, 1, 16, generator=g).to(torch.bfloat16).requires_grad_(True)
    w = torch.randn(4, 16, generator=g).to(torch.bfloat16)
    for bias in (None, torch.randn(4, generator=g)):
        ours, ref = x.detach().clone().requires_grad_(True), x.detach().clone().requires_grad_(True)
        logits = router_gemm.router_gating_linear(ours, w, bias, torch.float32)
        expected = moe_utils.RouterGatingLinearFunction.apply(ref, w, bias, torch.float32)
        torch.testing.assert_close(logits, expected, rtol=0, atol=0)
        with FlopCounterMode(display=False) as counter:
            logits.square().sum().backward()
        expected.square().sum().backward()
        torch.testing.assert_close(ours.grad, ref.grad, rtol=0, atol=0)
        assert counter.get_total_flops() == 2 * 6 * 16 * 4  # dx = g @ w only
