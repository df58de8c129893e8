"""On CUDA the cross entropy runs as two Triton passes over the bf16 logits: the same losses and
bf16 gradients as cross entropy on their fp32 copy (what megatron's unfused version computes), at
Qwen3's vocabulary and a padded one, at two packed lengths, and without the fp32 copy's memory."""

import pytest
import torch
import torch.nn.functional as F

pytestmark = pytest.mark.gpu


def _fp32_reference(logits, target, vocab_size):
    copy = logits.detach().float().requires_grad_(True)
    loss = F.cross_entropy(copy[:, :vocab_size], target, reduction="none")
    return loss, copy


@pytest.mark.parametrize("tokens,vocab_size,padded", [(4096, 151936, 151936), (3001, 151900, 152064)])
def test_fused_loss_matches_fp32_cross_entropy_on_bf16_logits(tokens, vocab_size, padded):
    from moe_sft.kernels.cross_entropy import vocab_parallel_cross_entropy

    g = torch.Generator(device="cuda").manual_seed(0)
    logits = (torch.randn(tokens, padded, device="cuda", generator=g) * 3).bfloat16().requires_grad_(True)
    target = torch.randint(0, vocab_size, (tokens,), device="cuda", generator=g)
    weights = torch.rand(tokens, device="cuda", generator=g)

    ours = vocab_parallel_cross_entropy(logits, target, vocab_size)
    (ours * weights).sum().backward()
    expected, copy = _fp32_reference(logits, target, vocab_size)
    (expected * weights).sum().backward()

    torch.testing.assert_close(ours, expected, rtol=2e-6, atol=2e-5)
    assert logits.grad.dtype == torch.bfloat16
    assert torch.count_nonzero(logits.grad[:, vocab_size:]) == 0
    # bf16 rounding of the same fp32 gradient: at most one ulp apart, nearly all equal
    diff = (logits.grad.float() - copy.grad.bfloat16().float()).abs()
    ulp = copy.grad.abs().clamp(min=2**-126) * 2**-7
    assert (diff <= ulp).all()
    assert (diff == 0).float().mean() > 0.999


def test_fused_loss_keeps_no_fp32_copy_of_the_logits():
    from moe_sft.kernels.cross_entropy import vocab_parallel_cross_entropy

    tokens, vocab = 4096, 151936
    target = torch.randint(0, vocab, (tokens,), device="cuda")

    def peak_over_logits(loss_fn):
        logits = torch.randn(tokens, vocab, device="cuda").bfloat16().requires_grad_(True)
        loss_fn(logits, target).sum().backward()  # warm-up (compilation)
        logits.grad = None
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        loss_fn(logits, target).sum().backward()
        torch.cuda.synchronize()
        return (torch.cuda.max_memory_allocated() - base) / (tokens * vocab)

    ours = peak_over_logits(lambda x, t: vocab_parallel_cross_entropy(x, t, vocab))
    unfused = peak_over_logits(lambda x, t: F.cross_entropy(x.float(), t, reduction="none"))
    # ours: the bf16 gradient (2 bytes per logit) plus per-token vectors; fp32 copy: 4 + 4 + 2
    assert ours < 2.2, ours
    assert unfused > ours + 4, (unfused, ours)


def test_triton_row_statistics_equal_the_torch_ones_on_a_tensor_parallel_shard():
    """What the TP combination is built on: a rank's (max, sum of exp, target logit) over its valid
    columns, with targets held by other ranks (negative or past the shard) contributing 0."""
    from moe_sft.kernels import cross_entropy as ce

    rows, width, valid = 1000, 76032, 75968  # the last TP rank of a padded 151,936 + 128 vocab
    logits = (torch.randn(rows, width, device="cuda") * 3).bfloat16()
    local_target = torch.randint(-width, width, (rows,), device="cuda")
    ours = ce._local_stats_triton(logits, local_target, valid)
    reference = ce._local_stats_torch(logits, local_target, valid)
    for got, want in zip(ours, reference):
        torch.testing.assert_close(got, want, rtol=2e-6, atol=1e-5)
