"""The router's logits and gradients from bf16 GEMMs (moe_sft/layers/router_gemm.py) against
megatron's fp32 GEMMs, at the Qwen3-30B-A3B router shape."""

import pytest
import torch

pytestmark = pytest.mark.gpu


def test_bf16_router_gemms_give_megatron_s_fp32_logits_and_gradients():
    from megatron.core.transformer.moe import moe_utils

    from moe_sft.layers import router_gemm
    from moe_sft.runtime import compat

    compat.apply_megatron_fixes()
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(4096, 1, 2048, device="cuda", generator=g).to(torch.bfloat16)
    w = (torch.randn(128, 2048, device="cuda", generator=g) * 0.02).to(torch.bfloat16)
    grad = torch.randn(4096, 1, 128, device="cuda", generator=g) * 1e-3

    def run(fn):
        xi, wi = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
        logits = fn(xi, wi, None, torch.float32)
        logits.backward(grad)
        return logits, xi.grad, wi.grad

    assert router_gemm._uses_bf16_gemms(x, w, None, torch.float32)
    ours, theirs = run(router_gemm.router_gating_linear), run(moe_utils.RouterGatingLinearFunction.apply)
    assert ours[0].dtype == theirs[0].dtype == torch.float32
    torch.testing.assert_close(ours[0], theirs[0], rtol=1e-5, atol=1e-5)  # the same products, other sum order
    for a, b in zip(ours[1:], theirs[1:]):
        assert a.dtype == b.dtype == torch.bfloat16
        # one bf16 rounding of (nearly) the same fp32 value: at most one ulp apart, rarely
        torch.testing.assert_close(a, b, rtol=2 ** -7, atol=1e-6)
        assert (a != b).float().mean() < 0.05
