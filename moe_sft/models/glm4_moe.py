"""GLM-4.5 / 4.6 / 4.7 (GLM-4.5-Air too): `glm4_moe` in transformers.

Faithful to transformers' `Glm4MoeForCausalLM`: GQA with q/k/v biases (`attention_bias`; no bias
on o_proj: megatron's add_qkv_bias), optional per-head RMSNorm of q and k before the rope
(`use_qk_norm`: megatron's qk_layernorm), partial RoPE over the first
int(head_dim * partial_rotary_factor) dims of each head, rotate-half pairing (dim i with
i + rotary_dim / 2, as megatron's default non-interleaved rope: GPTModel's rotary_percent), the
DeepSeek-V3 router (sigmoid scores, `e_score_correction_bias` for the choice only, `n_group` /
`topk_group`, `norm_topk_prob`, `routed_scaling_factor`: shared_rules.sigmoid_group_routing_config),
shared experts, `first_k_dense_replace` dense layers.

Multi-token prediction (`num_nextn_predict_layers`): the DeepSeek-V3 layout and computation
(shared_rules.py): the released GLM-4.5 / 4.5-Air checkpoints hold `model.layers.{N}` with
enorm, hnorm, eh_proj, shared_head.norm, shared_head.head, embed_tokens and a full (MoE) decoder
layer. transformers holds no MTP layer (its config declares one by default: a checkpoint it saved
converts without MTP). FP8 releases (`quantization_config` with 128x128 `weight_scale_inv`
blocks) are dequantised while streaming by the generic reader (conversion/hf_reader.py).
"""

from __future__ import annotations

from transformers import Glm4MoeConfig, Glm4MoeForCausalLM

from moe_sft.models import common, shared_rules
from moe_sft.models import shape as S
from moe_sft.models.family import Family, Rule, UnsupportedConfigError
from moe_sft.models.hf_config import num_experts, rope_parameters

HF_FIRST_K_DENSE_DEFAULT = 1  # Glm4MoeConfig's default, for config.json dicts without the key


def first_k_dense(cfg) -> int:
    return int(S.field(cfg, "first_k_dense_replace", default=HF_FIRST_K_DENSE_DEFAULT))


def is_moe_layer(cfg, i: int) -> bool:
    return num_experts(cfg) > 0 and i >= first_k_dense(cfg)  # as Glm4MoeDecoderLayer


def num_mtp_layers(cfg) -> int:
    return int(S.field(cfg, "num_nextn_predict_layers", "num_mtp_layers", default=0))


def head_dim(cfg) -> int:
    """Glm4MoeAttention's head dim: `head_dim` when the config has one (GLM-4.5: 128 with hidden
    5120 and 96 heads), else hidden_size // num_attention_heads."""
    return int(getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads)


def partial_rotary_factor(cfg) -> float:
    """transformers 5 keeps it in rope_parameters (Glm4MoeConfig's default 0.5); 4.x at the top."""
    rope = rope_parameters(cfg)
    return float(rope.get("partial_rotary_factor", getattr(cfg, "partial_rotary_factor", None) or 1.0))


def rotary_dim(cfg) -> int:
    """Glm4MoeRotaryEmbedding and megatron's RotaryEmbedding: int(head_dim * factor) dims."""
    return int(head_dim(cfg) * partial_rotary_factor(cfg))


def _refuse(field: str, value, why: str) -> None:
    raise UnsupportedConfigError(f"config.json: {field}={value!r} is not supported for GLM-4.5 ({why}).")


def _check_attention(cfg) -> None:
    rope_type = rope_parameters(cfg).get("rope_type", "default")
    if rope_type not in ("default", None):
        _refuse("rope_parameters.rope_type", rope_type, "the released GLM-4.5/4.6/4.7 use default RoPE")
    if getattr(cfg, "head_dim", None) is not None and int(cfg.head_dim) <= 0:
        _refuse("head_dim", cfg.head_dim, "a head needs at least one dim")
    if cfg.num_attention_heads % (cfg.num_key_value_heads or cfg.num_attention_heads):
        _refuse("num_key_value_heads", cfg.num_key_value_heads, "it must divide num_attention_heads")
    factor, rot = partial_rotary_factor(cfg), rotary_dim(cfg)
    if not 0 < factor <= 1 or rot < 2 or rot % 2:
        _refuse(
            "partial_rotary_factor",
            factor,
            f"int(head_dim {head_dim(cfg)} x factor) = {rot} rotary dims; it must be even, >= 2 and <= head_dim",
        )


def _check_routing(cfg) -> None:
    experts, groups, kept = num_experts(cfg), cfg.n_group or 1, cfg.topk_group or 1
    if experts % groups:
        _refuse("n_group", groups, f"it must divide n_routed_experts={experts}")
    if groups > 1 and experts // groups < shared_rules.HF_GROUP_SCORE_TOPK:
        _refuse("n_group", groups, "the router ranks each group by its two best experts: 2+ experts per group")
    if not 1 <= kept <= groups:
        _refuse("topk_group", kept, f"it must be in [1, n_group={groups}]")
    if not 1 <= cfg.num_experts_per_tok <= kept * experts // groups:
        _refuse("num_experts_per_tok", cfg.num_experts_per_tok, "more than the kept groups hold")


def _check_mtp(cfg) -> None:
    mtp, n = num_mtp_layers(cfg), cfg.num_hidden_layers
    if not mtp:
        return
    if cfg.tie_word_embeddings:
        _refuse("tie_word_embeddings", True, "with num_nextn_predict_layers > 0 GLM-4.5 unties them")
    # megatron builds every MTP layer like the last decoder layer; HF's layer N + k is MoE from
    # first_k_dense_replace on: they must agree.
    if any(is_moe_layer(cfg, n + k) != is_moe_layer(cfg, n - 1) for k in range(mtp)):
        _refuse(
            "first_k_dense_replace",
            first_k_dense(cfg),
            f"the MTP layers (model.layers.{n}..) must be MoE exactly when the last decoder layer is",
        )


def check_supported(cfg) -> None:
    """Every field the torch-native GPTModel cannot honour, refused by name before any work."""
    if getattr(cfg, "hidden_act", "silu") != "silu":
        _refuse("hidden_act", cfg.hidden_act, "GLM-4.5 uses 'silu'")
    if getattr(cfg, "mlp_bias", False):
        _refuse("mlp_bias", True, "Glm4MoeMLP has no bias")
    _check_attention(cfg)
    _check_routing(cfg)
    _check_mtp(cfg)


def transformer_config_kwargs(cfg) -> dict:
    layers = cfg.num_hidden_layers
    return dict(
        common.gqa_swiglu_config(cfg, ffn_hidden_size=cfg.intermediate_size),  # add_qkv_bias from attention_bias
        kv_channels=head_dim(cfg),
        qk_layernorm=bool(cfg.use_qk_norm),
        num_moe_experts=num_experts(cfg),
        moe_ffn_hidden_size=cfg.moe_intermediate_size,
        moe_shared_expert_intermediate_size=(cfg.n_shared_experts or 0) * cfg.moe_intermediate_size or None,
        **shared_rules.sigmoid_group_routing_config(cfg),
        moe_layer_freq=[1 if is_moe_layer(cfg, i) else 0 for i in range(layers)],
        mtp_num_layers=num_mtp_layers(cfg) or None,
    )


def gpt_model_kwargs(cfg) -> dict:
    """GPTModel's rope over int(kv_channels * rotary_percent) dims, as transformers' (same int())."""
    return dict(common.gpt_model_kwargs(cfg), rotary_percent=partial_rotary_factor(cfg))


def shape(cfg, name: str = "model") -> S.ModelShape:
    c = S.config_view(cfg)
    fields = common.gqa_shape_fields(c, name)
    moe_ffn = int(c.moe_intermediate_size)
    return S.ModelShape(
        **fields,
        qk_norm=bool(c.use_qk_norm),
        qkv_bias=bool(S.field(c, "attention_bias", default=False)),
        ffn=int(c.intermediate_size),
        moe_ffn=moe_ffn,
        shared_ffn=int(S.field(c, "n_shared_experts", default=1)) * moe_ffn,
        moe_layers=tuple(is_moe_layer(c, i) for i in range(fields["num_layers"])),
        mtp_layers=num_mtp_layers(c),
    )


def rules(cfg) -> list[Rule]:
    return (
        shared_rules.embedding_and_head_rules(cfg, num_mtp_layers(cfg))
        + common.gqa_attention_rules(cfg, qk_norm=bool(cfg.use_qk_norm))  # + q/k/v biases
        + [shared_rules.expert_bias_rule("mlp.gate.e_score_correction_bias")]
        + shared_rules.shared_expert_rules(cfg.n_shared_experts)
        + common.routed_expert_rules(
            "mlp.gate.weight",
            "mlp.experts.{expert}.gate_proj.weight",
            "mlp.experts.{expert}.up_proj.weight",
            "mlp.experts.{expert}.down_proj.weight",
        )
        + common.dense_mlp_rules()
    )


def tiny_hf_config(vocab_size: int = 512, **overrides) -> Glm4MoeConfig:
    """A few-MB GLM-4.5 (biases, qk-norm, half rotary, groups, a dense first layer, no MTP)."""
    kwargs = dict(
        vocab_size=vocab_size,
        hidden_size=128,
        intermediate_size=256,
        moe_intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        n_routed_experts=8,
        n_shared_experts=1,
        num_experts_per_tok=2,
        n_group=2,
        topk_group=1,
        first_k_dense_replace=1,
        routed_scaling_factor=2.5,
        norm_topk_prob=True,
        attention_bias=True,
        use_qk_norm=True,
        rope_parameters={"rope_type": "default", "rope_theta": 1e6, "partial_rotary_factor": 0.5},
        max_position_embeddings=2048,
        tie_word_embeddings=False,
        num_nextn_predict_layers=0,
    )
    kwargs.update(overrides)
    return Glm4MoeConfig(**kwargs)


def _sample_partial_rotary(rng, head: int) -> float:
    """Factors whose int(head * f) is an even rotary dim (0.6 truncates for some head dims)."""
    legal = [f for f in (0.25, 0.5, 0.5, 0.6, 0.75, 1.0) if int(head * f) >= 2 and int(head * f) % 2 == 0]
    return rng.choice(legal)


def sample_hf_config(rng, vocab_size: int) -> Glm4MoeConfig:
    """GQA/MQA/MHA, head_dim unrelated to hidden/heads, partial rotary factors, qk-norm and biases
    on/off, expert groups (2+ experts each), top-1 up to every kept expert, 0..2 shared experts,
    dense layers, the router's normalisation and scaling."""
    groups, per_group = rng.choice([1, 2, 4]), rng.randint(2, 4)
    kept, layers = rng.randint(1, groups), rng.randint(1, 3)
    attention = common.sample_attention_shape(rng)
    rope_and_norm = common.sample_rope_and_norm(rng)
    rope_and_norm["rope_parameters"]["partial_rotary_factor"] = _sample_partial_rotary(rng, attention["head_dim"])
    return Glm4MoeConfig(
        vocab_size=vocab_size,
        num_hidden_layers=layers,
        **attention,
        attention_bias=rng.random() < 0.6,
        use_qk_norm=rng.random() < 0.5,
        intermediate_size=16 * rng.randint(1, 8),
        moe_intermediate_size=16 * rng.randint(1, 4),
        **shared_rules.sample_group_routed_moe(rng, groups, per_group, kept, layers),
        num_nextn_predict_layers=0,
        **rope_and_norm,
    )


FAMILY = Family(
    name="glm4_moe",
    model_types=("glm4_moe",),
    hf_config_class=Glm4MoeConfig,
    hf_model_class=Glm4MoeForCausalLM,
    check_supported=check_supported,
    transformer_config_kwargs=transformer_config_kwargs,
    gpt_model_kwargs=gpt_model_kwargs,
    shape=shape,
    rules=rules,
    is_moe_layer=is_moe_layer,
    tiny_hf_config=tiny_hf_config,
    sample_hf_config=sample_hf_config,
    # GLM-4.5 trains with DeepSeek-V3's sequence-level balance loss and the bias update
    # (the GLM-4.5 report, sec. 2.1; Megatron-Bridge's GLM-4.5 provider).
    training_defaults={"moe_router_load_balancing_type": "seq_aux_loss"},
    num_mtp_layers=num_mtp_layers,
    mtp_config_field="num_nextn_predict_layers",
)
