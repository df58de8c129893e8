"""Vocab-parallel cross entropy that reads the logits where they are, in their own dtype.

megatron-core 0.16.1 without Transformer Engine has `tensor_parallel.vocab_parallel_cross_entropy`:
it needs an fp32 copy of the logits, turns it into the softmax in place over several element-wise
passes and saves it for backward: with a large vocabulary (Qwen3's 151,936 tokens) a large share
of the step and 4 bytes per logit of memory (docs/log.md). On CUDA this makes two
Triton passes over the bf16 logits: one reads each row once for its online max, sum of
exponentials and target logit; the backward reads it once more and writes the bf16 gradient. Both
compute in fp32. Saved for backward: the logits (which the LM head's output keeps alive anyway) and
one fp32 per token (timings, and torch.compile of the same passes: docs/log.md). On CPU the same
math runs as torch ops.

Same math as megatron's: each TP rank's (max, sum of exp(x - max)) combined over the group, the
target's logit summed over it; loss = log(sum) + max - target logit. Columns past the true
vocabulary (padding for TP) take no probability mass and get no gradient; a target outside this
rank's vocab range contributes 0 here (another rank holds it), as in megatron.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from moe_sft.kernels.triton_launch import launch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: torch's CPU wheel ships no Triton
    triton = None

STATS_BLOCK, GRAD_BLOCK = 4096, 4096  # vocab columns per loop step / per program


def _wide(x: torch.Tensor) -> torch.Tensor:
    """fp32 for bf16/fp16/fp32 logits (fp64 stays fp64)."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


def _columns(logits: torch.Tensor) -> torch.Tensor:
    return torch.arange(logits.shape[-1], device=logits.device)


# --------------------------------------------------------------------------- torch (CPU, reference)


def _local_stats_torch(logits, local_target, valid):
    x = _wide(logits)
    masked = torch.where(_columns(x) < valid, x, float("-inf"))
    row_max = masked.amax(-1)
    sum_exp = torch.exp(masked - row_max[:, None]).sum(-1)
    on_rank = (local_target >= 0) & (local_target < valid)
    picked = x.gather(1, torch.where(on_rank, local_target, 0)[:, None]).squeeze(1)
    return row_max, sum_exp, torch.where(on_rank, picked, 0.0)


def _logits_grad_torch(logits, log_sum_exp, local_target, valid, grad_loss):
    x = _wide(logits)
    cols = _columns(x)
    softmax = torch.where(cols < valid, torch.exp(x - log_sum_exp[:, None]), 0.0)
    one_hot = (cols[None, :] == local_target[:, None]).to(x.dtype)
    return ((softmax - one_hot) * grad_loss[:, None].to(x.dtype)).to(logits.dtype)


# --------------------------------------------------------------------------- Triton (CUDA)

if triton is not None:

    @triton.jit
    def _stats_kernel(logits_ptr, row_stride, target_ptr, max_ptr, sum_ptr, picked_ptr, valid, BLOCK: tl.constexpr):
        """One row: online max and sum of exp over its valid columns (one read), the target's logit."""
        row = tl.program_id(0).to(tl.int64)
        base = logits_ptr + row * row_stride
        cols = tl.arange(0, BLOCK)
        x = tl.load(base + cols, mask=cols < valid, other=float("-inf")).to(tl.float32)
        row_max = tl.max(x, 0)  # finite: valid >= 1
        sum_exp = tl.sum(tl.exp(x - row_max), 0)
        for first in range(BLOCK, valid, BLOCK):
            x = tl.load(base + first + cols, mask=first + cols < valid, other=float("-inf")).to(tl.float32)
            new_max = tl.maximum(row_max, tl.max(x, 0))
            sum_exp = sum_exp * tl.exp(row_max - new_max) + tl.sum(tl.exp(x - new_max), 0)
            row_max = new_max
        target = tl.load(target_ptr + row)
        on_rank = (target >= 0) & (target < valid)
        picked = tl.load(base + tl.where(on_rank, target, 0)).to(tl.float32)
        tl.store(max_ptr + row, row_max)
        tl.store(sum_ptr + row, sum_exp)
        tl.store(picked_ptr + row, tl.where(on_rank, picked, 0.0))

    @triton.jit
    def _grad_kernel(
        logits_ptr,
        row_stride,
        grad_ptr,
        grad_row_stride,
        lse_ptr,
        target_ptr,
        grad_loss_ptr,
        valid,
        width,
        BLOCK: tl.constexpr,
    ):
        """(softmax - one_hot) x dloss for one row's block of columns, in the logits' dtype."""
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        inside = cols < width
        x = tl.load(logits_ptr + row * row_stride + cols, mask=inside, other=0.0).to(tl.float32)
        softmax = tl.where(cols < valid, tl.exp(x - tl.load(lse_ptr + row)), 0.0)
        softmax = tl.where(cols == tl.load(target_ptr + row), softmax - 1.0, softmax)
        grad = softmax * tl.load(grad_loss_ptr + row).to(tl.float32)
        tl.store(grad_ptr + row * grad_row_stride + cols, grad.to(grad_ptr.dtype.element_ty), mask=inside)


def _local_stats_triton(logits, local_target, valid):
    rows = logits.shape[0]
    row_max, sum_exp, picked = (torch.empty(rows, device=logits.device, dtype=torch.float32) for _ in range(3))
    launch(
        _stats_kernel,
        (rows,),
        logits,
        logits.stride(0),
        local_target,
        row_max,
        sum_exp,
        picked,
        valid,
        BLOCK=STATS_BLOCK,
        num_warps=8,
    )
    return row_max, sum_exp, picked


def _logits_grad_triton(logits, log_sum_exp, local_target, valid, grad_loss):
    grad = torch.empty_like(logits)
    rows, width = logits.shape
    launch(
        _grad_kernel,
        (rows, triton.cdiv(width, GRAD_BLOCK)),
        logits,
        logits.stride(0),
        grad,
        grad.stride(0),
        log_sum_exp,
        local_target,
        grad_loss.float().contiguous(),
        valid,
        width,
        BLOCK=GRAD_BLOCK,
        num_warps=8,
    )
    return grad


# False (kernels.fused=false, moe_sft/kernels/install.py): the torch ops on every device.
ENABLED = True


def _uses_triton(logits: torch.Tensor) -> bool:
    return ENABLED and triton is not None and logits.is_cuda and logits.dtype != torch.float64


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, vocab_size, group):
        local_vocab = logits.shape[-1]
        rank = dist.get_rank(group) if group is not None else 0
        start = rank * local_vocab
        valid = min(local_vocab, vocab_size - start)
        if valid <= 0:
            raise ValueError(
                f"tensor-parallel rank {rank} holds vocab columns {start}-{start + local_vocab - 1}, all "
                f"past the vocabulary ({vocab_size}): pad the vocabulary less or use fewer TP ranks"
            )
        triton_path = _uses_triton(logits) and logits.shape[0] > 0  # no empty Triton grid
        if triton_path and logits.stride(-1) != 1:
            logits = logits.contiguous()
        local_target = (target - start).contiguous()
        stats = _local_stats_triton if triton_path else _local_stats_torch
        row_max, sum_exp, target_logit = stats(logits, local_target, valid)
        if group is not None:  # combine the ranks' (max, sum of exp): one MAX, one SUM all-reduce
            global_max = row_max.clone()
            dist.all_reduce(global_max, op=dist.ReduceOp.MAX, group=group)
            both = torch.stack([sum_exp * torch.exp(row_max - global_max), target_logit])
            dist.all_reduce(both, group=group)
            row_max, sum_exp, target_logit = global_max, both[0], both[1]
        log_sum_exp = torch.log(sum_exp) + row_max
        ctx.save_for_backward(logits, log_sum_exp, local_target)
        ctx.valid, ctx.triton_path = valid, triton_path
        return log_sum_exp - target_logit

    @staticmethod
    def backward(ctx, grad_loss):
        logits, log_sum_exp, local_target = ctx.saved_tensors
        grad = _logits_grad_triton if ctx.triton_path else _logits_grad_torch
        return grad(logits, log_sum_exp, local_target, ctx.valid, grad_loss.contiguous()), None, None, None


def vocab_parallel_cross_entropy(
    logits: torch.Tensor, target: torch.Tensor, vocab_size: int, group=None
) -> torch.Tensor:
    """Per-token loss [...] for logits [..., vocab / TP] (any float dtype) and global target ids [...].

    `group`: the tensor-parallel process group, None when TP = 1 (no collectives)."""
    shape = target.shape
    flat = _VocabParallelCrossEntropy.apply(logits.reshape(-1, logits.shape[-1]), target.reshape(-1), vocab_size, group)
    return flat.view(shape)
