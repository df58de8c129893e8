"""Qwen3-MoE (Qwen3-30B-A3B, Qwen3-235B-A22B): HF config → megatron TransformerConfig, weight map.

Faithful to transformers' `Qwen3MoeForCausalLM`: GQA with per-head RMSNorm on q and k, SwiGLU
experts, softmax router with top-k renormalisation when `norm_topk_prob` (megatron:
top-k then softmax, `moe_router_pre_softmax=False`), load-balancing aux loss with
`router_aux_loss_coef`, optional dense layers (`mlp_only_layers`, `decoder_sparse_step`).
"""

from __future__ import annotations

from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

from moe_sft.models import common
from moe_sft.models import shape as S
from moe_sft.models.family import Family, Rule, UnsupportedConfigError
from moe_sft.models.hf_config import check_no_attention_bias, check_rope_default, num_experts


def is_moe_layer(cfg, i: int) -> bool:
    mlp_only = set(getattr(cfg, "mlp_only_layers", None) or [])
    step = getattr(cfg, "decoder_sparse_step", 1) or 1
    return i not in mlp_only and num_experts(cfg) > 0 and (i + 1) % step == 0


def check_supported(cfg) -> None:
    if getattr(cfg, "use_sliding_window", False):
        raise UnsupportedConfigError(
            "config.json: use_sliding_window=true is not supported (Qwen3-MoE trains with full "
            "attention); set use_sliding_window=false."
        )
    if getattr(cfg, "hidden_act", "silu") != "silu":
        raise UnsupportedConfigError(
            f"config.json: hidden_act={cfg.hidden_act!r} is not supported; Qwen3-MoE uses 'silu'."
        )
    check_rope_default(cfg)
    check_no_attention_bias(cfg, "Qwen3-MoE (it biases q, k, v and o_proj)")


def transformer_config_kwargs(cfg) -> dict:
    return dict(
        common.gqa_swiglu_config(cfg, ffn_hidden_size=cfg.intermediate_size),
        qk_layernorm=True,
        num_moe_experts=num_experts(cfg),
        moe_ffn_hidden_size=cfg.moe_intermediate_size,
        **common.softmax_routing_config(cfg.num_experts_per_tok, bool(cfg.norm_topk_prob)),
        moe_layer_freq=[1 if is_moe_layer(cfg, i) else 0 for i in range(cfg.num_hidden_layers)],
        moe_aux_loss_coeff=cfg.router_aux_loss_coef,
    )


def shape(cfg, name: str = "model") -> S.ModelShape:
    c = S.config_view(cfg)
    return common.gqa_moe_shape(c, name, qk_norm=True, moe_ffn=c.moe_intermediate_size, is_moe_layer=is_moe_layer)


def rules(cfg) -> list[Rule]:
    return (
        common.embedding_and_head_rules(cfg)
        + common.gqa_attention_rules(cfg, qk_norm=True)
        + common.routed_expert_rules(
            "mlp.gate.weight",
            "mlp.experts.{expert}.gate_proj.weight",
            "mlp.experts.{expert}.up_proj.weight",
            "mlp.experts.{expert}.down_proj.weight",
        )
        + common.dense_mlp_rules()
    )


def tiny_hf_config(vocab_size: int = 512, **overrides) -> Qwen3MoeConfig:
    """A few-MB Qwen3-MoE for tests and the quickstart (dims multiple of 16 for grouped_mm)."""
    kwargs = dict(
        vocab_size=vocab_size,
        hidden_size=128,
        intermediate_size=256,
        moe_intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        num_experts=8,
        num_experts_per_tok=2,
        max_position_embeddings=2048,
        tie_word_embeddings=False,
        norm_topk_prob=True,
        router_aux_loss_coef=0.01,
        rms_norm_eps=1e-6,
    )
    kwargs.update(overrides)
    return Qwen3MoeConfig(**kwargs)


def sample_hf_config(rng, vocab_size: int) -> Qwen3MoeConfig:
    layers = rng.randint(1, 3)
    experts = rng.randint(2, 12)
    return Qwen3MoeConfig(
        vocab_size=vocab_size,
        num_hidden_layers=layers,
        **common.sample_attention_shape(rng),
        intermediate_size=16 * rng.randint(1, 8),
        moe_intermediate_size=16 * rng.randint(1, 6),
        num_experts=experts,
        num_experts_per_tok=rng.randint(1, experts),
        norm_topk_prob=rng.random() < 0.5,
        decoder_sparse_step=rng.choice([1, 1, 2]),
        mlp_only_layers=sorted(rng.sample(range(layers), rng.randint(0, layers - 1))),
        router_aux_loss_coef=0.01,
        use_sliding_window=False,
        **common.sample_rope_and_norm(rng),
    )


FAMILY = Family(
    name="qwen3_moe",
    model_types=("qwen3_moe",),
    hf_config_class=Qwen3MoeConfig,
    hf_model_class=Qwen3MoeForCausalLM,
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
