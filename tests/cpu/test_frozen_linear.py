"""kernels/frozen_linear.py: the 2-D frozen linear equals megatron's LinearWithFrozenWeight (output
and input gradient, a non-contiguous incoming gradient included), and kernels.install swaps it in
and out with kernels.fused."""

from __future__ import annotations

import torch

from moe_sft.kernels.frozen_linear import FrozenWeightLinear2D


def test_equals_megatrons_frozen_linear_on_a_strided_gradient():
    from megatron.core.tensor_parallel import layers

    from moe_sft.runtime import patches

    megatron = patches.original(layers, "LinearWithFrozenWeight")
    g = torch.Generator().manual_seed(0)
    weight = torch.randn(24, 16, generator=g)
    bias = torch.randn(24, generator=g)
    results = []
    for fn in (megatron, FrozenWeightLinear2D):
        x = torch.randn(10, 2, 16, generator=torch.Generator().manual_seed(1)).requires_grad_()
        out = fn.apply(x, weight, bias, False, None)
        grad = torch.randn(2, 10, 24, generator=torch.Generator().manual_seed(2)).transpose(0, 1)  # strided
        out.backward(grad)
        results.append((out.detach(), x.grad))
    torch.testing.assert_close(results[0][0], results[1][0], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(results[0][1], results[1][1], rtol=1e-6, atol=1e-6)


def test_installed_with_the_fused_kernels_only():
    from megatron.core.tensor_parallel import layers

    from moe_sft.config.schema import KernelsConfig
    from moe_sft.kernels import install

    install.install(KernelsConfig(fused=True))
    assert layers.LinearWithFrozenWeight is FrozenWeightLinear2D
    install.install(KernelsConfig(fused=False))
    assert layers.LinearWithFrozenWeight is not FrozenWeightLinear2D
    install.install(KernelsConfig(fused=True))
