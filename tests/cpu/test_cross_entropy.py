"""moe_sft.kernels.cross_entropy against torch's cross entropy: losses and logit gradients, with a
TP-padded vocabulary and targets that are masked out. (The tensor-parallel split is checked end to
end by tests/dist/test_layouts.py: TP2 losses and grad norms equal one rank's; the compiled CUDA
kernels by tests/gpu/test_gpu_loss.py.)"""

import pytest
import torch
import torch.nn.functional as F

from moe_sft.kernels.cross_entropy import vocab_parallel_cross_entropy


def _reference(logits, target, vocab_size):
    """torch's CE over the true vocabulary; padded columns get no gradient."""
    logits = logits.detach().clone().requires_grad_(True)
    loss = F.cross_entropy(
        logits[..., :vocab_size].reshape(-1, vocab_size), target.clamp(min=0).reshape(-1), reduction="none"
    ).view(target.shape)
    return loss, logits


@pytest.mark.parametrize("vocab_size,padded", [(300, 384), (256, 256)])
def test_losses_and_gradients_match_torch_in_fp64(vocab_size, padded):
    g = torch.Generator().manual_seed(0)
    logits = (torch.randn(2, 7, padded, generator=g, dtype=torch.float64) * 4).requires_grad_(True)
    target = torch.randint(0, vocab_size, (2, 7), generator=g)
    weights = torch.rand(2, 7, generator=g, dtype=torch.float64)

    ours = vocab_parallel_cross_entropy(logits, target, vocab_size)
    (ours * weights).sum().backward()
    expected, ref_logits = _reference(logits, target, vocab_size)
    (expected * weights).sum().backward()

    assert ours.shape == target.shape
    torch.testing.assert_close(ours, expected, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(logits.grad, ref_logits.grad, rtol=1e-12, atol=1e-12)
    assert torch.count_nonzero(logits.grad[..., vocab_size:]) == 0  # padded columns never train


def test_masked_targets_and_bf16_logits():
    """Masked positions (label -100, weight 0) get a finite loss and a zero gradient; bf16 logits
    give the fp32 result of their exact fp32 values, and a bf16 gradient."""
    g = torch.Generator().manual_seed(1)
    logits = (torch.randn(1, 9, 128, generator=g) * 3).bfloat16().requires_grad_(True)
    target = torch.randint(0, 128, (1, 9), generator=g)
    target[0, ::3] = -100
    mask = (target >= 0).float()

    ours = vocab_parallel_cross_entropy(logits, target, 128)
    (ours * mask).sum().backward()
    expected, ref_logits = _reference(logits.float(), target, 128)
    (expected * mask).sum().backward()

    assert torch.isfinite(ours).all() and ours.dtype == torch.float32
    torch.testing.assert_close(ours * mask, expected * mask, rtol=1e-5, atol=1e-5)
    assert logits.grad.dtype == torch.bfloat16
    assert torch.count_nonzero(logits.grad[0, ::3]) == 0
    torch.testing.assert_close(logits.grad.float(), ref_logits.grad.bfloat16().float(), rtol=0, atol=2**-9)
