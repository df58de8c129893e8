"""The router's fp32 logits from bf16 GEMMs (CUDA), without TE.

megatron computes the router in fp32 (`moe_router_dtype="fp32"`, our default) through
`router_gating_linear`. With TE, the forward is a bf16 GEMM with an fp32 output; without TE it
casts the bf16 input and weight to fp32 and runs fp32 GEMMs (no tensor cores) forward and
backward, recasting the saved input in the backward: most of the router's time per step
(benchmarks/benchmark.py's ops per phase; figures in docs/log.md).

Forward: `torch.mm(x, w.T, out_dtype=float32)`, TE's GEMM. Every product of two bf16 values is
exact in fp32, so this is the fp32 GEMM of the same values, up to the order of the fp32 sums.

Backward: the logits' gradient is fp32. It is split into two bf16 parts, g = hi + lo (16
significant bits; a bf16 cut of the fp32 value and of what it left), and each product runs as
one bf16 GEMM over both parts: dx = [hi | lo] @ [w ; w] rounded once to x's bf16, as megatron's
fp32 product followed by its cast; dw = hi^T x + lo^T x in fp32, cast to the weight's dtype.
The 8 bits dropped from g are below what either cast keeps. Elsewhere (CPU, fp32 or fp64
weights, a bias) megatron's function runs.

A frozen router (LoRA / DoRA without peft.train_router) gets no weight gradient: megatron's
function computes it anyway (one more router GEMM per MoE layer, thrown away); here the bf16
backward skips it, and elsewhere the logits are megatron's non-TE GEMM under plain autograd,
which computes only the input's gradient (and saves the fp32 weight, not the input).
"""

from __future__ import annotations

import torch
from megatron.core.transformer.moe import moe_utils

from moe_sft.runtime import patches

_megatron_router_gating_linear = moe_utils.router_gating_linear


def _split_bf16(g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    hi = g.to(torch.bfloat16)
    return hi, (g - hi.float()).to(torch.bfloat16)


class _BF16RouterGating(torch.autograd.Function):
    @staticmethod
    def forward(ctx, inp, weight):
        ctx.save_for_backward(inp, weight)
        flat = inp.reshape(-1, inp.shape[-1])
        return torch.mm(flat, weight.t(), out_dtype=torch.float32).view(*inp.shape[:-1], -1)

    @staticmethod
    def backward(ctx, grad_logits):
        inp, weight = ctx.saved_tensors
        flat = inp.reshape(-1, inp.shape[-1])
        parts = torch.cat(_split_bf16(grad_logits.reshape(-1, weight.shape[0]).float()), dim=1)  # [hi | lo]
        grad_input = torch.mm(parts, torch.cat([weight, weight], dim=0))
        grad_weight = None
        if ctx.needs_input_grad[1]:  # a frozen router (LoRA): no weight gradient to compute
            both = torch.mm(parts.t(), flat, out_dtype=torch.float32)
            grad_weight = both.view(2, *weight.shape).sum(0).to(weight.dtype)
        return grad_input.view(inp.shape).to(inp.dtype), grad_weight


def _uses_bf16_gemms(inp, weight, bias, router_dtype) -> bool:
    return (
        inp.is_cuda and router_dtype == torch.float32 and bias is None and inp.dtype == weight.dtype == torch.bfloat16
    )


def router_gating_linear(inp, weight, bias, router_dtype):
    """megatron's `moe_utils.router_gating_linear` (same arguments, same logits)."""
    if _uses_bf16_gemms(inp, weight, bias, router_dtype):
        return _BF16RouterGating.apply(inp, weight)
    if not weight.requires_grad and (bias is None or not bias.requires_grad):
        return _frozen_router_logits(inp, weight, bias, router_dtype)
    return _megatron_router_gating_linear(inp, weight, bias, router_dtype)


def _frozen_router_logits(inp, weight, bias, router_dtype):
    """megatron's non-TE forward of `router_gating_linear` (same values), whose backward autograd
    runs for the input only."""
    flat = inp.reshape(-1, inp.shape[-1]).to(router_dtype)
    w = weight.to(router_dtype).t()
    out = torch.mm(flat, w) if bias is None else torch.addmm(bias.to(router_dtype), flat, w)
    return out.view(*inp.shape[:-1], -1)


def use_bf16_router_gemms() -> None:
    """The router module imported the function by name."""
    from megatron.core.transformer.moe import router

    patches.swap(
        router, "router_gating_linear", router_gating_linear, group=patches.KERNELS, reason="bf16 router GEMMs"
    )
