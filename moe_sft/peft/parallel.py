"""What an adapter factor needs to stay exact at every layout: TP attributes megatron's DDP,
grad norm and checkpoint read, and a gradient sum over a group for factors whose gradient each
rank only holds a part of."""

from __future__ import annotations

import torch
import torch.distributed as dist
from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes


class _SumGradOver(torch.autograd.Function):
    """Identity on a weight; its gradient summed over `group` in the backward.

    For a factor replicated across a group whose ranks each see only part of what its gradient
    sums over (an expert factor replicated across expert-TP, a factor shared by the experts of
    several EP ranks)."""

    @staticmethod
    def forward(ctx, weight, group):
        ctx.group = group
        return weight.view_as(weight)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


def sum_grad_over(weight: torch.Tensor, group) -> torch.Tensor:
    if group is None or dist.get_world_size(group) == 1:
        return weight
    return _SumGradOver.apply(weight, group)


def mark_sharded(param: torch.nn.Parameter, dim: int) -> None:
    """A factor split across TP (or expert TP) along `dim`, as megatron marks its own weights."""
    set_tensor_model_parallel_attributes(param, True, dim, 1)


def mark_expert(param: torch.nn.Parameter) -> None:
    """Reduced over the expert-data-parallel group by megatron's DDP, in the expert optimizer."""
    param.allreduce = False


def mark_replicated_over(param: torch.nn.Parameter, group) -> None:
    """A factor replicated across `group` (an expert factor whole on every expert-TP rank): counted
    once per group in the grad norm. megatron drops a parameter that is not marked tensor-parallel
    from the norm on every rank but the first of the dense TP group, which is not the expert-TP
    group: with TP2, EP2, ETP1 the second rank's experts fell out of the norm. So mark it
    tensor-parallel (kept whatever the dense TP rank) and `shared` (dropped, as megatron drops a
    tied embedding's second copy) on the other ranks of `group`."""
    param.tensor_model_parallel = True
    param.shared = group is not None and dist.get_rank(group) > 0
