"""megatron's gradient accumulation fusion for the dense linear layers, from torch's own GEMM.

With apex, megatron's Column/RowParallelLinear (attention projections, shared experts, dense
MLPs, the LM head) add each micro-batch's weight gradient into the fp32 main grad inside the
GEMM (`fused_weight_gradient_mlp_cuda.wgrad_gemm_accum_fp32`). Without apex it writes a bf16
gradient and DDP's hook adds it (2 + 2 + 4 + 4 bytes per parameter per micro-batch): 23 ms of
the H200 benchmark's step at the Qwen3-30B-A3B shape, most of it the LM head's 311M parameters
(tools/benchmark.py, "grads"). torch's `addmm(main_grad, dY^T, X, out_dtype=float32,
out=main_grad)` is that GEMM: bf16 operands, fp32 accumulation, the fp32 main grad read and
written in its epilogue. We hand it to megatron under apex's name and turn the fusion on per
layer, only for layers whose weights DDP gave a main grad, only on CUDA (the op's only backend).
The routed experts have their own kernel (moe_sft/layers/wgrad.py).
"""

from __future__ import annotations

import types

import torch
from megatron.core.tensor_parallel import layers as tp_layers


def _accumulate_fp32(total_input: torch.Tensor, grad_output: torch.Tensor, main_grad: torch.Tensor) -> None:
    """main_grad [out, in] += grad_output [T, out]^T @ total_input [T, in], in one GEMM."""
    if total_input.dtype == main_grad.dtype:
        main_grad.addmm_(grad_output.t(), total_input)
    else:
        torch.addmm(main_grad, grad_output.t(), total_input, out_dtype=main_grad.dtype, out=main_grad)


def _accumulate_fp16(total_input: torch.Tensor, grad_output: torch.Tensor, main_grad: torch.Tensor) -> None:
    main_grad.addmm_(grad_output.t(), total_input)


TORCH_WGRAD_ACCUM = types.SimpleNamespace(wgrad_gemm_accum_fp32=_accumulate_fp32,
                                          wgrad_gemm_accum_fp16=_accumulate_fp16)


def _dense_linears(chunks):
    for chunk in chunks:
        for module in chunk.modules():
            if isinstance(module, (tp_layers.ColumnParallelLinear, tp_layers.RowParallelLinear)):
                yield module


def fuse_dense_wgrad(chunks, device: str, enable: bool = True) -> int:
    """Turn megatron's gradient accumulation fusion on (or off) in the dense linear layers of the
    DDP-wrapped `chunks` whose weights train into a main grad; returns how many layers."""
    if device != "cuda" or not hasattr(torch.ops.aten.addmm, "dtype_out"):
        return 0
    if not tp_layers._grad_accum_fusion_available:  # apex absent: ours under its name
        tp_layers.fused_weight_gradient_mlp_cuda = TORCH_WGRAD_ACCUM
        tp_layers._grad_accum_fusion_available = True
    count = 0
    for linear in _dense_linears(chunks):
        weight = getattr(linear, "weight", None)
        if weight is not None and weight.requires_grad and getattr(weight, "main_grad", None) is not None:
            linear.gradient_accumulation_fusion = enable
            count += 1
    return count
