"""torch's fused and multi-tensor kernels for megatron's optimizer where TE and apex are absent.

Adam. Without them megatron-core 0.16.1 falls back to `torch.optim.AdamW` with its defaults, i.e. the
multi-tensor ("foreach") implementation: about a dozen passes over the fp32 state per step. torch
also ships a fused implementation (one kernel per tensor group, on CUDA and CPU) computing the same
update; on the 5.6B-parameter benchmark shard the step's optimizer phase is memory-bound, so the
pass count is its time. The flag is read per step from the param groups, so we set it there;
a pre-step hook keeps it set (a checkpoint load replaces the groups) and moves each parameter's
'step' counter to the parameter's device, where the fused kernel reads it.

Gradient norm and clipping. megatron's local stand-ins for apex's multi_tensor_l2norm/scale take
one norm per tensor, then build a tensor from the list of norms, which copies each one to the
host (a device sync per parameter tensor), and scale tensor by tensor. torch's `_foreach_norm`
and `_foreach_mul` do the same sums and products in a few multi-tensor kernels, no host copy.
"""

from __future__ import annotations

import torch


def _torch_adams(optimizer):
    """The torch Adam/AdamW instances inside megatron's (possibly chained) optimizer."""
    for inner in getattr(optimizer, "chained_optimizers", [optimizer]):
        opt = getattr(inner, "optimizer", None)
        if isinstance(opt, torch.optim.Adam):  # AdamW subclasses Adam; the hybrid CPU offload does not
            yield opt


def _fused_supported(opt: torch.optim.Optimizer) -> bool:
    params = [p for group in opt.param_groups for p in group["params"]]
    return bool(params) and all(p.is_floating_point() and p.device.type in ("cuda", "cpu") for p in params)


def _keep_fused(opt: torch.optim.Optimizer, _args, _kwargs) -> None:
    for group in opt.param_groups:
        group["fused"], group["foreach"] = True, False
        for p in group["params"]:
            state = opt.state.get(p)
            step = state.get("step") if state else None
            if torch.is_tensor(step) and step.device != p.device:
                state["step"] = step.to(p.device, torch.float32)


def use_fused_adam(optimizer) -> int:
    """Switch every torch Adam inside `optimizer` to the fused kernel; returns how many were."""
    switched = 0
    for opt in _torch_adams(optimizer):
        if _fused_supported(opt):
            _keep_fused(opt, (), {})
            opt.register_step_pre_hook(_keep_fused)
            switched += 1
    return switched


def _foreach_l2_norm(chunk_size, noop_flag, tensor_lists, per_tensor, *args):
    """Drop-in for megatron's local_multi_tensor_l2_norm: ([total norm] fp32 tensor, None)."""
    norms = torch._foreach_norm(tensor_lists[0])
    return torch.linalg.vector_norm(torch.stack(norms).float()).reshape(1), None


def _foreach_scale(chunk_size, noop_flag, tensor_lists, scale):
    """Drop-in for megatron's local_multi_tensor_scale: dst = src * scale for each pair."""
    src, dst = tensor_lists
    if all(s is d for s, d in zip(src, dst)):
        torch._foreach_mul_(dst, scale)
    else:
        torch._foreach_copy_(dst, torch._foreach_mul(src, scale))


def use_foreach_grad_norm() -> bool:
    """Replace megatron's local (per-tensor) grad-norm and scale fallbacks; False if apex/TE's are used."""
    from megatron.core import utils
    from megatron.core.optimizer import clip_grads, optimizer

    if clip_grads.l2_norm_impl is not utils.local_multi_tensor_l2_norm:
        return False
    clip_grads.l2_norm_impl = _foreach_l2_norm
    clip_grads.multi_tensor_scale_impl = _foreach_scale
    optimizer.multi_tensor_scale_impl = _foreach_scale
    return True
