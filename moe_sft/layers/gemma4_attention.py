"""Gemma 4's self-attention (transformers 5.24 models/gemma4 `Gemma4TextAttention` followed by the
decoder layer's `post_attention_layernorm`), as megatron's SelfAttention on packed THD documents.

Per layer (megatron's 1-based `layer_number` indexes SFTTransformerConfig.gemma4_attention_layers,
which moe_sft/models/gemma4.py fills from the HF config):

* dims: sliding layers use `head_dim` and `num_key_value_heads`, full layers `global_head_dim`
  and `num_global_key_value_heads` (the latter only with `attention_k_eq_v`; transformers'
  `per_layer_config`). The module's config is the shared one with kv_channels and
  num_query_groups replaced, so linear_qkv, linear_proj and the core attention are sized per layer.
* k-eq-v (full layers with `attention_k_eq_v`): linear_qkv holds [queries, key] per group and the
  value is the projected key, taken before k_norm and RoPE (transformers reuses `k_proj`'s output).
* q_layernorm / k_layernorm: Gemma4RMSNorm per head (fp32 x̂ times fp32 weight, rounded once);
  the value gets the same norm without a weight; RoPE comes after the q/k norms.
* softmax scale 1.0 (transformers' `scaling`); no logit soft cap (Gemma 4's text attention has
  none: its config drops Gemma 2's `attn_logit_softcapping`).
* sliding window: transformers lets query i see key j when i - W < j <= i, megatron's
  `window_size=(W - 1, 0)` (the family sets it with `window_attn_skip_freq` marking the sliding
  layers; VarlenCoreAttention applies it, under context parallel too).
* RoPE per layer type, applied here (GPTModel builds none: theta and head dim differ per type):
  `default` over the whole head, or `proportional` (gemma4_math.proportional_inv_freq: the first
  partial_rotary_factor of the frequency pairs at θ^(-2j/D), zero for the rest, rotate_half over
  the whole head; not megatron's rotary_percent). Positions restart at every packed document:
  megatron's `apply_rotary_pos_emb` with cu_seqlens (per-rank halves under context parallel).
* `post_layernorm`: the HF layer's post_attention_layernorm on the attention output, before the
  residual add (megatron 0.16.1's TransformerLayer has no slot for it). Under sequence parallelism
  it sees this rank's tokens, so its weight is marked `sequence_parallel` (RMSNorm does).

Tensor parallelism splits heads by query group as megatron does; each layer's key/value heads must
be divisible by the TP size (megatron's all-gather path for fewer groups than ranks is not taken).
The spec (moe_sft/layers/spec.py) passes `gemma4_attention_spec()` as the layer's self_attention.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
from megatron.core.models.common.embeddings.rope_utils import apply_rotary_pos_emb
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.attention import Attention, SelfAttention, SelfAttentionSubmodules
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.spec_utils import ModuleSpec, build_module
from megatron.core.transformer.transformer_config import TransformerConfig

from moe_sft.layers import gemma4_math
from moe_sft.layers.attention import VarlenCoreAttention
from moe_sft.layers.config import Gemma4AttentionKind, gemma4_attention_kind
from moe_sft.layers.norm import Gemma4RMSNorm


@dataclass
class Gemma4AttentionSubmodules(SelfAttentionSubmodules):
    """SelfAttention's submodules and the norm on the attention's output (transformers'
    post_attention_layernorm), which megatron's TransformerLayer has no slot for."""

    post_layernorm: type | ModuleSpec | None = None


def gemma4_attention_spec() -> ModuleSpec:
    """The decoder layer's `self_attention` submodule for a config with gemma4_attention_layers."""
    return ModuleSpec(
        module=Gemma4SelfAttention,
        params={"attn_mask_type": AttnMaskType.causal},
        submodules=Gemma4AttentionSubmodules(
            linear_qkv=ColumnParallelLinear,
            core_attention=VarlenCoreAttention,
            linear_proj=RowParallelLinear,
            q_layernorm=Gemma4RMSNorm,
            k_layernorm=Gemma4RMSNorm,
            post_layernorm=Gemma4RMSNorm,
        ),
    )


def inv_freq(kind: Gemma4AttentionKind) -> torch.Tensor:
    """transformers' inverse frequencies of this layer's rope type, fp32, on the CPU also where the
    model is built under `torch.device("meta")` (conversion/meta_model.py)."""
    with torch.device("cpu"):
        if kind.rope_type == "proportional":
            return gemma4_math.proportional_inv_freq(
                kind.head_dim, kind.rope_theta, kind.partial_rotary_factor, kind.rope_factor
            )
        if kind.rope_type == "default":
            return gemma4_math.default_inv_freq(kind.head_dim, kind.rope_theta)
    raise ValueError(f"Gemma 4 attention: rope_type={kind.rope_type!r} (expected default or proportional)")


def layer_config(config: TransformerConfig, kind: Gemma4AttentionKind) -> TransformerConfig:
    """The shared config with this layer's head dim and key/value heads (a shallow copy only where
    they differ, so the sliding layers keep the shared object)."""
    if (config.kv_channels, config.num_query_groups) == (kind.head_dim, kind.num_query_groups):
        return config
    layer = copy.copy(config)
    layer.kv_channels, layer.num_query_groups = kind.head_dim, kind.num_query_groups
    return layer


class Gemma4SelfAttention(SelfAttention):
    """megatron's SelfAttention with Gemma 4's per-layer dims, k-eq-v, v norm, RoPE and output norm
    (module docstring). Checkpoint names: linear_qkv, q_layernorm, k_layernorm, linear_proj,
    post_layernorm (each `.weight`)."""

    def __init__(
        self,
        config: TransformerConfig,
        submodules: Gemma4AttentionSubmodules,
        layer_number: int,
        attn_mask_type: AttnMaskType = AttnMaskType.causal,
        cp_comm_type: str | None = None,
        pg_collection=None,
    ):
        kind = gemma4_attention_kind(config, layer_number)
        if kind is None:
            raise ValueError("Gemma4SelfAttention needs SFTTransformerConfig.gemma4_attention_layers")
        tp = config.tensor_model_parallel_size
        if kind.num_query_groups % tp:
            raise ValueError(
                f"Gemma 4 layer {layer_number - 1}: tensor_model_parallel_size={tp} does not divide its "
                f"{kind.num_query_groups} key/value heads (num_key_value_heads on sliding layers, "
                "num_global_key_value_heads on full ones); use a TP size that divides both"
            )
        # Attention.__init__, not SelfAttention's: that one sizes linear_qkv for [q, k, v] per group.
        Attention.__init__(
            self,
            config=layer_config(config, kind),
            submodules=submodules,
            layer_number=layer_number,
            attn_mask_type=attn_mask_type,
            attention_type="self",
            cp_comm_type=cp_comm_type,
            pg_collection=pg_collection,
        )
        self.kind = kind
        head_dim = self.hidden_size_per_attention_head
        self.linear_qkv_out_dim = self.query_projection_size + (1 if kind.k_eq_v else 2) * self.kv_projection_size
        self.linear_qkv = build_module(
            submodules.linear_qkv,
            self.config.hidden_size,
            self.linear_qkv_out_dim,
            config=self.config,
            init_method=self.config.init_method,
            gather_output=False,
            bias=False,
            skip_bias_add=False,
            is_expert=False,
            tp_comm_buffer_name="qkv",
            tp_group=self.pg_collection.tp,
        )
        eps = self.config.layernorm_epsilon
        self.q_layernorm = build_module(submodules.q_layernorm, hidden_size=head_dim, config=self.config, eps=eps)
        self.k_layernorm = build_module(submodules.k_layernorm, hidden_size=head_dim, config=self.config, eps=eps)
        self.post_layernorm = build_module(
            submodules.post_layernorm, hidden_size=self.config.hidden_size, config=self.config, eps=eps
        )
        # A plain CPU tensor, not a buffer: a model built on the meta device (conversion/verify.py)
        # gives its buffers empty storage, which would lose these values.
        self.inv_freq = inv_freq(kind)
        self._inv_freq_on_device: torch.Tensor | None = None

    def get_query_key_value_tensors(self, hidden_states, key_value_states=None, output_gate=False, split_qkv=True):
        """q [s, b, heads, d], k / v [s, b, groups, d] of this rank's heads: q and k normed (RoPE
        not applied yet), v normed without a weight; on a k-eq-v layer v is the projected k."""
        if key_value_states is not None or output_gate or not split_qkv:
            raise ValueError("Gemma4SelfAttention: self-attention without an output gate only")
        mixed, _ = self.linear_qkv(hidden_states)
        query, key, value = gemma4_math.split_qkv(
            mixed, self.num_query_groups_per_partition, self.hidden_size_per_attention_head, self.kind.k_eq_v
        )
        value = gemma4_math.rms_norm(value, self.config.layernorm_epsilon)
        return self.q_layernorm(query), self.k_layernorm(key), value

    def _rotary_freqs(self, length: int, device: torch.device) -> torch.Tensor:
        """Angles [length, 1, 1, D] for positions 0..length-1 in megatron's layout."""
        if self._inv_freq_on_device is None or self._inv_freq_on_device.device != device:
            self._inv_freq_on_device = self.inv_freq.to(device)
        positions = torch.arange(length, device=device)
        return gemma4_math.rotary_freqs(positions, self._inv_freq_on_device)

    def _rope(self, query, key, packed_seq_params: PackedSeqParams | None):
        """RoPE with positions from 0 in every document: THD by cu_seqlens (padded ones under
        context parallel), [s, b, ...] by row."""
        if packed_seq_params is None or packed_seq_params.qkv_format != "thd":
            freqs = self._rotary_freqs(query.shape[0], query.device)
            rope = lambda t: apply_rotary_pos_emb(t, freqs, self.config, cp_group=self.pg_collection.cp)  # noqa: E731
            return rope(query), rope(key)
        p = packed_seq_params
        cu_q = p.cu_seqlens_q if p.cu_seqlens_q_padded is None else p.cu_seqlens_q_padded
        cu_kv = p.cu_seqlens_kv if p.cu_seqlens_kv_padded is None else p.cu_seqlens_kv_padded
        freqs = self._rotary_freqs(max(int(p.max_seqlen_q), int(p.max_seqlen_kv)), query.device)
        cp = self.pg_collection.cp
        query = apply_rotary_pos_emb(query, freqs, self.config, cu_seqlens=cu_q, cp_group=cp)
        return query, apply_rotary_pos_emb(key, freqs, self.config, cu_seqlens=cu_kv, cp_group=cp)

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None,
        key_value_states=None,
        inference_context=None,
        rotary_pos_emb=None,
        rotary_pos_cos=None,
        rotary_pos_sin=None,
        rotary_pos_cos_sin=None,
        attention_bias=None,
        packed_seq_params: PackedSeqParams | None = None,
        sequence_len_offset=None,
        *,
        inference_params=None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """hidden [s, b, h] (THD: [t, 1, h]) → (post-normed attention output [s, b, h], None)."""
        if inference_context is not None or inference_params is not None:
            raise ValueError("Gemma4SelfAttention: inference (KV cache) is not supported")
        if rotary_pos_emb is not None or rotary_pos_cos is not None or rotary_pos_cos_sin is not None:
            raise ValueError(
                "Gemma4SelfAttention applies its own RoPE: build GPTModel with position_embedding_type='none'"
            )
        query, key, value = self.get_query_key_value_tensors(hidden_states, key_value_states)
        thd = packed_seq_params is not None and packed_seq_params.qkv_format == "thd"
        if thd:
            query, key, value = query.squeeze(1), key.squeeze(1), value.squeeze(1)
        query, key = self._rope(query, key, packed_seq_params)
        attend = self._checkpointed_attention_forward if self.checkpoint_core_attention and self.training else None
        attend = attend or self.core_attention
        out = attend(
            query,
            key,
            value,
            attention_mask,
            attn_mask_type=self.attn_mask_type,
            attention_bias=attention_bias,
            packed_seq_params=packed_seq_params,
        )
        if thd:
            out = out.reshape(out.shape[0], 1, -1)
        out, bias = self.linear_proj(out)
        if bias is not None:
            raise ValueError("Gemma4SelfAttention: linear_proj has a bias; Gemma 4 has none (add_bias_linear=False)")
        return self.post_layernorm(out), None
