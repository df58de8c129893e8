"""Qwen3.5 / Qwen3.6 MoE (Qwen3.5-35B-A3B, 122B-A10B, 397B-A17B) language model: HF config →
megatron TransformerConfig, weight map.

Faithful to transformers' `Qwen3_5MoeForCausalLM` (`qwen3_5_moe_text`). The architecture is
Qwen3-Next's (moe_sft/models/qwen3_next.py: hybrid Gated DeltaNet / gated attention layers,
zero-centred norms, gated shared expert) with three differences: the GDN's projections are
separate, `in_proj_qkv` ([q, k, v] whole), `in_proj_z`, `in_proj_b`, `in_proj_a`, which megatron's
in_proj concatenates; every layer is MoE and the router always renormalises its top-k; the rotary
embedding is multimodal (`mrope_section`), which for text (every section at the token's position)
is the 1-D partial RoPE.
"""

from __future__ import annotations

import torch
from transformers import Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig

from moe_sft.models import common, qwen3_next
from moe_sft.models import transforms as T
from moe_sft.models.family import Family, Rule, UnsupportedConfigError
from moe_sft.models.hf_config import num_experts


def is_moe_layer(cfg, i: int) -> bool:
    return num_experts(cfg) > 0


def check_supported(cfg) -> None:
    if not num_experts(cfg):
        raise UnsupportedConfigError(
            "config.json: num_experts=0: the dense Qwen3.5 models are not MoE; use an MoE release"
        )
    qwen3_next.check_supported(cfg)


def transformer_config_kwargs(cfg) -> dict:
    kwargs = qwen3_next.transformer_config_kwargs(_with_qwen3_next_fields(cfg))
    kwargs.update(common.softmax_routing_config(cfg.num_experts_per_tok, True))
    return kwargs


def _with_qwen3_next_fields(cfg):
    """The fields Qwen3-Next has and the Qwen3.5 text config does not: all layers MoE, the
    intermediate size of (absent) dense layers."""
    view = type("Qwen35View", (), {})()
    view.__dict__.update(cfg.to_dict() if hasattr(cfg, "to_dict") else dict(cfg))
    view.__dict__.update(norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[])
    view.__dict__.setdefault("intermediate_size", view.moe_intermediate_size)
    view.__dict__.setdefault("initializer_range", 0.02)
    return view


def shape(cfg, name: str = "model"):
    return qwen3_next.shape(_with_qwen3_next_fields(cfg), name)


def gpt_model_kwargs(cfg) -> dict:
    return qwen3_next.gpt_model_kwargs(cfg)


def _separate_from(ts, ctx: dict) -> torch.Tensor:
    """in_proj_qkv, in_proj_z, in_proj_b, in_proj_a → megatron's in_proj [q, k, v, z, b, a]."""
    return torch.cat(list(ts))


def _separate_to(t: torch.Tensor, ctx: dict) -> list[torch.Tensor]:
    kh, vh, kd, vd = qwen3_next._gdn_dims(ctx)
    return [x.contiguous() for x in torch.split(t, [2 * kh * kd + vh * vd, vh * vd, vh, vh])]


QKV_Z_B_A = T.Transform("gdn_qkv_z_b_a", _separate_from, _separate_to, row_separable=False)


def rules(cfg) -> list[Rule]:
    projections = ("in_proj_qkv.weight", "in_proj_z.weight", "in_proj_b.weight", "in_proj_a.weight")
    return (
        common.embedding_and_head_rules(cfg)
        + qwen3_next.gated_attention_rules()
        + qwen3_next.linear_attention_rules(projections, QKV_Z_B_A)
        + qwen3_next.block_rules(_with_qwen3_next_fields(cfg))
    )


def tiny_hf_config(vocab_size: int = 512, **overrides) -> Qwen3_5MoeTextConfig:
    """A few-MB Qwen3.5 MoE: three GDN layers and one gated-attention layer (the released pattern)."""
    kwargs = dict(
        vocab_size=vocab_size,
        hidden_size=128,
        moe_intermediate_size=64,
        shared_expert_intermediate_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=32,
        linear_value_head_dim=32,
        linear_conv_kernel_dim=4,
        num_experts=8,
        num_experts_per_tok=2,
        router_aux_loss_coef=0.01,
        max_position_embeddings=2048,
        tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25},
        use_cache=False,  # transformers' hybrid cache fails a forward of linear-attention layers only
    )
    kwargs.update(overrides)
    if "layer_types" not in overrides:
        kwargs["layer_types"] = None  # the config's own pattern for this many layers
    return Qwen3_5MoeTextConfig(**kwargs)


def sample_hf_config(rng, vocab_size: int) -> Qwen3_5MoeTextConfig:
    layers = rng.randint(1, 4)
    experts = rng.randint(2, 10)
    key_heads = rng.choice([1, 2, 4])
    attention = common.sample_attention_shape(rng)
    return Qwen3_5MoeTextConfig(
        vocab_size=vocab_size,
        num_hidden_layers=layers,
        **dict(attention, head_dim=rng.choice([8, 16, 32])),
        layer_types=[rng.choice(["linear_attention", "full_attention"]) for _ in range(layers)],
        linear_num_key_heads=key_heads,
        linear_num_value_heads=key_heads * rng.choice([1, 2, 3]),
        linear_key_head_dim=rng.choice([8, 16, 32]),
        linear_value_head_dim=rng.choice([8, 16, 32]),
        linear_conv_kernel_dim=rng.choice([2, 3, 4]),
        moe_intermediate_size=16 * rng.randint(1, 6),
        shared_expert_intermediate_size=rng.choice([16, 32]),
        num_experts=experts,
        num_experts_per_tok=rng.randint(1, experts),
        router_aux_loss_coef=0.01,
        use_cache=False,
        rms_norm_eps=rng.choice([1e-6, 1e-5]),
        tie_word_embeddings=rng.random() < 0.3,
        rope_parameters={
            "rope_type": "default",
            "rope_theta": rng.choice([10000.0, 1e7]),
            "partial_rotary_factor": rng.choice([0.25, 0.5, 1.0]),
        },
    )


FAMILY = Family(
    name="qwen3_5_moe",
    model_types=("qwen3_5_moe_text",),
    hf_config_class=Qwen3_5MoeTextConfig,
    hf_model_class=Qwen3_5MoeForCausalLM,
    check_supported=check_supported,
    transformer_config_kwargs=transformer_config_kwargs,
    gpt_model_kwargs=gpt_model_kwargs,
    shape=shape,
    rules=rules,
    is_moe_layer=is_moe_layer,
    is_linear_attention_layer=qwen3_next.is_linear_attention_layer,
    tiny_hf_config=tiny_hf_config,
    sample_hf_config=sample_hf_config,
    transform_context=qwen3_next.transform_context,
    # the releases' multi-token-prediction layers: transformers does not load them either
    dropped=(r"^mtp\.",),
    training_defaults={"moe_router_load_balancing_type": "aux_loss"},
)
