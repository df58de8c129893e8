"""Mixtral (8x7B, 8x22B): HF config → megatron TransformerConfig, weight map.

Faithful to transformers' `MixtralForCausalLM`: GQA without qk-norm, SwiGLU experts with
per-expert w1 (gate), w3 (up), w2 (down), a softmax top-k router whose top-k weights are
renormalised (megatron: top-k then softmax, `moe_router_pre_softmax=False`), and the
load-balancing aux loss with `router_aux_loss_coef`. Every layer is MoE.
"""

from __future__ import annotations

from transformers import MixtralConfig, MixtralForCausalLM

from moe_sft.models import common
from moe_sft.models import shape as S
from moe_sft.models.family import Family, Rule, UnsupportedConfigError
from moe_sft.models.hf_config import check_rope_default, num_experts


def is_moe_layer(cfg, i: int) -> bool:
    return True


def check_supported(cfg) -> None:
    if getattr(cfg, "sliding_window", None):
        raise UnsupportedConfigError(
            f"config.json: sliding_window={cfg.sliding_window} is not supported (Mixtral 8x7B/8x22B "
            "use full attention); set sliding_window to null."
        )
    if getattr(cfg, "router_jitter_noise", 0.0):
        raise UnsupportedConfigError(
            f"config.json: router_jitter_noise={cfg.router_jitter_noise} is not supported; set it to 0."
        )
    if getattr(cfg, "hidden_act", "silu") != "silu":
        raise UnsupportedConfigError(
            f"config.json: hidden_act={cfg.hidden_act!r} is not supported; Mixtral uses 'silu'."
        )
    check_rope_default(cfg)


def transformer_config_kwargs(cfg) -> dict:
    return dict(
        common.gqa_swiglu_config(cfg, ffn_hidden_size=cfg.intermediate_size),
        qk_layernorm=False,
        num_moe_experts=num_experts(cfg),
        moe_ffn_hidden_size=cfg.intermediate_size,
        **common.softmax_routing_config(cfg.num_experts_per_tok, normalize=True),  # Mixtral always does
        moe_aux_loss_coeff=cfg.router_aux_loss_coef,
    )


def shape(cfg, name: str = "model") -> S.ModelShape:
    c = S.config_view(cfg)
    return common.gqa_moe_shape(c, name, qk_norm=False, moe_ffn=c.intermediate_size, is_moe_layer=is_moe_layer)


def rules(cfg) -> list[Rule]:
    moe = "block_sparse_moe."
    return (
        common.embedding_and_head_rules(cfg)
        + common.gqa_attention_rules(cfg, qk_norm=False)
        + common.routed_expert_rules(
            moe + "gate.weight",
            moe + "experts.{expert}.w1.weight",
            moe + "experts.{expert}.w3.weight",
            moe + "experts.{expert}.w2.weight",
        )
    )


def tiny_hf_config(vocab_size: int = 512, **overrides) -> MixtralConfig:
    kwargs = dict(
        vocab_size=vocab_size,
        hidden_size=128,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        num_local_experts=8,
        num_experts_per_tok=2,
        max_position_embeddings=2048,
        tie_word_embeddings=False,
        router_aux_loss_coef=0.02,
        rms_norm_eps=1e-5,
        sliding_window=None,
        # No qk-norm: with the release's 0.02 at hidden 128 the attention logits start near 0 and
        # the query/key weights sit at a saddle; the quickstart's 200 steps then stay on the loss
        # plateau (0/200 exact match). 0.05 (initial logits 6x larger) leaves it within 50 steps
        # (docs/quickstart_cpu.md).
        initializer_range=0.05,
    )
    kwargs.update(overrides)
    return MixtralConfig(**kwargs)


def sample_hf_config(rng, vocab_size: int) -> MixtralConfig:
    experts = rng.randint(2, 10)
    return MixtralConfig(
        vocab_size=vocab_size,
        num_hidden_layers=rng.randint(1, 3),
        **common.sample_attention_shape(rng),
        intermediate_size=16 * rng.randint(1, 6),
        num_local_experts=experts,
        num_experts_per_tok=rng.randint(1, experts),
        router_aux_loss_coef=0.02,
        sliding_window=None,
        **common.sample_rope_and_norm(rng),
    )


FAMILY = Family(
    name="mixtral",
    model_types=("mixtral",),
    hf_config_class=MixtralConfig,
    hf_model_class=MixtralForCausalLM,
    check_supported=check_supported,
    transformer_config_kwargs=transformer_config_kwargs,
    gpt_model_kwargs=common.gpt_model_kwargs,
    shape=shape,
    rules=rules,
    is_moe_layer=is_moe_layer,
    tiny_hf_config=tiny_hf_config,
    sample_hf_config=sample_hf_config,
    training_defaults={"moe_router_load_balancing_type": "aux_loss"},
)
