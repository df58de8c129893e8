"""RMSNorm of q (or k) over all heads at once, as MiniMax-M2's `q_norm` / `k_norm`.

transformers' MiniMaxM2Attention normalises the whole projection output (q: num_heads * head_dim,
k: num_kv_heads * head_dim) with one weight of that width (MiniMaxM2RMSNorm); megatron's
`qk_layernorm` normalises each head over head_dim. Selected by SFTTransformerConfig's
`qk_norm_full_width` (moe_sft/layers/spec.py).

Tensor parallelism: linear_qkv is split by query group, so each rank holds a contiguous block of
num_heads / TP q heads (and num_kv_heads / TP k heads) and the matching slice of the weight
(sharded along dim 0 in the dist checkpoint). The mean of squares spans every rank's heads: the
per-token sum of squares is all-reduced over the TP group (fp32, one value per token), and so is
its gradient in backward (every rank's output depends on every rank's input through that sum).
Under sequence parallelism q and k already hold the whole sequence (the QKV projection gathers
it), so the weight's gradient is this rank's own slice: not marked `sequence_parallel`.

Numerics (MiniMaxM2RMSNorm): in fp32, y_hat = x * rsqrt(sum(x^2) / width + eps), rounded to x's
dtype, then times the weight.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint


class _AllReduceSum(torch.autograd.Function):
    """Sum over the group in forward and of the gradient in backward (the sum feeds every rank)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        x = x.clone()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


def full_width_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, group=None) -> torch.Tensor:
    """x [..., heads, head_dim] (this rank's heads), weight [heads * head_dim] (its slice): the
    RMSNorm over the heads of every rank of `group` (None: this rank's heads are all of them)."""
    op = torch.promote_types(x.dtype, torch.float32)
    xf = x.to(op)
    sum_sq = xf.pow(2).sum(dim=(-2, -1))
    width = x.shape[-2] * x.shape[-1]
    if group is not None and dist.get_world_size(group) > 1:
        sum_sq = _AllReduceSum.apply(sum_sq, group)
        width *= dist.get_world_size(group)
    rstd = torch.rsqrt(sum_sq / width + eps)
    return (xf * rstd[..., None, None]).to(x.dtype) * weight.view(x.shape[-2:])


class FullWidthQNorm(torch.nn.Module):
    """megatron's q_layernorm slot: built with hidden_size = head_dim, normalises all q heads."""

    def __init__(self, config: TransformerConfig, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.config = config
        self.eps = eps
        self.tp_size = config.tensor_model_parallel_size
        heads = self._num_heads(config)
        if heads % self.tp_size:
            raise ValueError(
                f"{type(self).__name__}: {heads} heads do not split over tensor_model_parallel_size={self.tp_size}"
            )
        self.weight = torch.nn.Parameter(torch.ones((heads // self.tp_size) * hidden_size, dtype=config.params_dtype))
        set_tensor_model_parallel_attributes(self.weight, is_parallel=True, dim=0, stride=1)

    @staticmethod
    def _num_heads(config: TransformerConfig) -> int:
        return config.num_attention_heads

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        group = parallel_state.get_tensor_model_parallel_group() if self.tp_size > 1 else None
        return full_width_rms_norm(x, self.weight, self.eps, group)

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None):
        state = self.state_dict(prefix="", keep_vars=True)
        return make_sharded_tensors_for_checkpoint(state, prefix, {"weight": 0}, sharded_offsets)


class FullWidthKNorm(FullWidthQNorm):
    """The k_layernorm slot: all key/value heads (num_query_groups)."""

    @staticmethod
    def _num_heads(config: TransformerConfig) -> int:
        return config.num_query_groups or config.num_attention_heads
