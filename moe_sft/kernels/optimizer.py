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

Clip and update in one pass (CUDA, `use_triton_adam`): megatron's chained step multiplies every
main gradient by the clip coefficient, then the Adam kernel reads them again. Here the chained step
hands the coefficient to the Adam step instead, whose Triton kernel (adam.py) multiplies as
it loads. The CPU keeps torch's path.

The same kernel writes the bf16 model parameters (distributed optimizer): megatron's
`_copy_main_params_to_model_params` reads every updated fp32 main shard again to cast it into its
slice of DDP's parameter buffer. Where the kernel wrote every such slice in the step, that copy is
skipped; its fp32-parameter half copies each shard onto itself (the main shard of an fp32
parameter is a view of the buffer), which is checked once, when the slices are collected.
"""

from __future__ import annotations

import functools
import warnings

import torch

from moe_sft.kernels import adam as adam_kernel
from moe_sft.runtime import patches

# benchmarks/gpu/ab_steps.py's switches: False runs megatron's clip multiply and torch's fused Adam instead;
# the kernel without the bf16 parameter writes (megatron's copy then runs).
ENABLED = True
WRITE_MODEL_PARAMS = True


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
    reason = "foreach grad norm and scale"
    patches.swap(clip_grads, "l2_norm_impl", _foreach_l2_norm, group=patches.KERNELS, reason=reason)
    patches.swap(clip_grads, "multi_tensor_scale_impl", _foreach_scale, group=patches.KERNELS, reason=reason)
    patches.swap(optimizer, "multi_tensor_scale_impl", _foreach_scale, group=patches.KERNELS, reason=reason)
    return True


def _inners_for_the_kernel(optimizer) -> list | None:
    """The inner optimizers of a chained optimizer whose whole step the kernel path can take, or None
    where megatron's step does something it does not: a grad scaler (fp16), zero counting, a
    non-Adam inner optimizer (the CPU offload), amsgrad/maximize, or a parameter the kernel
    cannot step (CPU, not fp32, not contiguous)."""
    inners = [o for o in getattr(optimizer, "chained_optimizers", ()) if not getattr(o, "is_stub_optimizer", False)]
    usable = []
    for inner in inners:
        opt = getattr(inner, "optimizer", None)
        if (
            not isinstance(opt, torch.optim.Adam)
            or getattr(inner, "grad_scaler", None) is not None
            or inner.config.log_num_zeros_in_grad
            or inner.config.use_precision_aware_optimizer
        ):
            return None
        groups = opt.param_groups
        if any(g.get("amsgrad") or g.get("maximize") or g.get("differentiable") for g in groups):
            return None
        if not all(adam_kernel.supported(p) for g in groups for p in g["params"]):
            return None
        usable.append(inner)
    return usable or None


def _model_param_slices(inner) -> dict[int, tuple[torch.Tensor, torch.Tensor]] | None:
    """id(fp32 main shard) -> (that shard, the bf16 slice of DDP's parameter buffer megatron's
    DistributedOptimizer._copy_main_params_to_model_params casts it into), for the float16
    parameters; None where that copy does more than those casts (FSDP, precision-aware or fp8/mxfp8
    parameters, an fp32 main shard that is not its own buffer slice, not a distributed optimizer)."""
    from megatron.core.fp8_utils import is_float8tensor

    if not hasattr(inner, "model_param_gbuf_map") or inner.ddp_config.use_megatron_fsdp:
        return None
    if inner.config.use_precision_aware_optimizer or inner.config.reuse_grad_buf_for_mxfp8_param_ag:
        return None

    def buffer_slice(model_param):  # the lookup megatron's copy_group_params makes
        world_range = inner._get_model_param_range_map(model_param)["gbuf_world_in_bucket"]
        gbuf_index, _, bucket_id = inner.model_param_gbuf_map[model_param]
        return inner.buffers[gbuf_index].buckets[bucket_id].param_data.view(-1)[world_range.start : world_range.end]

    slices = {}
    for main_group, model_group in zip(inner.shard_fp32_from_float16_groups, inner.model_float16_groups):
        for main, model in zip(main_group, model_group):
            if is_float8tensor(model) or model.dtype not in (torch.bfloat16, torch.float16):
                return None
            slices[id(main)] = (main, buffer_slice(model))
    for main_group, model_group in zip(inner.shard_fp32_groups, inner.model_fp32_groups):
        for main, model in zip(main_group, model_group):
            if main.data_ptr() != buffer_slice(model).data_ptr():
                return None
    return slices or None


def use_triton_adam(optimizer) -> str | None:
    """Clip + Adam in one Triton pass (module docstring): what it does, for the startup log; None,
    changing nothing, where it cannot."""
    inners = _inners_for_the_kernel(optimizer)
    if inners is None:
        return None
    writes_model_params = 0
    for inner in inners:
        opt = inner.optimizer
        opt.step = functools.partial(_kernel_step, opt)  # instance attributes shadow the class's step
        slices = _model_param_slices(inner)
        if slices is not None:
            opt.__dict__["_model_param_slices"] = slices
            inner._copy_main_params_to_model_params = functools.partial(_copy_unless_written, inner)
            writes_model_params += 1
    optimizer.step = functools.partial(_chained_step, optimizer)
    done = "gradient clipping and Adam in one Triton pass per tensor"
    if writes_model_params:
        done += f", which also writes the bf16 model parameters ({writes_model_params} of {len(inners)} optimizers)"
    return done


def _copy_unless_written(inner) -> None:
    """megatron's main-to-model copy, skipped after a step whose kernels wrote every bf16 slice."""
    if not inner.optimizer.__dict__.pop("_wrote_model_params", False):
        type(inner)._copy_main_params_to_model_params(inner)


@torch.no_grad()
def _chained_step(chained):
    """megatron's ChainedOptimizer.step, the clip multiply handed to the Adam kernels."""
    if not ENABLED:
        return type(chained).step(chained)
    if chained.prepare_grads():
        return False, None, None
    grad_norm = chained.get_grad_norm()  # an instance override (trainer/guard.py) may raise here
    for inner in chained.chained_optimizers:
        clip = inner.config.clip_grad
        coeff = clip / (grad_norm + 1.0e-6) if clip > 0.0 else 1.0  # clip_grad_by_total_norm_fp32's
        if hasattr(inner, "optimizer"):
            inner.optimizer.__dict__["_grad_coeff"] = coeff if coeff < 1.0 else None
    return chained.step_with_ready_grads(), grad_norm, None


def _adam_state(opt: torch.optim.Adam, p: torch.Tensor) -> dict:
    """torch's fused-Adam state for `p` (created as torch's _init_group does), step on p's device."""
    state = opt.state[p]
    if not state:
        state["step"] = torch.zeros((), dtype=torch.float32, device=p.device)
        state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
    elif not torch.is_tensor(state["step"]) or state["step"].device != p.device:
        state["step"] = torch.as_tensor(state["step"], dtype=torch.float32).to(p.device)
    return state


@torch.no_grad()
def _kernel_step(opt: torch.optim.Adam, closure=None):
    coeff = opt.__dict__.pop("_grad_coeff", None)
    if not ENABLED:
        return type(opt).step(opt, closure)
    assert closure is None, "megatron's optimizer steps without a closure"
    slices = (opt.__dict__.get("_model_param_slices") or {}) if WRITE_MODEL_PARAMS else {}
    written = 0
    for group in opt.param_groups:
        params = [p for p in group["params"] if p.grad is not None]
        if not params:
            continue
        states = [_adam_state(opt, p) for p in params]
        torch._foreach_add_([s["step"] for s in states], 1)
        hyper = adam_kernel.hyper_parameters(group, coeff, params[0].device)
        decoupled = group.get("decoupled_weight_decay", isinstance(opt, torch.optim.AdamW))
        for p, s in zip(params, states):
            main, model_slice = slices.get(id(p), (None, None))
            model_slice = model_slice if main is p else None  # an id reused by another tensor: not its slice
            adam_kernel.adam_step(
                p,
                p.grad,
                s["exp_avg"],
                s["exp_avg_sq"],
                s["step"],
                hyper,
                decoupled=decoupled,
                weight_decay=group["weight_decay"] != 0,
                grad_coeff=coeff is not None,
                model_param=model_slice,
            )
            written += model_slice is not None
    opt.__dict__["_wrote_model_params"] = bool(slices) and written == len(slices)
    if slices and written != len(slices) and not opt.__dict__.get("_warned_slices"):
        opt.__dict__["_warned_slices"] = True  # correct (megatron's copy runs), only slower: say it once
        warnings.warn(
            f"the Adam kernel found {written} of {len(slices)} bf16 parameter slices (main parameters "
            "replaced since startup?); megatron's main-to-model copy runs instead",
            stacklevel=2,
        )
