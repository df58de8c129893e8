"""megatron's TransformerConfig plus the few choices where an HF family differs from megatron,
and which of a config's layers are MoE (the layer specs and the model shape read it).

Each field defaults to None, which keeps megatron's behaviour; a family sets it when the HF
model's code computes something megatron does not offer (transformers' modeling code is the
reference, tests/cpu/test_config_space.py checks it over each family's legal configs).
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron.core.transformer.transformer_config import MLATransformerConfig, TransformerConfig


@dataclass(frozen=True)
class Gemma4AttentionKind:
    """One decoder layer's attention as moe_sft/layers/gemma4_attention.py computes it: transformers'
    Gemma4TextAttention of that layer (its `per_layer_config` dims) and the RoPE of its layer type
    (`rope_parameters[layer_type]`)."""

    head_dim: int
    num_query_groups: int
    k_eq_v: bool
    """linear_qkv holds [queries, key] per group and V is the projected K (`attention_k_eq_v`)."""
    rope_type: str
    """"default" (θ^(-2j/D) over the whole head) or "proportional" (gemma4_math.proportional_inv_freq)."""
    rope_theta: float
    partial_rotary_factor: float = 1.0
    rope_factor: float = 1.0


@dataclass
class SFTTransformerConfig(TransformerConfig):
    moe_router_group_score_topk: int | None = None
    """Group-limited routing ranks each group by the sum of its best this-many expert scores
    (transformers' DeepSeek-V3: 2). None: megatron's topk // group_topk."""

    moe_router_normalize_topk: bool | None = None
    """Renormalise the chosen experts' weights to sum 1 (HF `norm_topk_prob`). None: megatron's
    rule (sigmoid: when topk > 1; softmax: unless pre_softmax)."""

    mla_latent_layernorm_epsilon: float | None = None
    """Epsilon of MLA's q/kv latent norms (transformers' DeepSeek-V3 builds them with 1e-6
    whatever rms_norm_eps says). None: layernorm_epsilon."""

    linear_attention_layers: list[int] | None = None
    """Indices of the decoder layers whose mixer is Gated DeltaNet (moe_sft/layers/gated_delta_net.py,
    sized by megatron's linear_* fields); the others run self-attention. None: none."""

    linear_attention_projections: tuple[str, ...] | None = None
    """transformers' projections that the Gated DeltaNet's fused in_proj [q, k, v, z, b, a] is made
    of, each named by the parts it holds in row order (Qwen3-Next: ("qkvz", "ba"); Qwen3.5:
    ("qkv", "z", "b", "a")). A LoRA on in_proj gets one A per projection, as peft on transformers'
    model has (moe_sft/peft/install.py). None: no Gated DeltaNet."""

    qk_norm_full_width: bool | None = None
    """q/k RMSNorm over all heads at once, with one weight of width heads * head_dim (MiniMax-M2's
    q_norm / k_norm; moe_sft/layers/full_width_qk_norm.py). None: megatron's per-head qk_layernorm."""

    gemma4_attention_layers: tuple[Gemma4AttentionKind, ...] | None = None
    """One per decoder layer: every layer's mixer is Gemma 4's attention
    (moe_sft/layers/gemma4_attention.py) with these dims, k-eq-v and RoPE; kv_channels and
    num_query_groups are then the sliding layers'. None: megatron's SelfAttention."""

    gemma4_layers: bool | None = None
    """Every decoder layer is Gemma 4's (layers/spec.py `gemma4_layer_spec`): Gemma4RMSNorm norms, the
    dense MLP beside the routed experts with their own norms (layers/gemma4_moe.py), a layer scalar
    on the output (layers/gemma4_layer.py). None: megatron's layer."""

    embedding_multiplier: float | None = None
    """The word embeddings' output is multiplied by this, first rounded to the embedding weight's
    dtype (transformers' Gemma4TextScaledWordEmbedding: sqrt(hidden_size)). None: no multiplier."""

    final_logit_softcapping: float | None = None
    """Logits z become tanh(z / c) * c before the loss (transformers' `final_logit_softcapping`).
    None: no cap."""


@dataclass
class SFTMLATransformerConfig(MLATransformerConfig, SFTTransformerConfig):
    """MLATransformerConfig with the fields above."""


@dataclass
class SFTYarnTransformerConfig(SFTTransformerConfig):
    """GPTModel's YaRN rotary embedding (position_embedding_type "yarn", gpt-oss) reads these; a
    separate class because megatron's attention applies a YaRN cos/sin scale to any config that
    has `yarn_rotary_scaling_factor` at all."""

    yarn_rotary_scaling_factor: float = 1.0
    yarn_original_max_position_embeddings: int = 4096
    yarn_beta_fast: float = 32.0
    yarn_beta_slow: float = 1.0
    yarn_mscale: float = 1.0
    yarn_mscale_all_dim: float = 0.0
    yarn_correction_range_round_to_int: bool = True


def is_linear_attention_layer(config, index: int) -> bool:
    """Layer `index` (0-based, over the whole decoder) runs Gated DeltaNet."""
    return index in (getattr(config, "linear_attention_layers", None) or ())


def gemma4_attention_kind(config, layer_number: int) -> Gemma4AttentionKind | None:
    """The Gemma 4 attention of megatron's `layer_number` (1-based, over the whole decoder), None
    when the config has none."""
    kinds = getattr(config, "gemma4_attention_layers", None)
    return kinds[layer_number - 1] if kinds else None


def config_class(multi_latent_attention: bool, yarn: bool = False) -> type:
    if multi_latent_attention:
        return SFTMLATransformerConfig
    return SFTYarnTransformerConfig if yarn else SFTTransformerConfig


def is_moe_layer_of_config(config, layer_index: int) -> bool:
    """Layer `layer_index` of a megatron TransformerConfig is MoE: megatron's `moe_layer_freq`
    (an int: every freq-th layer; a list: one 0/1 per layer), no layer without experts."""
    if not config.num_moe_experts:
        return False
    freq = config.moe_layer_freq
    if isinstance(freq, int):
        return layer_index % freq == 0
    return bool(freq[layer_index])
