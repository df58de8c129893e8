"""Core attention for the torch-native layer spec: packed (THD) sequences, causal, GQA.

megatron-core's local `DotProductAttention` rejects `packed_seq_params` and allocates on CUDA,
so the torch-native spec uses this module instead. Kernels, best first:

* flash-attn's `flash_attn_varlen_func` when the package imports (GPU);
* torch's flash varlen kernel on CUDA: the aten op `torch.nn.attention.varlen.varlen_attn`
  runs, called directly (`_FlashVarlen`);
* a per-document `scaled_dot_product_attention` loop that honours cu_seqlens (CPU, and any
  head dim the kernels refuse) — the reference the fast paths are tested against.

Inputs follow megatron's SelfAttention: THD `[t, heads, dim]` when packed, else `[s, b, heads, dim]`.
With context_parallel_size > 1 (THD only) the same kernels run over all-gathered K/V:
moe_sft/layers/context_parallel.py. Learnable / off-by-one softmax sinks (megatron's
`softmax_type`) and causal sliding windows (`window_size`, `window_attn_skip_freq`):
moe_sft/layers/attention_sinks.py.
"""

from __future__ import annotations

import functools
import inspect
import math

import torch
import torch.distributed as dist
import torch.nn.functional as F
from megatron.core import tensor_parallel
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

from moe_sft.layers.attention_sinks import (
    FLASH_KERNELS,
    SinkFlashVarlen,
    layer_window,
    sink_attention_reference,
)
from moe_sft.layers.context_parallel import context_parallel_attention, plan_cp_attention, sdpa_bottom_right

try:  # flash-attn is optional: the field's standard kernel when installed.
    from flash_attn import flash_attn_varlen_func
except ImportError:  # pragma: no cover - depends on the machine
    flash_attn_varlen_func = None

try:
    from torch.nn.attention.varlen import varlen_attn

    _VARLEN_PARAMS = set(inspect.signature(varlen_attn).parameters)
except ImportError:  # pragma: no cover - torch < 2.10
    varlen_attn, _VARLEN_PARAMS = None, set()


class _FlashVarlen(torch.autograd.Function):
    """Causal varlen attention through torch's flash kernels (aten `_flash_attention_forward` /
    `_flash_attention_backward`) with the arguments `varlen_attn` gives them, without its
    torch.library custom op around them (dispatch, fake-tensor and autograd wrappers, three fills).
    The step is host-bound (docs/benchmarks.md): on an H200 host a forward + backward took 317 us
    of host time this way against 907 through varlen_attn, for the same GPU time (1.04 ms at 4096
    tokens). Same kernels: the output, dk and dv bits match varlen_attn's; dq is summed with fp32
    atomics, so its last bit varies from run to run with either (tests/gpu/test_gpu_cp_attention.py)."""

    @staticmethod
    def forward(ctx, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale):
        out, lse, seed, offset, _ = torch.ops.aten._flash_attention_forward(
            q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, 0.0, True, False, scale=scale
        )
        ctx.save_for_backward(q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, seed, offset)
        ctx.sizes = (max_seqlen_q, max_seqlen_k, scale)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, seed, offset = ctx.saved_tensors
        max_seqlen_q, max_seqlen_k, scale = ctx.sizes
        dq, dk, dv = torch.ops.aten._flash_attention_backward(
            grad_out.contiguous(),
            q,
            k,
            v,
            out,
            lse,
            cu_seqlens_q,
            cu_seqlens_k,
            max_seqlen_q,
            max_seqlen_k,
            0.0,
            True,
            seed,
            offset,
            scale=scale,
        )
        return dq, dk, dv, None, None, None, None, None


def attention_kernel_name(device_type: str) -> str:
    """Which kernel `VarlenCoreAttention` uses on this device (printed at startup)."""
    if device_type == "cuda" and flash_attn_varlen_func is not None:
        return "flash_attn.flash_attn_varlen_func"
    if device_type == "cuda" and varlen_attn is not None:
        return "torch's flash varlen kernel (the one torch.nn.attention.varlen.varlen_attn runs), called directly"
    return "per-document scaled_dot_product_attention (reference path)"


def sdpa_varlen_reference(q, k, v, cu_seqlens, scale, causal=True):
    """Attention over each document [cu[i], cu[i+1]) alone; q/k/v are [t, heads, dim]."""
    out = q.new_empty(q.shape[0], q.shape[1], v.shape[-1])
    groups = q.shape[1] // k.shape[1]
    bounds = cu_seqlens.tolist()
    for start, end in zip(bounds[:-1], bounds[1:]):
        if end == start:
            continue
        qd = q[start:end].transpose(0, 1)  # [heads, s, dim]
        kd = k[start:end].transpose(0, 1).repeat_interleave(groups, dim=0)
        vd = v[start:end].transpose(0, 1).repeat_interleave(groups, dim=0)
        od = F.scaled_dot_product_attention(qd, kd, vd, is_causal=causal, scale=scale)
        out[start:end] = od.transpose(0, 1)
    return out


def _varlen_cuda(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale, sink=None, window=None):
    """Causal varlen attention; with seqlen_q < seqlen_k (context parallel) the causal mask is
    bottom-right aligned in both kernels (flash-attn's `causal=True`; window (-1, 0) of torch's).
    A sink or a window goes through torch's flash kernel with the sink folded in (`SinkFlashVarlen`)."""
    v_dim = v.shape[-1]
    if v_dim != q.shape[-1]:
        # MLA: v head dim (128) < q/k head dim (192), which the flash kernels refuse. Zero-padding
        # v gives softmax(qkᵀ)·[v, 0] = [out, 0]; the slice keeps exact values and gradients.
        v = F.pad(v, (0, q.shape[-1] - v_dim))
        out = _varlen_cuda(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale, sink, window)
        return out[..., :v_dim]
    if sink is not None or window is not None:
        return SinkFlashVarlen.apply(
            q, k, v, sink, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale, window, FLASH_KERNELS
        )
    if flash_attn_varlen_func is not None:
        return flash_attn_varlen_func(
            q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale=scale, causal=True
        )
    return _FlashVarlen.apply(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale)


def torch_varlen_attn(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale):
    """torch's public varlen_attn with the causal window: what `_FlashVarlen` is tested against."""
    extra = {"enable_gqa": True} if ("enable_gqa" in _VARLEN_PARAMS and k.shape[1] != q.shape[1]) else {}
    return varlen_attn(
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale=scale, window_size=(-1, 0), **extra
    )


def _has_cuda_kernel(q) -> bool:
    """The flash kernels take fp16/bf16 only: fp32 on CUDA (a reference run) takes the SDPA path."""
    half = q.dtype in (torch.float16, torch.bfloat16)
    return q.is_cuda and half and (flash_attn_varlen_func is not None or varlen_attn is not None)


def cp_kernel(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale, sink=None, window=None):
    """The context-parallel kernel: varlen (separate q/k cu_seqlens) on CUDA, else SDPA with a
    bottom-right causal mask. Sinks and windows are exact under CP: each query chunk attends to
    its whole key prefix (so the lse the sink is folded with spans all of the query's keys), and
    both kernels align the window bottom-right like the causal mask."""
    if _has_cuda_kernel(q):
        cu_q, cu_k = cu_seqlens_q.to(torch.int32), cu_seqlens_k.to(torch.int32)
        return _varlen_cuda(q, k, v, cu_q, cu_k, max_seqlen_q, max_seqlen_k, scale, sink, window)
    if sink is not None or window is not None:
        return sink_attention_reference(q, k, v, cu_seqlens_q, cu_seqlens_k, scale, sink, window)
    return sdpa_bottom_right(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale)


class VarlenCoreAttention(MegatronModule):
    """Drop-in for megatron's core attention (same constructor) that supports THD packing."""

    def __init__(
        self,
        config: TransformerConfig,
        layer_number: int,
        attn_mask_type: AttnMaskType,
        attention_type: str,
        attention_dropout: float | None = None,
        softmax_scale: float | None = None,
        cp_comm_type: str | None = None,
        pg_collection=None,
        k_channels: int | None = None,
        v_channels: int | None = None,
    ):
        # MLA passes k_channels/v_channels (q/k head dim ≠ v head dim); the kernels read the
        # head dims from the tensors, so only the default softmax scale needs k_channels.
        super().__init__(config=config)
        self.cp_size = config.context_parallel_size
        self.cp_group = getattr(pg_collection, "cp", None)
        if self.cp_size > 1 and self.cp_group is None:
            from megatron.core import parallel_state

            self.cp_group = parallel_state.get_context_parallel_group()
        if attn_mask_type not in (AttnMaskType.causal, AttnMaskType.padding_causal):
            raise ValueError(f"VarlenCoreAttention supports causal masks only, got {attn_mask_type}")
        dropout = config.attention_dropout if attention_dropout is None else attention_dropout
        if dropout:
            raise ValueError(
                "attention_dropout > 0 is not supported by the torch-native "
                "attention; set model.attention_dropout=0.0 (SFT default)."
            )
        head_dim = k_channels or config.kv_channels
        self.softmax_scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(head_dim)
        self.window = layer_window(config, layer_number)
        self._init_softmax_offset(config, pg_collection)

    def _init_softmax_offset(self, config: TransformerConfig, pg_collection) -> None:
        """megatron's DotProductAttention sinks: same attribute, shape, init and checkpoint layout."""
        softmax_type = getattr(config, "softmax_type", "vanilla")
        if softmax_type == "vanilla":
            self.softmax_offset = None
            return
        if softmax_type not in ("off-by-one", "learnable"):
            raise ValueError(f"softmax_type={softmax_type!r} is not supported (vanilla, off-by-one, learnable)")
        self.tp_group = getattr(pg_collection, "tp", None)
        if self.tp_group is None:
            from megatron.core import parallel_state

            self.tp_group = parallel_state.get_tensor_model_parallel_group()
        heads = config.num_attention_heads // self.tp_group.size()
        use_cuda = torch.cuda.is_available() and not config.use_cpu_initialization
        # None on CPU: the default device, so a model built on the meta device (layer-wise verify)
        # gets a meta sink too
        device = torch.cuda.current_device() if use_cuda else None
        if softmax_type == "off-by-one":  # a fixed zero sink, a plain tensor as in megatron
            self.softmax_offset = torch.zeros(heads, device=device, dtype=config.params_dtype)
            return
        self.register_parameter(
            "softmax_offset", torch.nn.Parameter(torch.empty(heads, device=device, dtype=config.params_dtype))
        )
        if config.perform_initialization:
            self.softmax_offset = config.init_method(self.softmax_offset)
        # Split over TP by head: tells megatron's grad-norm and zero counting that every TP rank's
        # shard is distinct (megatron's own DotProductAttention leaves this unset).
        tensor_parallel.set_tensor_model_parallel_attributes(self.softmax_offset, True, 0, 1)

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None):
        """As megatron's DotProductAttention: `softmax_offset` sharded over TP along dim 0."""
        if getattr(self.config, "softmax_type", "vanilla") != "learnable":
            return super().sharded_state_dict(prefix, sharded_offsets, metadata)
        return make_sharded_tensors_for_checkpoint(
            self.state_dict(prefix="", keep_vars=True),
            prefix,
            {"softmax_offset": 0},
            sharded_offsets,
            tp_group=self.tp_group,
            dp_cp_group=(metadata or {}).get("dp_cp_group"),
        )

    def _sink(self, device):
        """The per-head sink logits for this forward (None: plain softmax)."""
        if self.softmax_offset is None or isinstance(self.softmax_offset, torch.nn.Parameter):
            return self.softmax_offset
        return self.softmax_offset.to(device)  # off-by-one's plain tensor does not follow .to()

    def forward(
        self,
        query,
        key,
        value,
        attention_mask,
        attn_mask_type=None,
        attention_bias=None,
        packed_seq_params: PackedSeqParams | None = None,
    ):
        if attention_bias is not None:
            raise ValueError("attention_bias is not supported by VarlenCoreAttention")
        if packed_seq_params is not None and packed_seq_params.qkv_format == "thd":
            cu = packed_seq_params.cu_seqlens_q_padded
            cu = packed_seq_params.cu_seqlens_q if cu is None else cu
            if self.cp_size > 1:  # cu_seqlens are global (padded for CP); q/k/v are this rank's rows
                plan = getattr(packed_seq_params, "cp_plan", None) or plan_cp_attention(
                    cu.tolist(), self.cp_size, dist.get_rank(self.cp_group)
                ).to(query.device)
                kernel = cp_kernel
                sink = self._sink(query.device)
                if sink is not None or self.window is not None:
                    kernel = functools.partial(cp_kernel, sink=sink, window=self.window)
                out = context_parallel_attention(query, key, value, plan, self.softmax_scale, self.cp_group, kernel)
                return out.reshape(out.shape[0], -1)
            max_len = int(packed_seq_params.max_seqlen_q)
            out = self._thd(query, key, value, cu, max_len)
            return out.reshape(out.shape[0], -1)
        if self.cp_size > 1:
            raise ValueError(
                "context parallel needs packed THD batches (packed_seq_params with "
                "qkv_format='thd'); the trainer always packs"
            )
        # [s, b, h, d]: each batch row is one document.
        s, b = query.shape[:2]
        to_thd = lambda x: x.transpose(0, 1).reshape(b * s, *x.shape[2:])
        cu = torch.arange(0, (b + 1) * s, s, dtype=torch.int32, device=query.device)
        out = self._thd(to_thd(query), to_thd(key), to_thd(value), cu, s)
        return out.reshape(b, s, -1).transpose(0, 1).contiguous()

    def _thd(self, q, k, v, cu_seqlens, max_seqlen):
        sink = self._sink(q.device)
        if _has_cuda_kernel(q):
            cu = cu_seqlens.to(torch.int32)
            return _varlen_cuda(q, k, v, cu, cu, max_seqlen, max_seqlen, self.softmax_scale, sink, self.window)
        if sink is not None or self.window is not None:
            return sink_attention_reference(q, k, v, cu_seqlens, cu_seqlens, self.softmax_scale, sink, self.window)
        return sdpa_varlen_reference(q, k, v, cu_seqlens, self.softmax_scale)
