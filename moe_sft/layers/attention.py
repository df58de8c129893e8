"""Core attention for the torch-native layer spec: packed (THD) sequences, causal, GQA.

megatron-core's local `DotProductAttention` rejects `packed_seq_params` and allocates on CUDA,
so the torch-native spec uses this module instead. Kernels, best first:

* flash-attn-4's `flash_attn.cute.flash_attn_varlen_func` (CuTe DSL; SM90 and SM100) when it
  imports and supports the call (`_fa4_refusal`): faster than torch's varlen kernel, errors vs
  fp32 no larger (docs/log.md, docs/benchmarks.md). Not for MLA's unequal head dims under "auto":
  slower there;
* flash-attn's `flash_attn_varlen_func` when the package imports (GPU);
* torch's flash varlen kernel on CUDA: the aten op `torch.nn.attention.varlen.varlen_attn`
  runs, called directly (`_FlashVarlen`);
* a per-document `scaled_dot_product_attention` loop that honours cu_seqlens (CPU, and any
  head dim the kernels refuse) — the reference the fast paths are tested against.

`model.attention_kernel` (`set_attention_kernel`) picks among the CUDA kernels: "auto" (the list
above), "torch" (torch's kernel only), "fa4" (flash-attn-4 required: an error where it cannot run).

Inputs follow megatron's SelfAttention: THD `[t, heads, dim]` when packed, else `[s, b, heads, dim]`.
With context_parallel_size > 1 (THD only) the same kernels run over all-gathered K/V:
moe_sft/layers/context_parallel.py. Learnable / off-by-one softmax sinks (megatron's
`softmax_type`) and causal sliding windows (`window_size`, `window_attn_skip_freq`):
moe_sft/layers/attention_sinks.py.
"""

from __future__ import annotations

import contextlib
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
from torch.nn.attention import SDPBackend, sdpa_kernel

from moe_sft.layers.attention_sinks import (
    FLASH_KERNELS,
    SinkFlashVarlen,
    layer_window,
    sink_attention_reference,
)
from moe_sft.layers.context_parallel import context_parallel_attention, plan_cp_attention, sdpa_bottom_right
from moe_sft.runtime.logs import get_logger

log = get_logger(__name__)

try:  # flash-attn is optional: the field's standard kernel when installed.
    from flash_attn import flash_attn_varlen_func
except ImportError:  # pragma: no cover - depends on the machine
    flash_attn_varlen_func = None

# flash-attn-4 ships `flash_attn/cute/` without a `flash_attn/__init__.py`: installed alone it makes
# `flash_attn` a namespace package, where the import above fails as it should. Its import loads the
# CuTe DSL's native libraries, which fail with OSError / RuntimeError too, not only ImportError.
try:
    from flash_attn.cute import flash_attn_varlen_func as fa4_varlen_func

    _FA4_IMPORT_ERROR = ""
except Exception as exc:  # pragma: no cover - depends on the machine
    fa4_varlen_func, _FA4_IMPORT_ERROR = None, f"{type(exc).__name__}: {exc}"

try:
    from torch.nn.attention.varlen import varlen_attn

    _VARLEN_PARAMS = set(inspect.signature(varlen_attn).parameters)
except ImportError:  # pragma: no cover - torch < 2.10
    varlen_attn, _VARLEN_PARAMS = None, set()


class _FlashVarlen(torch.autograd.Function):
    """Causal varlen attention through torch's flash kernels (aten `_flash_attention_forward` /
    `_flash_attention_backward`) with the arguments `varlen_attn` gives them, without its
    torch.library custom op around them (dispatch, fake-tensor and autograd wrappers, three fills).
    The step is host-bound (docs/benchmarks.md): this way a forward + backward takes a third of
    varlen_attn's host time for the same GPU time (docs/log.md). Same kernels: the output, dk and dv bits match varlen_attn's; dq is summed with fp32
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


# ---------------------------------------------------------------- kernel choice (model.attention_kernel)
ATTENTION_KERNELS = ("auto", "torch", "fa4")
_choice = "auto"
_FA4_INSTALL = (
    "install it with its CuTe DSL: pip install 'flash-attn-4[cu13]==4.0.0b36' (benchmarks/gpu/fa4_wheels.sh and "
    "fa4_stage.sh for a machine without an index), or set model.attention_kernel=auto"
)


def set_attention_kernel(name: str) -> None:
    """`model.attention_kernel`: "auto" (default): flash-attn-4 for the calls it supports on an SM90 /
    SM100 GPU, else flash-attn, else torch's kernel; "torch": torch's flash varlen kernel only, no
    optional package; "fa4": flash-attn-4 required, an error here when it does not import or the GPU
    is not SM90 / SM100, and at a call it cannot run (rather than a quiet fallback)."""
    global _choice
    if name not in ATTENTION_KERNELS:
        raise ValueError(f"model.attention_kernel={name!r}: expected one of {', '.join(ATTENTION_KERNELS)}")
    if name == "fa4":
        if fa4_varlen_func is None:
            raise RuntimeError(
                f"model.attention_kernel=fa4 but flash-attn-4 does not import ({_FA4_IMPORT_ERROR}); {_FA4_INSTALL}"
            )
        cap = _cuda_capability(torch.device("cuda", torch.cuda.current_device())) if torch.cuda.is_available() else None
        if cap is None or cap[0] not in (9, 10):
            found = "no CUDA device" if cap is None else f"compute capability {cap[0]}.{cap[1]}"
            raise RuntimeError(
                f"model.attention_kernel=fa4 needs an SM90 (Hopper) or SM100 (Blackwell) GPU, found {found}; "
                "set model.attention_kernel=auto"
            )
    _choice = name


def _cuda_capability(device: torch.device) -> tuple[int, int] | None:
    """(major, minor) of a CUDA device, None for any other device: the one place the kernel choice
    reads the hardware (the CPU tests patch it)."""
    if device.type != "cuda":
        return None
    return _capability_of(device.index if device.index is not None else torch.cuda.current_device())


@functools.cache
def _capability_of(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)  # cached: asked on every attention call


def _fa4_refusal(q, k, v, sink) -> str | None:
    """Why flash-attn-4 cannot run this call, None when it can. From flash_attn/cute (4.0.0b36):
    interface.py `_validate_head_dims` (dims multiples of 16 bytes; SM90 any in [8, 256];
    SM100 both <= 128, DeepSeek's (192, 128), or (256, 256)); flash_bwd_sm90.py "GQA backward
    requires head_dim == head_dim_v" (kept on SM100 too, untested there; MLA has as many k/v heads
    as q heads); interface.py's SM100 (256, 256) backward "does not support learnable_sink"."""
    if fa4_varlen_func is None:
        return f"flash-attn-4 does not import ({_FA4_IMPORT_ERROR})"
    cap = _cuda_capability(q.device)
    if cap is None or cap[0] not in (9, 10):
        return "it runs on SM90 / SM100 GPUs only, not on " + (str(q.device) if cap is None else f"SM{cap[0]}{cap[1]}")
    if q.dtype not in (torch.float16, torch.bfloat16):
        return f"it takes fp16 / bf16, not {q.dtype}"
    d, dv = q.shape[-1], v.shape[-1]
    if d % 8 or dv % 8:
        return f"head dims ({d}, {dv}) are not multiples of 8"
    if d != dv and q.shape[1] != k.shape[1]:
        return f"its backward needs equal q/k and v head dims under GQA, not ({d}, {dv})"
    if cap[0] == 9:
        return None if 8 <= d <= 256 and 8 <= dv <= 256 else f"SM90 takes head dims in [8, 256], not ({d}, {dv})"
    if (d, dv) == (256, 256):
        return None if sink is None else "its SM100 backward for head dim 256 takes no sink"
    if not ((d <= 128 and dv <= 128) or (d, dv) == (192, 128)):
        return f"SM100 takes head dims <= 128, (192, 128) or (256, 256), not ({d}, {dv})"
    return None


@functools.cache
def _log_fa4_fallback(reason: str) -> None:  # once per reason: the call runs every layer and step
    log.info(f"attention: flash-attn-4 cannot run a call ({reason}); flash-attn or torch's kernel runs it")


def _use_fa4(q, k, v, sink) -> bool:
    if _choice == "torch" or (_choice == "auto" and fa4_varlen_func is None):
        return False
    reason = _fa4_refusal(q, k, v, sink)
    if reason is None and _choice == "auto" and q.shape[-1] != v.shape[-1]:
        # MLA's (192, 128) heads: FA4 ran them slower than torch's kernel with v zero-padded (docs/log.md)
        reason = "auto keeps unequal q/k and v head dims (MLA) on the faster torch kernel"
    if reason is None:
        return True
    if _choice == "fa4":
        raise ValueError(f"model.attention_kernel=fa4: flash-attn-4 cannot run this attention call: {reason}")
    _log_fa4_fallback(reason)
    return False


def _use_flash_attn2() -> bool:
    return flash_attn_varlen_func is not None and _choice != "torch"


def attention_kernel_name(device_type: str) -> str:
    """Which kernel `VarlenCoreAttention` uses on this device (printed at startup)."""
    fallback = "per-document scaled_dot_product_attention (reference path)"
    if device_type == "cuda" and _use_flash_attn2():
        fallback = "flash_attn.flash_attn_varlen_func"
    elif device_type == "cuda" and varlen_attn is not None:
        fallback = "torch's flash varlen kernel (the one torch.nn.attention.varlen.varlen_attn runs), called directly"
    fa4 = "flash-attn-4 (flash_attn.cute.flash_attn_varlen_func)"
    if device_type == "cuda" and _choice == "fa4":
        return f"{fa4} for every call (model.attention_kernel=fa4)"
    if device_type == "cuda" and _choice == "auto" and fa4_varlen_func is not None:
        if _cuda_capability(torch.device("cuda", torch.cuda.current_device()))[0] in (9, 10):
            return f"{fa4} for the calls it supports, else {fallback}"
    return fallback


def sdpa_varlen_reference(q, k, v, cu_seqlens, scale, causal=True):
    """Attention over each document [cu[i], cu[i+1]) alone; q/k/v are [t, heads, dim]; rows outside
    every document are zero.

    The documents are split and their outputs concatenated (one gradient concatenation in the
    backward, where writing each into a slice of the output zero-filled a whole-batch gradient
    per document), and SDPA gets 4-D inputs: its fused CUDA kernels (the memory-efficient one takes
    Gemma 4's 512-wide heads) take no other, and 3-D ones ran the math backend. On CPU the math
    backend stays, the reference's softmax (and FLOP count) as transformers' eager attention has
    them: on a collapsed model the CPU flash kernel gave NaN where the math backend stays finite."""
    groups = q.shape[1] // k.shape[1]
    bounds = cu_seqlens.tolist()
    lengths = [end - start for start, end in zip(bounds[:-1], bounds[1:])]
    whole = slice(bounds[0], bounds[-1])
    pieces = zip(
        *(x[whole].split(lengths) for x in (q, k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)))
    )
    outs = []
    for qd, kd, vd in pieces:
        if qd.shape[0] == 0:
            outs.append(q.new_zeros(0, q.shape[1], v.shape[-1]))
            continue
        qd, kd, vd = (x.transpose(0, 1)[None] for x in (qd, kd, vd))  # [1, heads, s, dim]
        with contextlib.nullcontext() if q.is_cuda else sdpa_kernel([SDPBackend.MATH]):
            outs.append(F.scaled_dot_product_attention(qd, kd, vd, is_causal=causal, scale=scale)[0].transpose(0, 1))
    out = torch.cat(outs)
    if bounds[0] > 0 or bounds[-1] < q.shape[0]:
        out = F.pad(out, (0, 0, 0, 0, bounds[0], q.shape[0] - bounds[-1]))
    return out


def _varlen_cuda(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale, sink=None, window=None):
    """Causal varlen attention through the chosen CUDA kernel; with seqlen_q < seqlen_k (context
    parallel) the causal mask is bottom-right aligned in every kernel (flash-attn's and
    flash-attn-4's `causal=True`; window (-1, 0) of torch's)."""
    if _use_fa4(q, k, v, sink):
        return fa4_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale, sink, window)
    return _flash_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale, sink, window)


def fa4_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale, sink=None, window=None):
    """flash-attn-4's varlen attention (an autograd Function: its backward is FA4's too) with the
    semantics of `sink_attention_reference`, read from flash_attn/cute (4.0.0b36): the causal mask
    and the window are bottom-right aligned (mask.py: key j visible from query i of a segment of
    sq queries and sk keys iff i + sk - sq - left <= j <= i + sk - sq), and the sink is one logit
    per head in natural-log units, not multiplied by the softmax scale (softmax.py
    `apply_learnable_sink`). q/k and v head dims may differ (MLA): no padding of v."""
    out, _lse = fa4_varlen_func(
        q,
        k,
        v,
        cu_seqlens_q=cu_seqlens_q,
        cu_seqlens_k=cu_seqlens_k,
        max_seqlen_q=max_seqlen_q,
        max_seqlen_k=max_seqlen_k,
        softmax_scale=scale,
        causal=True,
        window_size=(None, None) if window is None else (window, 0),
        learnable_sink=sink,
    )
    return out


def _flash_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale, sink=None, window=None):
    """flash-attn's kernel or torch's. A sink or a window goes through torch's flash kernel with the
    sink folded in (`SinkFlashVarlen`)."""
    v_dim = v.shape[-1]
    if v_dim != q.shape[-1]:
        # MLA: v head dim (128) < q/k head dim (192), which these kernels refuse. Zero-padding
        # v gives softmax(qkᵀ)·[v, 0] = [out, 0]; the slice keeps exact values and gradients.
        v = F.pad(v, (0, q.shape[-1] - v_dim))
        out = _flash_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale, sink, window)
        return out[..., :v_dim]
    if sink is not None or window is not None:
        return SinkFlashVarlen.apply(
            q, k, v, sink, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale, window, FLASH_KERNELS
        )
    if _use_flash_attn2():
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


# flash-attn 2's and torch's flash kernels (and flash-attn-4 on SM90) take head dims up to 256
FLASH_MAX_HEAD_DIM = 256


def _has_cuda_kernel(q) -> bool:
    """The flash kernels take fp16/bf16 heads up to FLASH_MAX_HEAD_DIM wide: fp32 on CUDA (a
    reference run) and wider heads (Gemma 4's full layers: 512) take the SDPA path."""
    half = q.dtype in (torch.float16, torch.bfloat16)
    kernel = fa4_varlen_func is not None or flash_attn_varlen_func is not None or varlen_attn is not None
    narrow = q.shape[-1] <= FLASH_MAX_HEAD_DIM
    return half and kernel and narrow and _cuda_capability(q.device) is not None


def cp_kernel(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale, sink=None, window=None):
    """The context-parallel kernel: varlen (separate q/k cu_seqlens) on CUDA, else SDPA with a
    bottom-right causal mask. Sinks and windows are exact under CP: each query chunk attends to
    its whole key prefix (so the lse the sink is folded with spans all of the query's keys), and
    every kernel aligns the window bottom-right like the causal mask."""
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
