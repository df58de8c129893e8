"""megatron's gradient accumulation fusion for the dense linear layers, from torch's own GEMM.

With apex, megatron's Column/RowParallelLinear (attention projections, shared experts, dense
MLPs, the LM head) add each micro-batch's weight gradient into the fp32 main grad inside the
GEMM (`fused_weight_gradient_mlp_cuda.wgrad_gemm_accum_fp32`). Without apex it writes a bf16
gradient and DDP's hook adds it (2 + 2 + 4 + 4 bytes per parameter per micro-batch), most of it
for the LM head's parameters (benchmarks/benchmark.py, "grads"; figures in docs/log.md). torch's `addmm(main_grad, dY^T, X, out_dtype=float32,
out=main_grad)` is that GEMM: bf16 operands, fp32 accumulation, the fp32 main grad read and
written in its epilogue. We hand it to megatron under apex's name and turn the fusion on per
layer, only for layers whose weights DDP gave a main grad, only on CUDA (the op's only backend).
The routed experts have their own kernel (moe_sft/kernels/wgrad.py).

The input embedding's gradient is as dense in megatron (F.embedding's backward zero-fills a
[vocab, hidden] bf16 tensor, scatters the micro-batch's rows into it, and DDP's hook adds all of it
to the main grad), though only the rows of the micro-batch's tokens are non-zero: the whole
[vocab, hidden] table is filled and added per micro-batch for a few thousand rows of gradient
(docs/log.md). `EmbeddingIntoMainGrad` adds just those rows into the fp32 main
grad (index_put_ with accumulate: sorted, deterministic), at TP = 1 and when the weight is not tied
to the LM head (megatron then sums both layers' gradients through autograd, `zero_out_wgrad`).
"""

from __future__ import annotations

import types

import torch
import torch.nn.functional as F
from megatron.core.tensor_parallel import layers as tp_layers

from moe_sft.runtime import patches


def _accumulate_fp32(total_input: torch.Tensor, grad_output: torch.Tensor, main_grad: torch.Tensor) -> None:
    """main_grad [out, in] += grad_output [T, out]^T @ total_input [T, in], in one GEMM."""
    if total_input.dtype == main_grad.dtype:
        main_grad.addmm_(grad_output.t(), total_input)
    else:
        torch.addmm(main_grad, grad_output.t(), total_input, out_dtype=main_grad.dtype, out=main_grad)


def _accumulate_fp16(total_input: torch.Tensor, grad_output: torch.Tensor, main_grad: torch.Tensor) -> None:
    main_grad.addmm_(grad_output.t(), total_input)


TORCH_WGRAD_ACCUM = types.SimpleNamespace(
    wgrad_gemm_accum_fp32=_accumulate_fp32, wgrad_gemm_accum_fp16=_accumulate_fp16
)


def _dense_linears(chunks):
    for chunk in chunks:
        for module in chunk.modules():
            if isinstance(module, (tp_layers.ColumnParallelLinear, tp_layers.RowParallelLinear)):
                yield module


class EmbeddingIntoMainGrad(torch.autograd.Function):
    """F.embedding(ids, weight), its weight gradient added into weight.main_grad row by row."""

    @staticmethod
    def forward(ctx, ids, weight):
        ctx.save_for_backward(ids, weight)
        return F.embedding(ids, weight)

    @staticmethod
    def backward(ctx, grad):
        ids, weight = ctx.saved_tensors
        rows = grad.reshape(-1, grad.shape[-1]).to(weight.main_grad.dtype)
        weight.main_grad.index_put_((ids.reshape(-1),), rows, accumulate=True)
        weight.grad_added_to_main_grad = True
        # DDP's hook must still fire (it marks the bucket ready); it skips this unfilled placeholder.
        return None, torch.empty(weight.shape, dtype=weight.dtype, device=weight.device)


def _embedding_into_main_grad(self, input_):
    return EmbeddingIntoMainGrad.apply(input_, self.weight)


def _fusable_embedding(module) -> bool:
    weight = getattr(module, "weight", None)
    return (
        isinstance(module, tp_layers.VocabParallelEmbedding)
        and module.tp_group.size() == 1
        and not module.reduce_scatter_embeddings
        and weight is not None
        and weight.requires_grad
        and getattr(weight, "main_grad", None) is not None
        and not any(getattr(weight, flag, False) for flag in ("zero_out_wgrad", "shared_embedding", "shared"))
    )


def use_torch_wgrad_accum() -> None:
    """Without apex, megatron's gradient accumulation fusion gets ours under apex's name."""
    if not tp_layers._grad_accum_fusion_available:
        reason = "gradient accumulation fusion through torch.addmm (no apex)"
        patches.swap(
            tp_layers, "fused_weight_gradient_mlp_cuda", TORCH_WGRAD_ACCUM, group=patches.KERNELS, reason=reason
        )
        patches.swap(tp_layers, "_grad_accum_fusion_available", True, group=patches.KERNELS, reason=reason)


def fuse_dense_wgrad(chunks, device: str, enable: bool = True) -> int:
    """Turn megatron's gradient accumulation fusion on (or off) in the dense linear layers of the
    DDP-wrapped `chunks` whose weights train into a main grad, and the row-wise one in their input
    embeddings; returns how many layers."""
    if device != "cuda" or not hasattr(torch.ops.aten.addmm, "dtype_out"):
        return 0
    use_torch_wgrad_accum()
    count = 0
    for linear in _dense_linears(chunks):
        weight = getattr(linear, "weight", None)
        if weight is not None and weight.requires_grad and getattr(weight, "main_grad", None) is not None:
            linear.gradient_accumulation_fusion = enable
            count += 1
    for chunk in chunks:
        for module in chunk.modules():
            if _fusable_embedding(module):
                if enable:
                    module.forward = types.MethodType(_embedding_into_main_grad, module)
                else:
                    module.__dict__.pop("forward", None)  # megatron's own forward again
                count += 1
    return count
