"""Gated DeltaNet (Qwen3-Next, Qwen3.5 / 3.6 MoE linear-attention layers) for the torch-native
spec, over packed THD micro-batches.

megatron-core 0.16.1's `GatedDeltaNet` needs fla at construction, allocates on CUDA and refuses
`packed_seq_params`; this module keeps its parameter layout and dist-checkpoint keys (`in_proj`
= [q, k, v, z, b, a] each split over TP, `conv1d.weight` = [q, k, v], `dt_bias`, `A_log`,
`out_norm`, `out_proj`, so a checkpoint reshards across TP as megatron's does) and adds packing:
neither the causal convolution nor the recurrent state crosses a document boundary (cu_seqlens),
so a packed micro-batch gives each document's result alone, as transformers computes it.

Computation (transformers' `Qwen3NextGatedDeltaNet`): in_proj → depthwise causal conv1d (kernel
`linear_conv_kernel_dim`, SiLU) over q, k, v → L2-normed q, k (value heads > key heads: each q/k
head serves value_heads / key_heads consecutive value heads) → the gated delta rule with
g = -exp(A_log) * softplus(a + dt_bias), beta = sigmoid(b) → RMSNorm(out) * weight * silu(z) →
out_proj. Kernels: on CUDA fla's varlen `chunk_gated_delta_rule` and `causal_conv1d` (per-document
state reset through cu_seqlens) when fla imports and its backward is right on the GPU
(`fla_trains`); else (CPU, no fla, or fla's Hopper/Triton refusal) the arithmetic of megatron's
torch `torch_chunk_gated_delta_rule` in fp32, every document's chunks in one batch
(`gated_delta_rule_per_document`), and a masked convolution: the reference.

Context parallel: an all-to-all over the CP group gives each CP rank every token of the
micro-batch, in document order, for 1/cp of the TP rank's heads (moe_sft/layers/context_parallel.py),
so the convolution and the delta rule run on whole documents as at cp=1; the way back returns the
heads to the ranks that hold the tokens (docs/layouts.md, "Gated DeltaNet under CP").
"""

from __future__ import annotations

import functools
import importlib.util
from typing import NamedTuple

import torch
import torch.distributed as dist
import torch.nn.functional as F
from megatron.core.ssm.gated_delta_net import _split_tensor_factory
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.utils import (
    ensure_metadata_has_dp_cp_group,
    make_sharded_tensors_for_checkpoint,
    sharded_state_dict_default,
)
from megatron.core.utils import divide

from moe_sft.layers.context_parallel import heads_to_sequences, plan_cp_attention, sequences_to_heads
from moe_sft.runtime.device import host_to_device
from moe_sft.runtime.logs import get_logger

try:  # the CUDA kernels (optional: pip install fla-core)
    from fla.modules.convolution import causal_conv1d as fla_causal_conv1d
    from fla.modules.norm.fused_norm_gate import rms_norm_gated as fla_rms_norm_gated
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule as fla_chunk_gated_delta_rule
    from fla.ops.utils.index import prepare_chunk_indices as fla_chunk_indices
except ImportError:  # CPU, or fla not installed: the torch reference runs
    fla_causal_conv1d = fla_chunk_gated_delta_rule = fla_rms_norm_gated = fla_chunk_indices = None

# fla's chunk length for both the delta rule and the convolution (their `chunk_size` defaults)
FLA_CHUNK = 64

log = get_logger(__name__)

# fla on CUDA when it imports; tests set it False to compare the kernels with the torch path.
USE_FLA = True


def fla_available() -> bool:
    return fla_chunk_gated_delta_rule is not None


@functools.cache
def fla_trains() -> bool:
    """fla's backward is right on this GPU. fla refuses its gated backward on Hopper with the Triton
    versions its issue #640 names (wrong results) unless tilelang is installed; its own flags are
    read here, so where it would refuse, the torch path runs (logged once; docs/families.md)."""
    if not fla_available():
        return False
    from fla.utils import IS_NVIDIA_HOPPER, TRITON_ABOVE_3_4_0, TRITON_ABOVE_3_7_1

    if IS_NVIDIA_HOPPER and TRITON_ABOVE_3_4_0 and not TRITON_ABOVE_3_7_1 and not importlib.util.find_spec("tilelang"):
        log.info(
            "Gated DeltaNet: the torch path, not fla's kernels: fla refuses its backward on Hopper with this "
            "Triton (< 3.7.1, fla issue #640); install tilelang or a Triton >= 3.7.1 for the fast path"
        )
        return False
    return True


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(sum(x^2) + eps) over the last dim in fp32 (transformers' and fla's l2norm)."""
    xf = x.float()
    return xf * torch.rsqrt((xf * xf).sum(-1, keepdim=True) + eps)


def causal_conv_per_document(x: torch.Tensor, weight: torch.Tensor, cu_seqlens: torch.Tensor | None) -> torch.Tensor:
    """Depthwise causal convolution + SiLU of x [T, C] with weight [C, K]; a token sees only the
    earlier tokens of its own document (cu_seqlens: document starts, int32 [n + 1])."""
    tokens, kernel = x.shape[0], weight.shape[-1]
    if cu_seqlens is None:
        starts = torch.zeros(tokens, dtype=torch.long, device=x.device)
    else:
        lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).long()
        starts = torch.repeat_interleave(cu_seqlens[:-1].long(), lengths, output_size=tokens)
    position = torch.arange(tokens, device=x.device)
    padded = F.pad(x, (0, 0, kernel - 1, 0))
    out = torch.zeros_like(x, dtype=torch.promote_types(x.dtype, weight.dtype))
    for shift in range(kernel):  # tap `shift` reads the token `shift` steps back
        same_document = (position - shift >= starts).unsqueeze(-1)
        tap = padded[kernel - 1 - shift : kernel - 1 - shift + tokens]
        out = out + torch.where(same_document, tap, torch.zeros_like(tap)) * weight[:, kernel - 1 - shift]
    return F.silu(out).to(x.dtype)


def gated_delta_rule_per_document(q, k, v, g, beta, cu_seqlens: torch.Tensor | None, chunk: int = FLA_CHUNK):
    """The chunked gated delta rule over each document alone, in fp32: q, k [T, H, Dk] (already
    L2-normed, one per value head), v [T, H, Dv], g, beta [T, H]; returns [T, H, Dv] in v's dtype.

    megatron's `torch_chunk_gated_delta_rule` (transformers' torch path) on each document, with
    every document's chunks in one batch: each document is zero-padded to whole chunks as that
    function pads a sequence, the intra-chunk part runs over all chunks at once, and the
    recurrence steps through chunk positions with the documents that still have a chunk there
    (longest first, so they are a prefix of the batch). The intra-chunk inverse, which megatron
    builds row by row in a 63-step loop, is one unit-triangular solve. Equal to megatron's function
    per document within fp32 rounding, forward and backward (tests/cpu/test_gated_delta_net.py)."""
    tokens, heads, dk = q.shape
    bounds = [0, tokens] if cu_seqlens is None else cu_seqlens.tolist()
    docs = [(lo, hi) for lo, hi in zip(bounds[:-1], bounds[1:]) if hi > lo]
    n_chunks = [-(-(hi - lo) // chunk) for lo, hi in docs]
    first_chunk = [sum(n_chunks[:d]) for d in range(len(docs))]
    # each token's row in the padded layout (document d starts at chunk first_chunk[d])
    rows = torch.cat([torch.arange(hi - lo) + first_chunk[d] * chunk for d, (lo, hi) in enumerate(docs)])
    rows = rows.to(q.device)
    padded_len = sum(n_chunks) * chunk

    def chunked(x):  # [T, H, ...] -> [C, H, chunk, ...] in fp32, zeros past each document's end
        x = x.float()
        flat = x.new_zeros(padded_len, *x.shape[1:]).index_copy(0, rows, x)
        return flat.reshape(-1, chunk, *x.shape[1:]).transpose(1, 2)

    query, key, value, beta, g = (chunked(x) for x in (q, k, v, beta, g))
    query = query * (1 / dk**0.5)
    v_beta = value * beta.unsqueeze(-1)
    k_beta = key * beta.unsqueeze(-1)
    g = g.cumsum(dim=-1)
    decay_mask = ((g.unsqueeze(-1) - g.unsqueeze(-2)).tril().exp().float()).tril()
    upper = torch.triu(torch.ones(chunk, chunk, dtype=torch.bool, device=q.device), diagonal=0)
    lower = ((k_beta @ key.transpose(-1, -2)) * decay_mask).masked_fill(upper, 0)
    # megatron's row-by-row loop computes (I + lower)^-1 (its `attn`); one unit-triangular solve
    # gives (I + lower)^-1 [v_beta, k_beta e^g] within fp32 rounding, forward and backward
    eye = torch.eye(chunk, dtype=lower.dtype, device=lower.device)
    right = torch.cat([v_beta, k_beta * g.exp().unsqueeze(-1)], dim=-1)
    solved = torch.linalg.solve_triangular(lower + eye, right, upper=False, unitriangular=True)
    value, k_cumdecay = solved.split([v_beta.shape[-1], k_beta.shape[-1]], dim=-1)

    strict = torch.triu(torch.ones(chunk, chunk, dtype=torch.bool, device=q.device), diagonal=1)
    longest_first = sorted(range(len(docs)), key=lambda d: -n_chunks[d])
    starts = torch.tensor([first_chunk[d] for d in longest_first], device=q.device)
    state = query.new_zeros(len(docs), heads, dk, value.shape[-1])
    outs, order = [], []
    for i in range(max(n_chunks)):
        live = sum(1 for d in longest_first if n_chunks[d] > i)
        idx = starts[:live] + i
        q_i, k_i, v_i, g_i = query[idx], key[idx], value[idx], g[idx]
        attn_i = (q_i @ k_i.transpose(-1, -2) * decay_mask[idx]).masked_fill_(strict, 0)
        state = state[:live]
        v_new = v_i - k_cumdecay[idx] @ state
        outs.append((q_i * g_i[..., None].exp()) @ state + attn_i @ v_new)
        order.append(idx)
        state = (
            state * g_i[:, :, -1, None, None].exp()
            + (k_i * (g_i[:, :, -1, None] - g_i).exp()[..., None]).transpose(-1, -2) @ v_new
        )
    chunks_out = torch.cat(outs)[torch.argsort(torch.cat(order))]  # back to chunk order
    out = chunks_out.transpose(1, 2).reshape(padded_len, heads, -1)
    return out[rows].to(v.dtype)


class GatedDeltaNet(MegatronModule):
    """A decoder layer's mixer in place of self-attention: [s, b, h] in, ([s, b, h], None) out."""

    def __init__(self, config, submodules=None, layer_number: int = 1, pg_collection=None, **kwargs):
        super().__init__(config)
        self.config, self.layer_number = config, layer_number
        from megatron.core import parallel_state

        self.tp_size = parallel_state.get_tensor_model_parallel_world_size()
        self.key_head_dim, self.value_head_dim = config.linear_key_head_dim, config.linear_value_head_dim
        self.num_key_heads, self.num_value_heads = config.linear_num_key_heads, config.linear_num_value_heads
        self.qk_dim = self.key_head_dim * self.num_key_heads
        self.v_dim = self.value_head_dim * self.num_value_heads
        self.in_proj_dim = 2 * self.qk_dim + 2 * self.v_dim + 2 * self.num_value_heads
        self.local_key_heads = divide(self.num_key_heads, self.tp_size)
        self.local_value_heads = divide(self.num_value_heads, self.tp_size)
        self.cp_size = config.context_parallel_size
        self.cp_group = getattr(pg_collection, "cp", None)
        if self.cp_size > 1 and self.cp_group is None:
            self.cp_group = parallel_state.get_context_parallel_group()
        if self.local_key_heads % self.cp_size:  # validate_against_model names the fields first
            raise ValueError(
                f"context_parallel_size={self.cp_size} must divide the {self.local_key_heads} Gated DeltaNet "
                "key heads of a TP rank (linear_num_key_heads / tensor_model_parallel_size)"
            )
        self.in_proj = ColumnParallelLinear(
            config.hidden_size,
            self.in_proj_dim,
            config=config,
            init_method=config.init_method,
            gather_output=False,
            bias=False,
            skip_bias_add=False,
            is_expert=False,
        )
        self.conv_dim = 2 * self.qk_dim + self.v_dim
        local_conv = self.conv_dim // self.tp_size
        device = _param_device(config)
        kernel = config.linear_conv_kernel_dim
        self.conv1d = torch.nn.Conv1d(
            local_conv, local_conv, kernel, groups=local_conv, bias=False, device=device, dtype=config.params_dtype
        )
        self.dt_bias = torch.nn.Parameter(torch.ones(self.local_value_heads, device=device, dtype=config.params_dtype))
        a_init = torch.empty(self.local_value_heads, device=device, dtype=torch.float32).uniform_(1, 16)
        self.A_log = torch.nn.Parameter(torch.log(a_init).to(config.params_dtype))
        for param in (self.conv1d.weight, self.dt_bias, self.A_log):
            param.tensor_model_parallel, param.partition_dim, param.partition_stride = True, 0, 1
        self.out_norm = GatedRMSNorm(config, self.value_head_dim, config.layernorm_epsilon)
        self.out_proj = RowParallelLinear(
            self.v_dim,
            config.hidden_size,
            config=config,
            init_method=config.output_layer_init_method,
            bias=False,
            input_is_parallel=True,
            skip_bias_add=True,
            is_expert=False,
        )

    def forward(self, hidden_states, attention_mask=None, packed_seq_params=None, **kwargs):
        mixed, _ = self.in_proj(hidden_states)  # [s, b, local]; s: the full sequence under SP
        seq, batch = mixed.shape[:2]
        tp, cp = self.tp_size, self.cp_size
        sizes = [self.qk_dim // tp, self.qk_dim // tp, self.v_dim // tp, self.v_dim // tp]
        sizes += [self.local_value_heads, self.local_value_heads]
        # THD: one row of packed documents; BSHD: each batch row is a document
        tokens = mixed.transpose(0, 1).reshape(batch * seq, -1)
        q, k, v, z, b, a = torch.split(tokens, sizes, dim=-1)
        if cp == 1:
            out = self._mix(q, k, v, b, a, _documents(packed_seq_params, batch, seq, tokens), 0, 1)
        else:
            out = self._mix_context_parallel(q, k, v, b, a, packed_seq_params)
        out = self.out_norm(out, z.reshape(-1, self.local_value_heads, self.value_head_dim))
        out = out.reshape(batch, seq, -1).transpose(0, 1).contiguous()
        return self.out_proj(out)

    def _mix_context_parallel(self, q, k, v, b, a, packed_seq_params):
        """The mixer under CP (docs/layouts.md, "Gated DeltaNet under CP"): an all-to-all gives this rank
        every token of the micro-batch for 1/cp of its heads, in document order; the gated norm
        (per head, elementwise in z) runs after the way back, so z is never sent."""
        if packed_seq_params is None or packed_seq_params.qkv_format != "thd":
            raise ValueError("context parallel needs packed THD batches (packed_seq_params with qkv_format='thd')")
        cp, local = self.cp_size, q.shape[0]
        cu = packed_seq_params.cu_seqlens_q_padded  # global and padded for CP (cp_sharding.py)
        cu = packed_seq_params.cu_seqlens_q if cu is None else cu
        host = getattr(packed_seq_params, "cu_seqlens_host", None)
        host = _extend_to((cu.cpu() if host is None else host).to(torch.int32), cp * local)
        cu_seqlens = host_to_device(host, q.device)
        plan = getattr(packed_seq_params, "cp_plan", None) or plan_cp_attention(
            host.tolist(), cp, dist.get_rank(self.cp_group)
        ).to(q.device)
        # head group j of every part goes to CP rank j: q/k split by key heads, v/b/a by the value
        # heads those key heads serve (consecutive), so rank j's q/k heads match its v heads
        parts = [t.reshape(local, cp, -1) for t in (q, k, v, b, a)]
        widths = [p.shape[-1] for p in parts]
        mine = heads_to_sequences(torch.cat(parts, dim=-1), plan, self.cp_group)
        documents = Documents(cu_seqlens, host, _chunk_indices(host, q))
        out = self._mix(*torch.split(mine, widths, dim=-1), documents, dist.get_rank(self.cp_group), cp)
        back = sequences_to_heads(out.reshape(out.shape[0], -1), plan, self.cp_group)  # [local, cp, w]
        return back.reshape(local, self.local_value_heads, self.value_head_dim)

    def _mix(self, q, k, v, b, a, documents: Documents, group: int, groups: int):
        """Convolution, delta rule: [T, H/groups, Dv] for head group `group` of `groups` (the
        rows hold that group's channels only; the per-channel weights are sliced to match)."""
        key_heads, heads = self.local_key_heads // groups, self.local_value_heads // groups
        qk, vw = key_heads * self.key_head_dim, heads * self.value_head_dim
        weight = self.conv1d.weight.squeeze(1)
        if groups > 1:  # this group's channels of each conv part (q, k, v)
            qk_local = self.qk_dim // self.tp_size
            weight = torch.cat(
                [
                    weight[group * qk : (group + 1) * qk],
                    weight[qk_local + group * qk : qk_local + (group + 1) * qk],
                    weight[2 * qk_local + group * vw : 2 * qk_local + (group + 1) * vw],
                ]
            )
        qkv = self._conv(torch.cat([q, k, v], dim=-1), weight, documents)
        q, k, v = torch.split(qkv, [qk, qk, vw], dim=-1)
        q = q.reshape(-1, key_heads, self.key_head_dim)
        k = k.reshape(-1, key_heads, self.key_head_dim)
        v = v.reshape(-1, heads, self.value_head_dim)
        mine = slice(group * heads, (group + 1) * heads)
        return self._delta_rule(q, k, v, a, b, self.A_log[mine], self.dt_bias[mine], documents)  # [T, H/groups, Dv]

    def _conv(self, x, weight, documents: Documents):
        if _use_fla(x):
            out = fla_causal_conv1d(
                x[None],
                weight=weight,
                activation="silu",
                cu_seqlens=documents.cu,
                cu_seqlens_cpu=documents.host,
                chunk_indices=documents.chunks,
            )
            return out[0][0]
        return causal_conv_per_document(x, weight, documents.cu)

    def _delta_rule(self, q, k, v, a, b, A_log, dt_bias, documents: Documents):  # noqa: N803 (megatron's names)
        """q, k [T, Hk, Dk] before their L2 norm, v [T, Hv, Dv], a and b [T, Hv] raw; A_log and
        dt_bias [Hv] of these heads."""
        if _use_fla(v):
            # fla fuses what the torch path spells out: the q/k L2 norm, each q/k head serving
            # Hv / Hk value heads (its GVA), the decay from A_log and dt_bias, and beta's sigmoid
            out, _ = fla_chunk_gated_delta_rule(
                q[None],
                k[None],
                v[None],
                g=a[None],
                beta=b[None],
                use_qk_l2norm_in_kernel=True,
                use_gate_in_kernel=True,
                A_log=A_log,
                dt_bias=dt_bias,
                use_beta_sigmoid_in_kernel=True,
                cu_seqlens=documents.cu,
                cu_seqlens_cpu=documents.host,
                chunk_indices=documents.chunks,
            )
            return out[0]
        ratio = self.num_value_heads // self.num_key_heads
        q = l2norm(q).repeat_interleave(ratio, dim=1)
        k = l2norm(k).repeat_interleave(ratio, dim=1)
        g = -A_log.float().exp() * F.softplus(a.float() + dt_bias.float())
        return gated_delta_rule_per_document(q, k, v, g, b.float().sigmoid(), documents.cu)

    def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
        """megatron's GatedDeltaNet keys: in_proj and conv1d split into their parts, each over TP."""
        from megatron.core import parallel_state

        metadata = ensure_metadata_has_dp_cp_group(metadata)
        groups = dict(tp_group=parallel_state.get_tensor_model_parallel_group(), dp_cp_group=metadata["dp_cp_group"])
        out = {}
        self._save_to_state_dict(out, "", keep_vars=True)
        out = make_sharded_tensors_for_checkpoint(out, prefix, {"A_log": 0, "dt_bias": 0}, sharded_offsets, **groups)
        for name, module in self.named_children():
            if name == "conv1d":
                module_sd = module.state_dict(prefix="", keep_vars=True)
                part = make_sharded_tensors_for_checkpoint(
                    module_sd, f"{prefix}{name}.", {"weight": 0}, sharded_offsets, **groups
                )
            else:  # in_proj / out_proj (TP-sharded linears), out_norm (replicated: one head's width)
                part = sharded_state_dict_default(
                    module, f"{prefix}{name}.", sharded_offsets, metadata, tp_group=groups["tp_group"]
                )
            out.update(part)
        tp = self.tp_size
        qk, v, heads = self.qk_dim // tp, self.v_dim // tp, self.local_value_heads
        out[f"{prefix}in_proj.weight"] = _split_tensor_factory(
            out[f"{prefix}in_proj.weight"],
            [qk, qk, v, v, heads, heads],
            ["query", "key", "value", "z", "beta", "alpha"],
            0,
        )
        out[f"{prefix}conv1d.weight"] = _split_tensor_factory(
            out[f"{prefix}conv1d.weight"], [qk, qk, v], ["query", "key", "value"], 0
        )
        return out


class GatedRMSNorm(torch.nn.Module):
    """RMSNorm(x) * weight * silu(gate) per value head (transformers' `Qwen3NextRMSNormGated`: the
    normalised x rounded to x's dtype, times the weight, times silu(gate) in fp32).

    One weight serves every head, and TP ranks hold different heads: the weight enters through
    megatron's copy-to-TP-region (identity forward, all-reduce of its gradient backward), so each
    rank's gradient is the sum over all heads, as at one rank."""

    def __init__(self, config, width: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.ones(width, device=_param_device(config), dtype=config.params_dtype))

    def forward(self, x, gate):
        from megatron.core import parallel_state
        from megatron.core.tensor_parallel import copy_to_tensor_model_parallel_region

        weight = self.weight
        if parallel_state.get_tensor_model_parallel_world_size() > 1:
            weight = copy_to_tensor_model_parallel_region(weight)
        if _use_fla(x):  # one fused kernel each way; fp32 inside, rounded once
            return fla_rms_norm_gated(x, gate, weight, None, activation="swish", eps=self.eps)
        dtype = gate.dtype
        xf = x.float()
        normed = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(dtype)
        return (weight * normed * F.silu(gate.float())).to(dtype)


def _param_device(config):
    """Where parameters are made: None (the default device, meta inside meta_model) with CPU
    initialisation, else the current CUDA device (as megatron's modules)."""
    return None if config.use_cpu_initialization else torch.cuda.current_device()


def _use_fla(t: torch.Tensor) -> bool:
    """fla for bf16 / fp16 activations on CUDA. fp32 runs the torch path, the reference: fla's fp32
    kernels take TF32 dot products, and its fp32 backward of the decay (A_log, dt_bias) was off by
    two orders of magnitude on an H200 with Triton 3.7.1 while bf16 matched (docs/log.md)."""
    return USE_FLA and t.is_cuda and t.dtype != torch.float32 and fla_trains()


class Documents(NamedTuple):
    """A micro-batch's document boundaries (int32 cu_seqlens; None: one document) on the device and
    the same on the host, and fla's chunk indices for them on the device (None off fla's path): made
    on the host and copied without waiting, so fla neither reads the bounds back nor copies its
    indices from pageable memory, each of which would stall the host until the GPU caught up."""

    cu: torch.Tensor | None
    host: torch.Tensor | None
    chunks: torch.Tensor | None = None


def _documents(packed_seq_params, batch: int, seq: int, like: torch.Tensor) -> Documents:
    """Made once per micro-batch and kept on its PackedSeqParams: every GDN layer of the forward and
    the backward shares them. The host bounds come with the params from the trainer
    (`cu_seqlens_host`); only params built without them cost a device sync here
    (docs/benchmarks.md, "Hybrid Gated DeltaNet")."""
    device = like.device
    if packed_seq_params is None:
        if batch == 1:
            return Documents(None, None)
        host = torch.arange(0, (batch + 1) * seq, seq, dtype=torch.int32)
        return Documents(host_to_device(host, device), host, _chunk_indices(host, like))
    cached = getattr(packed_seq_params, "_gdn_documents", None)
    if cached is not None and cached.cu.device == device:
        return cached
    cu = packed_seq_params.cu_seqlens_q.to(device=device, dtype=torch.int32)
    host = getattr(packed_seq_params, "cu_seqlens_host", None)
    host = cu.cpu() if host is None else host.to(torch.int32)
    if int(host[-1]) < batch * seq:
        host = _extend_to(host, batch * seq)
        cu = host_to_device(host, device)
    documents = Documents(cu, host, _chunk_indices(host, like))
    packed_seq_params._gdn_documents = documents
    return documents


def _chunk_indices(host: torch.Tensor, like: torch.Tensor) -> torch.Tensor | None:
    """fla's (document, chunk) index pairs for `host` bounds, on `like`'s device, where fla runs."""
    if not _use_fla(like):
        return None
    return host_to_device(fla_chunk_indices(host, FLA_CHUNK), like.device)


def _extend_to(cu: torch.Tensor, total: int) -> torch.Tensor:
    """cu_seqlens ending at `total`: a fixed-shape micro-batch's padding after the last document
    is a segment of its own."""
    return cu if int(cu[-1]) >= total else torch.cat([cu, cu.new_tensor([total])])
