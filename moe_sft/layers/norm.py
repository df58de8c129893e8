"""RMSNorm for the torch-native spec: sequence-parallel aware, one Triton kernel each way on CUDA
(moe_sft/kernels/rms_norm.py).

megatron's `WrappedTorchNorm` refuses `sequence_parallel=True`, which MoE with TP>1 requires.
RMSNorm is per-token, so under sequence parallelism each TP rank simply normalizes its slice;
the only extra duty is marking the weight `sequence_parallel` so megatron's
`finalize_model_grads` all-reduces its gradient across the TP group (as TE's norms do).

On CUDA the kernels of moe_sft/kernels/rms_norm.py run it (why: that module's docstring). Saved for
backward: the input as it is and an fp32 1/rms per row (the planner's `_norm`); the normalised
value is recomputed. On CPU (and for fp64 or widths past kernels.rms_norm.MAX_TRITON_WIDTH) the same
math runs as torch ops with the same saves.

Numerics (HF's Qwen3MoeRMSNorm, torch's rms_norm): in fp32, y_hat = x * rsqrt(mean(x^2) + eps),
rounded to x's dtype, then times the weight, rounded once to promote(x, weight). The zero-centred
norms of Qwen3-Next / Qwen3.5 (and Gemma's, `round_hat=False`) keep y_hat in fp32, multiply by the
fp32 (offset + weight) and round once to x's dtype; their weight gradient sums dy * the fp32 y_hat. Backward in
fp32 from the stored inputs: g = dy * w, dx = rstd * (g - x_hat * mean(g * x_hat)) with the
unrounded x_hat = x * rstd (as torch's fused backward), dw = sum over rows of dy * y_hat (the
rounded y_hat, as in forward). Unlike the torch ops, g and the products dy * y_hat stay in fp32
instead of being rounded to bf16 first: a little more accurate, not bit-equal.
"""

from __future__ import annotations

import torch
from megatron.core.transformer.transformer_config import TransformerConfig

from moe_sft.kernels import rms_norm as kernels
from moe_sft.kernels.rms_norm import triton_fits  # noqa: F401  (the default choice of `rms_norm`)


def _opmath(dtype: torch.dtype) -> torch.dtype:
    """fp32 for bf16/fp16/fp32 (fp64 stays fp64)."""
    return torch.promote_types(dtype, torch.float32)


def _forward_torch(x, weight, eps, offset=0.0, round_hat=True):
    xf = x.to(_opmath(x.dtype))
    rstd = torch.rsqrt(xf.pow(2).mean(-1) + eps)
    x_hat = xf * rstd[..., None]
    if round_hat:
        return x_hat.to(x.dtype) * (weight + offset if offset else weight), rstd
    return (x_hat * (weight.to(xf.dtype) + offset)).to(x.dtype), rstd


def _backward_torch(dy, x, weight, rstd, need_dx, need_dw, offset=0.0, round_hat=True):
    op = _opmath(x.dtype)
    x_hat = x.to(op) * rstd[..., None]
    dy = dy.to(op)
    dx = dw = None
    if need_dx:
        g = dy * (weight.to(op) + offset)
        dx = ((g - x_hat * (g * x_hat).mean(-1, keepdim=True)) * rstd[..., None]).to(x.dtype)
    if need_dw:
        y_hat = x_hat.to(x.dtype).to(op) if round_hat else x_hat
        dw = (dy * y_hat).reshape(-1, x.shape[-1]).sum(0).to(weight.dtype)
    return dx, dw


class _RMSNormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, eps, use_triton, offset, round_hat):
        y, rstd = (kernels.forward_triton if use_triton else _forward_torch)(x, weight, eps, offset, round_hat)
        ctx.save_for_backward(x, weight, rstd)  # x as it is: a view saves no new storage
        ctx.use_triton, ctx.offset, ctx.round_hat = use_triton, offset, round_hat
        return y

    @staticmethod
    def backward(ctx, dy):
        x, weight, rstd = ctx.saved_tensors
        backward = kernels.backward_triton if ctx.use_triton else _backward_torch
        needs = ctx.needs_input_grad
        dx, dw = backward(dy, x, weight, rstd, needs[0], needs[1], ctx.offset, ctx.round_hat)
        return dx, dw, None, None, None, None


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    use_triton: bool | None = None,
    *,
    offset: float = 0.0,
    round_hat: bool = True,
) -> torch.Tensor:
    """(offset + weight) * rms-normalised x over the last dim (module docstring: numerics, saves).

    `use_triton`: None picks the Triton kernels where `triton_fits`; True forces them (CPU tensors
    run them under TRITON_INTERPRET=1), False forces the torch ops. `offset` 1.0 is the zero-centred
    weight (stored around 0, scaling by 1 + w). `round_hat` False is the round-once order of the
    zero-centred Qwen3.5 and the Gemma norms: fp32 x-hat times the fp32 weight, rounded once to x's
    dtype."""
    if use_triton is None:
        use_triton = triton_fits(x, weight)
    return _RMSNormFunction.apply(x, weight, eps, use_triton, float(offset), bool(round_hat))


class RMSNorm(torch.nn.Module):
    """y = x / sqrt(mean(x^2) + eps) * weight, computed in fp32 like HF's Qwen3/Mixtral/DeepSeek."""

    def __init__(self, config: TransformerConfig, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.config = config
        self.eps = eps
        # Zero-centred (Qwen3-Next, Qwen3.5): the weight is stored around 0 and scales by 1 + w
        self.zero_centered = bool(getattr(config, "layernorm_zero_centered_gamma", False))
        init = torch.zeros if self.zero_centered else torch.ones
        self.weight = torch.nn.Parameter(init(hidden_size, dtype=config.params_dtype))
        if config.sequence_parallel:
            self.weight.sequence_parallel = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.zero_centered:  # transformers' order: fp32 normalised x times fp32 (1 + w), rounded once
            return rms_norm(x, self.weight, self.eps, offset=1.0, round_hat=False)
        return rms_norm(x, self.weight, self.eps)


class LatentRMSNorm(RMSNorm):
    """MLA's q/kv latent norms, with the config's `mla_latent_layernorm_epsilon` when set (megatron
    passes layernorm_epsilon; transformers' DeepSeek-V3 builds these norms with 1e-6)."""

    def __init__(self, config: TransformerConfig, hidden_size: int, eps: float = 1e-6):
        latent_eps = getattr(config, "mla_latent_layernorm_epsilon", None)
        super().__init__(config, hidden_size, eps if latent_eps is None else latent_eps)


class Gemma4RMSNorm(RMSNorm):
    """transformers' Gemma4RMSNorm (gemma4_math.rms_norm): the fp32 normalised x times the fp32
    weight, rounded once, in the same fused kernels as `RMSNorm` (`round_hat=False`). Equal to
    `RMSNorm` in fp32; in bf16 that one rounds x̂ before the weight (Qwen's order), which Gemma 4
    does not."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps, round_hat=False)
