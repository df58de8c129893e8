"""Gradient clipping and the Adam/AdamW update in one Triton pass per tensor (CUDA).

Why: without TE/apex, megatron's optimizer step on CUDA is a foreach multiply of every fp32 main
gradient by the clip coefficient (a read and a write of the gradients), then torch's fused Adam,
which reads them again. torch's fused Adam can take the coefficient as its `grad_scale`, but it
divides by it and writes the unscaled gradient back (it must, for GradScaler): that saved little
and the division moved the fp32 loss curve (figures: docs/log.md). Here the kernel multiplies
by the coefficient as the foreach multiply does and never writes the gradient.

Numerics: the update of torch's fused Adam (aten/src/ATen/native/cuda/fused_adam_utils.cuh) with
its hyper-parameters kept as doubles throughout: the moment updates, the decoupled weight decay and
the epsilon add run in fp64 and round to fp32; the bias corrections are `1 - pow(beta, step)` in fp64
rounded to fp32, the step size `lr / bias_correction1` likewise; the final
`param -= step_size * exp_avg / denom` is fp32. (torch 2.11's CUDA kernel rounds the betas to fp32
first, so `1 - 0.9` is off by 2.4e-7 relative; this kernel is the closer of the two to an fp64
Adam: docs/log.md.) The clip multiply is fp32
`grad * float(c)`, as `torch._foreach_mul_` does it. tests/gpu/test_gpu_adam.py compares both with an
fp64 Adam over several steps.

The bf16 model parameters (optional `model_param`): megatron's distributed optimizer copies each
updated fp32 main shard into its slice of DDP's bf16 parameter buffer (`aten::copy_`, a second read
of the fp32 shard). The kernel stores the same cast, fp32 to
bf16 round-to-nearest-even as `copy_` rounds, from the registers that hold the new value.
"""

from __future__ import annotations

import torch

from moe_sft.kernels.triton_launch import launch
from moe_sft.runtime.device import host_to_device

try:
    import triton
    import triton.language as tl
    from triton.language.extra import libdevice
except ImportError:  # CPU-only installs: torch's CPU wheel ships no Triton
    triton = None

BLOCK = 4096  # elements per program: 16 per thread at 8 warps; a memory-bound pass, any tile >= 1K is within noise

# The fp64 hyper-parameter vector the kernel reads, by index (one small host-to-device copy per group and step).
LR, BETA1, BETA2, WEIGHT_DECAY, EPS, GRAD_COEFF = range(6)


if triton is not None:

    @triton.jit
    def _adam_kernel(
        param_ptr,
        grad_ptr,
        exp_avg_ptr,
        exp_avg_sq_ptr,
        step_ptr,
        hyper_ptr,
        model_ptr,
        numel,
        DECOUPLED: tl.constexpr,
        HAS_WEIGHT_DECAY: tl.constexpr,
        HAS_COEFF: tl.constexpr,
        WRITE_MODEL: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < numel
        lr = tl.load(hyper_ptr + 0)
        beta1 = tl.load(hyper_ptr + 1)
        beta2 = tl.load(hyper_ptr + 2)
        weight_decay = tl.load(hyper_ptr + 3)
        eps = tl.load(hyper_ptr + 4)
        step = tl.load(step_ptr).to(tl.float64)

        param = tl.load(param_ptr + offs, mask=mask)
        grad = tl.load(grad_ptr + offs, mask=mask)
        exp_avg = tl.load(exp_avg_ptr + offs, mask=mask)
        exp_avg_sq = tl.load(exp_avg_sq_ptr + offs, mask=mask)
        if HAS_COEFF:  # clip_grad_by_total_norm_fp32's foreach multiply: fp32 grad * fp32(c)
            grad = grad * tl.load(hyper_ptr + 5).to(tl.float32)
        if HAS_WEIGHT_DECAY:
            if DECOUPLED:  # AdamW: param -= lr * weight_decay * param (doubles)
                param = (param.to(tl.float64) - lr * weight_decay * param.to(tl.float64)).to(tl.float32)
            else:  # Adam's L2 term: grad += param * weight_decay
                grad = (grad.to(tl.float64) + param.to(tl.float64) * weight_decay).to(tl.float32)
        grad64 = grad.to(tl.float64)
        exp_avg = (beta1 * exp_avg.to(tl.float64) + (1 - beta1) * grad64).to(tl.float32)
        exp_avg_sq = (beta2 * exp_avg_sq.to(tl.float64) + (1 - beta2) * grad64 * grad64).to(tl.float32)
        bias_correction1 = (1 - libdevice.pow(beta1, step)).to(tl.float32)
        step_size = (lr / bias_correction1.to(tl.float64)).to(tl.float32)
        bias_correction2 = (1 - libdevice.pow(beta2, step)).to(tl.float32)
        bias_correction2_sqrt = tl.sqrt_rn(bias_correction2)
        denom = (tl.div_rn(tl.sqrt_rn(exp_avg_sq), bias_correction2_sqrt).to(tl.float64) + eps).to(tl.float32)
        param = param - tl.div_rn(step_size * exp_avg, denom)

        tl.store(param_ptr + offs, param, mask=mask)
        tl.store(exp_avg_ptr + offs, exp_avg, mask=mask)
        tl.store(exp_avg_sq_ptr + offs, exp_avg_sq, mask=mask)
        if WRITE_MODEL:
            tl.store(model_ptr + offs, param.to(model_ptr.dtype.element_ty), mask=mask)


def supported(param: torch.Tensor) -> bool:
    """Tensors the kernel steps: contiguous fp32 on a CUDA device, with Triton present."""
    return triton is not None and param.is_cuda and param.dtype == torch.float32 and param.is_contiguous()


def hyper_parameters(group: dict, grad_coeff: float | None, device) -> torch.Tensor:
    """The fp64 vector the kernel reads (indices above)."""
    values = [0.0] * 6
    values[LR], (values[BETA1], values[BETA2]) = float(group["lr"]), group["betas"]
    values[WEIGHT_DECAY], values[EPS] = group["weight_decay"], group["eps"]
    values[GRAD_COEFF] = 1.0 if grad_coeff is None else grad_coeff
    # through pinned memory: a pageable copy would make the host wait for the previous group's kernels
    return host_to_device(torch.tensor(values, dtype=torch.float64), device)


def adam_step(
    param,
    grad,
    exp_avg,
    exp_avg_sq,
    step,
    hyper: torch.Tensor,
    *,
    decoupled: bool,
    weight_decay: bool,
    grad_coeff: bool,
    model_param: torch.Tensor | None = None,
) -> None:
    """One update of `param` (and its moments) in place; `step` is the already-incremented count.
    `model_param`, a bf16/fp16 tensor of as many elements, receives the updated `param` cast to its dtype."""
    for t in (grad, exp_avg, exp_avg_sq):
        assert t.shape == param.shape and t.dtype == torch.float32 and t.is_contiguous(), "Adam state layout"
    if model_param is not None:
        assert (
            model_param.numel() == param.numel()
            and model_param.is_contiguous()
            and model_param.dtype in (torch.bfloat16, torch.float16)
        ), "model parameter layout"
    numel = param.numel()
    launch(
        _adam_kernel,
        (triton.cdiv(numel, BLOCK),),
        param,
        grad,
        exp_avg,
        exp_avg_sq,
        step,
        hyper,
        param if model_param is None else model_param,
        numel,
        DECOUPLED=decoupled,
        HAS_WEIGHT_DECAY=weight_decay,
        HAS_COEFF=grad_coeff,
        WRITE_MODEL=model_param is not None,
        BLOCK=BLOCK,
        num_warps=8,
    )
