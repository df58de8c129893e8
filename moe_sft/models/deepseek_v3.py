"""DeepSeek-V3 (and V3-style configs): multi-latent attention, sigmoid group-limited routing with
the aux-loss-free `e_score_correction_bias`, shared experts, first_k_dense_replace dense layers.

Faithful to transformers' `DeepseekV3ForCausalLM`. Megatron equivalents: MLA
(`MLATransformerConfig`), `moe_router_score_function="sigmoid"`, `moe_router_enable_expert_bias`
(the bias is megatron's `router.expert_bias` and is updated during training as DeepSeek does),
`moe_router_num_groups`/`moe_router_group_topk`, `moe_router_topk_scaling_factor`.

Multi-token prediction (`num_nextn_predict_layers`): the layout is shared_rules.py's (HF's
`model.layers.{N + k}` as megatron's `mtp.layers.{k}`). transformers does not run these layers,
so parity is checked against a reference written from the DeepSeek-V3 report in the tests.
"""

from __future__ import annotations

from pathlib import Path

import torch.nn.functional as F
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

from moe_sft.models import common, shared_rules
from moe_sft.models import shape as S
from moe_sft.models.family import Family, Rule, UnsupportedConfigError
from moe_sft.models.hf_config import check_no_attention_bias, num_experts, rope_parameters, yarn_mscales

L = common.LAYER


def is_moe_layer(cfg, i: int) -> bool:
    return num_experts(cfg) > 0 and i >= (cfg.first_k_dense_replace or 0)  # as DeepseekV3DecoderLayer


def check_supported(cfg) -> None:
    if getattr(cfg, "hidden_act", "silu") != "silu":
        raise UnsupportedConfigError(
            f"config.json: hidden_act={cfg.hidden_act!r} is not supported; DeepSeek-V3 uses 'silu'."
        )
    if getattr(cfg, "topk_method", "noaux_tc") not in ("noaux_tc", None):
        raise UnsupportedConfigError(
            f"config.json: topk_method={cfg.topk_method!r} is not supported; only DeepSeek-V3's 'noaux_tc'."
        )
    if rope_parameters(cfg).get("rope_type", "default") not in ("default", "yarn"):
        raise UnsupportedConfigError(
            f"config.json: rope type {rope_parameters(cfg)['rope_type']!r} is "
            "not supported for DeepSeek-V3; use default or yarn."
        )
    if rope_parameters(cfg).get("truncate", True) is False:
        raise UnsupportedConfigError(
            "config.json: rope_parameters.truncate=false is not supported; "
            "megatron's YaRN rounds the correction range (truncate=true)."
        )
    if cfg.tie_word_embeddings and num_mtp_layers(cfg):
        raise UnsupportedConfigError(
            "config.json: tie_word_embeddings=true with num_nextn_predict_layers>0 "
            "is not supported (DeepSeek-V3 unties them)"
        )
    check_no_attention_bias(cfg, "DeepSeek-V3 (it biases q_a_proj and kv_a_proj_with_mqa)")
    if not getattr(cfg, "rope_interleave", True):
        raise UnsupportedConfigError(
            "config.json: rope_interleave=false is not supported; DeepSeek-V3 "
            "checkpoints use the interleaved rope layout."
        )


def num_mtp_layers(cfg) -> int:
    return int(getattr(cfg, "num_nextn_predict_layers", 0) or 0)


def _rope_kwargs(cfg) -> dict:
    rope = rope_parameters(cfg)
    if rope.get("rope_type", "default") != "yarn":
        return dict(rope_type="rope", rotary_base=float(rope["rope_theta"]))
    mscale, mscale_all_dim = yarn_mscales(rope)
    return dict(
        rope_type="yarn",
        rotary_base=float(rope["rope_theta"]),
        rotary_scaling_factor=float(rope["factor"]),
        original_max_position_embeddings=int(rope["original_max_position_embeddings"]),
        beta_fast=float(rope.get("beta_fast") or 32),
        beta_slow=float(rope.get("beta_slow") or 1),
        mscale=mscale,
        mscale_all_dim=mscale_all_dim,
    )


HF_LATENT_NORM_EPS = 1e-6
HF_GROUP_SCORE_TOPK = shared_rules.HF_GROUP_SCORE_TOPK  # public names kept for kimi_k2 and tests
_routing_config = shared_rules.sigmoid_group_routing_config


def transformer_config_kwargs(cfg) -> dict:
    layers = cfg.num_hidden_layers
    return dict(
        multi_latent_attention=True,
        num_layers=layers,
        hidden_size=cfg.hidden_size,
        ffn_hidden_size=cfg.intermediate_size,
        num_attention_heads=cfg.num_attention_heads,
        num_query_groups=cfg.num_attention_heads,
        kv_channels=cfg.qk_nope_head_dim + cfg.qk_rope_head_dim,
        q_lora_rank=cfg.q_lora_rank,
        kv_lora_rank=cfg.kv_lora_rank,
        qk_head_dim=cfg.qk_nope_head_dim,
        qk_pos_emb_head_dim=cfg.qk_rope_head_dim,
        v_head_dim=cfg.v_head_dim,
        qk_layernorm=True,
        normalization="RMSNorm",
        layernorm_epsilon=cfg.rms_norm_eps,
        # DeepseekV3Attention builds q_a_layernorm / kv_a_layernorm with RMSNorm's default eps.
        mla_latent_layernorm_epsilon=None if cfg.rms_norm_eps == HF_LATENT_NORM_EPS else HF_LATENT_NORM_EPS,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        num_moe_experts=num_experts(cfg),
        moe_ffn_hidden_size=cfg.moe_intermediate_size,
        moe_shared_expert_intermediate_size=(cfg.n_shared_experts or 0) * cfg.moe_intermediate_size or None,
        **shared_rules.sigmoid_group_routing_config(cfg),
        moe_layer_freq=[1 if is_moe_layer(cfg, i) else 0 for i in range(layers)],
        init_method_std=cfg.initializer_range,
        mtp_num_layers=num_mtp_layers(cfg) or None,
        **_rope_kwargs(cfg),
    )


def shape(cfg, name: str = "model") -> S.ModelShape:
    c = S.config_view(cfg)
    fields = S.common_shape_fields(c, name)
    mla = S.MLA(
        q_lora=c.q_lora_rank,
        kv_lora=int(c.kv_lora_rank),
        qk_nope=int(c.qk_nope_head_dim),
        qk_rope=int(c.qk_rope_head_dim),
        v_head=int(c.v_head_dim),
    )
    moe_ffn = int(c.moe_intermediate_size)
    return S.ModelShape(
        **fields,
        num_kv_heads=fields["num_heads"],
        head_dim=mla.qk_nope + mla.qk_rope,
        qk_norm=True,
        ffn=int(c.intermediate_size),
        moe_ffn=moe_ffn,
        shared_ffn=int(c.n_shared_experts or 0) * moe_ffn,
        moe_layers=tuple(is_moe_layer(c, i) for i in range(fields["num_layers"])),
        mtp_layers=num_mtp_layers(c),
        mla=mla,
    )


def gpt_model_kwargs(cfg) -> dict:
    """GPTModel builds no rotary embedding for MLA: the rope (base, YaRN) is MLATransformerConfig's
    (transformer_config_kwargs) and the MLA attention applies it."""
    return common.gpt_model_kwargs(cfg, rope_in_gpt_model=False)


def rules(cfg) -> list[Rule]:
    attn = L + "self_attn."
    sa = "decoder.layers.{layer}.self_attention."
    if cfg.q_lora_rank:
        q_rules = [
            Rule(sa + "linear_q_down_proj.weight", (attn + "q_a_proj.weight",), layers="all"),
            Rule(sa + "q_layernorm.weight", (attn + "q_a_layernorm.weight",), layers="all"),
            Rule(sa + "linear_q_up_proj.weight", (attn + "q_b_proj.weight",), layers="all"),
        ]
    else:
        q_rules = [Rule(sa + "linear_q_proj.weight", (attn + "q_proj.weight",), layers="all")]
    return (
        shared_rules.embedding_and_head_rules(cfg, num_mtp_layers(cfg))
        + q_rules
        + [
            Rule("decoder.layers.{layer}.input_layernorm.weight", (L + "input_layernorm.weight",), layers="all"),
            Rule(sa + "linear_kv_down_proj.weight", (attn + "kv_a_proj_with_mqa.weight",), layers="all"),
            Rule(sa + "kv_layernorm.weight", (attn + "kv_a_layernorm.weight",), layers="all"),
            Rule(sa + "linear_kv_up_proj.weight", (attn + "kv_b_proj.weight",), layers="all"),
            Rule(sa + "linear_proj.weight", (attn + "o_proj.weight",), layers="all"),
            Rule(
                "decoder.layers.{layer}.pre_mlp_layernorm.weight",
                (L + "post_attention_layernorm.weight",),
                layers="all",
            ),
            shared_rules.expert_bias_rule("mlp.gate.e_score_correction_bias"),
        ]
        + shared_rules.shared_expert_rules(cfg.n_shared_experts)
        + common.routed_expert_rules(
            "mlp.gate.weight",
            "mlp.experts.{expert}.gate_proj.weight",
            "mlp.experts.{expert}.up_proj.weight",
            "mlp.experts.{expert}.down_proj.weight",
        )
        + common.dense_mlp_rules()
    )


# What DeepSeek-V3's config.json holds for its remote code (configuration_deepseek.py) beyond
# transformers' DeepseekV3Config, at the release's values: the tiny model writes them as the
# release does, and exports keep them (serving engines read them: vLLM gives the router its
# e_score_correction_bias from topk_method / scoring_func).
RELEASE_REMOTE_FIELDS = {
    "auto_map": {
        "AutoConfig": "configuration_deepseek.DeepseekV3Config",
        "AutoModel": "modeling_deepseek.DeepseekV3Model",
        "AutoModelForCausalLM": "modeling_deepseek.DeepseekV3ForCausalLM",
    },
    "aux_loss_alpha": 0.001,
    "ep_size": 1,
    "moe_layer_freq": 1,
    "scoring_func": "sigmoid",
    "seq_aux": True,
    "topk_method": "noaux_tc",
}


def tiny_hf_config(vocab_size: int = 512, **overrides) -> DeepseekV3Config:
    kwargs = dict(
        vocab_size=vocab_size,
        hidden_size=128,
        intermediate_size=256,
        moe_intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        n_routed_experts=8,
        n_shared_experts=1,
        num_experts_per_tok=2,
        n_group=2,
        topk_group=1,
        first_k_dense_replace=1,
        q_lora_rank=64,
        kv_lora_rank=32,
        qk_rope_head_dim=16,
        qk_nope_head_dim=32,
        v_head_dim=32,
        routed_scaling_factor=2.5,
        norm_topk_prob=True,
        max_position_embeddings=2048,
        tie_word_embeddings=False,
        num_nextn_predict_layers=0,
        # MLA has no qk-norm: with the release's 0.02 at hidden 128 the attention logits start near 0 and
        # the query/key weights sit at a saddle; the quickstart's 200 steps then stay on the loss
        # plateau (0/200 exact match). 0.05 (initial logits 6x larger) leaves it within 50 steps
        # (docs/quickstart_cpu.md).
        initializer_range=0.05,
    )
    kwargs.update(RELEASE_REMOTE_FIELDS, **overrides)
    return DeepseekV3Config(**kwargs)


def _sample_rope(rng) -> dict:
    theta = rng.choice([10000.0, 50000.0, rng.uniform(500.0, 2e5)])
    if rng.random() < 0.5:
        return {"rope_type": "default", "rope_theta": theta}
    return {
        "rope_type": "yarn",
        "rope_theta": theta,
        "factor": rng.choice([2.0, 4.0, 40.0]),
        "original_max_position_embeddings": rng.choice([16, 32, 64]),
        "beta_fast": rng.choice([32.0, 16.0]),
        "beta_slow": rng.choice([1.0, 2.0]),
        "mscale": rng.choice([None, 1.0, 0.707]),
        "mscale_all_dim": rng.choice([None, 0.0, 1.0, 0.707]),
    }


def sample_hf_config(rng, vocab_size: int) -> DeepseekV3Config:
    """MLA dims (q_lora_rank or none, nope/rope/v head dims equal or not), expert groups (each of
    2+ experts: transformers ranks groups by their two best), top-1 up to every kept expert."""
    groups = rng.choice([1, 2, 4])
    per_group = rng.randint(2, 4)
    kept = rng.randint(1, groups)
    layers = rng.randint(1, 3)
    heads = rng.choice([1, 2, 4, 8])
    return DeepseekV3Config(
        vocab_size=vocab_size,
        hidden_size=rng.choice([32, 64, 96, 128]),
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        q_lora_rank=rng.choice([None, 16, 48]),
        kv_lora_rank=rng.choice([16, 32]),
        qk_nope_head_dim=rng.choice([8, 16, 32]),
        qk_rope_head_dim=rng.choice([4, 8, 16]),
        v_head_dim=rng.choice([8, 16, 32]),
        intermediate_size=16 * rng.randint(1, 8),
        moe_intermediate_size=16 * rng.randint(1, 4),
        **shared_rules.sample_group_routed_moe(rng, groups, per_group, kept, layers),
        rope_parameters=_sample_rope(rng),
        rms_norm_eps=rng.choice([1e-6, 1e-5]),
        tie_word_embeddings=rng.random() < 0.3,
        max_position_embeddings=4096,
        num_nextn_predict_layers=0,
    )


FAMILY = Family(
    name="deepseek_v3",
    model_types=("deepseek_v3",),
    hf_config_class=DeepseekV3Config,
    hf_model_class=DeepseekV3ForCausalLM,
    check_supported=check_supported,
    transformer_config_kwargs=transformer_config_kwargs,
    gpt_model_kwargs=gpt_model_kwargs,
    shape=shape,
    rules=rules,
    is_moe_layer=is_moe_layer,
    tiny_hf_config=tiny_hf_config,
    sample_hf_config=sample_hf_config,
    training_defaults={"moe_router_load_balancing_type": "seq_aux_loss"},
    num_mtp_layers=num_mtp_layers,
    mtp_config_field="num_nextn_predict_layers",
    remote_code=Path(__file__).parent / "remote_code" / "deepseek_v3",
)
