"""megatron's linear with a frozen weight (`tensor_parallel.layers.LinearWithFrozenWeight`, what a
Column/RowParallelLinear runs when its weight does not train: every base linear of a LoRA run, the
LM head included), computed as 2-D GEMMs.

megatron's version calls `torch.matmul` on the 3-D activation ([s, b, h]). When the incoming
gradient is not contiguous (the LM head's, from the loss over selected rows), matmul cannot fold
it into one GEMM and runs a batched GEMM of one row per token, which dominated a LoRA step
(docs/log.md). Flattening to rows first gives the same values.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from moe_sft.runtime import patches


def linear_rows(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x @ weight.T over the rows of x (any leading dims), one 2-D GEMM."""
    out = F.linear(x.reshape(-1, x.shape[-1]), weight)
    # _unsafe_view (as aten's own linear does): a plain view of a tensor made inside an autograd
    # Function is an autograd view, which the in-place ops after it (bias-dropout-add) may not modify
    return torch.ops.aten._unsafe_view(out, (*x.shape[:-1], weight.shape[0]))


def input_grad_rows(grad: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """grad @ weight over the rows of grad (any leading dims, any strides), one 2-D GEMM."""
    return (grad.reshape(-1, grad.shape[-1]) @ weight).view(*grad.shape[:-1], weight.shape[1])


class FrozenWeightLinear2D(torch.autograd.Function):
    """LinearWithFrozenWeight's contract (same apply arguments, no weight gradient), on rows."""

    @staticmethod
    def forward(ctx, input, weight, bias, allreduce_dgrad, tp_group):
        ctx.save_for_backward(weight)
        ctx.allreduce_dgrad, ctx.tp_group = allreduce_dgrad, tp_group
        out = linear_rows(input, weight)
        return out + bias if bias is not None else out  # added after the GEMM, as megatron's

    @staticmethod
    def backward(ctx, grad_output):
        (weight,) = ctx.saved_tensors
        grad_input = input_grad_rows(grad_output, weight)
        if ctx.allreduce_dgrad:
            torch.distributed.all_reduce(grad_input, group=ctx.tp_group)
        return grad_input, None, None, None, None


def use_2d_frozen_linear() -> None:
    from megatron.core.tensor_parallel import layers

    patches.swap(
        layers, "LinearWithFrozenWeight", FrozenWeightLinear2D, group=patches.KERNELS, reason="2-D frozen linear"
    )
