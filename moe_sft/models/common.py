"""Mapping-table pieces shared by the Llama-style families (Qwen3-MoE, Mixtral, ...).

Each helper returns `Rule`s; a family file composes them into its table, so the table stays
declarative and one place says how, e.g., GQA attention maps onto megatron's fused linear_qkv.
"""

from __future__ import annotations

import torch.nn.functional as F

from moe_sft.models import shape
from moe_sft.models import transforms as T
from moe_sft.models.family import Rule
from moe_sft.models.hf_config import rope_theta

LAYER = "model.layers.{layer}."


def embedding_and_head_rules(cfg) -> list[Rule]:
    """Embeddings, final norm and (untied) lm_head; padded vocab rows are added/removed here."""
    rules = [
        Rule("embedding.word_embeddings.weight", ("model.embed_tokens.weight",), T.PAD_VOCAB),
        Rule("decoder.final_layernorm.weight", ("model.norm.weight",)),
    ]
    if not cfg.tie_word_embeddings:
        rules.append(Rule("output_layer.weight", ("lm_head.weight",), T.PAD_VOCAB))
    return rules


def gqa_attention_rules(cfg, qk_norm: bool) -> list[Rule]:
    attn = LAYER + "self_attn."
    rules = [
        Rule("decoder.layers.{layer}.input_layernorm.weight", (LAYER + "input_layernorm.weight",), layers="all"),
        Rule(
            "decoder.layers.{layer}.self_attention.linear_qkv.weight",
            (attn + "q_proj.weight", attn + "k_proj.weight", attn + "v_proj.weight"),
            T.QKV_INTERLEAVE,
            layers="all",
        ),
        Rule("decoder.layers.{layer}.self_attention.linear_proj.weight", (attn + "o_proj.weight",), layers="all"),
        Rule(
            "decoder.layers.{layer}.pre_mlp_layernorm.weight",
            (LAYER + "post_attention_layernorm.weight",),
            layers="all",
        ),
    ]
    if qk_norm:
        rules += [
            Rule("decoder.layers.{layer}.self_attention.q_layernorm.weight", (attn + "q_norm.weight",), layers="all"),
            Rule("decoder.layers.{layer}.self_attention.k_layernorm.weight", (attn + "k_norm.weight",), layers="all"),
        ]
    if getattr(cfg, "attention_bias", False):
        rules.append(
            Rule(
                "decoder.layers.{layer}.self_attention.linear_qkv.bias",
                (attn + "q_proj.bias", attn + "k_proj.bias", attn + "v_proj.bias"),
                T.QKV_BIAS_INTERLEAVE,
                layers="all",
            )
        )
    return rules


def routed_expert_rules(router: str, gate: str, up: str, down: str) -> list[Rule]:
    """Router + experts; `gate/up/down` are HF names relative to the layer with `{expert}`."""
    return [
        Rule("decoder.layers.{layer}.mlp.router.weight", (LAYER + router,), layers="moe"),
        Rule("decoder.layers.{layer}.mlp.experts.weight1", (LAYER + gate, LAYER + up), T.EXPERTS_FC1, layers="moe"),
        Rule("decoder.layers.{layer}.mlp.experts.weight2", (LAYER + down,), T.EXPERTS_FC2, layers="moe"),
    ]


def dense_mlp_rules(prefix: str = "mlp.") -> list[Rule]:
    return [
        Rule(
            "decoder.layers.{layer}.mlp.linear_fc1.weight",
            (LAYER + prefix + "gate_proj.weight", LAYER + prefix + "up_proj.weight"),
            T.GATE_UP_FUSE,
            layers="dense",
        ),
        Rule("decoder.layers.{layer}.mlp.linear_fc2.weight", (LAYER + prefix + "down_proj.weight",), layers="dense"),
    ]


def gqa_swiglu_config(cfg, ffn_hidden_size: int) -> dict:
    """TransformerConfig fields every Llama-style GQA + SwiGLU family shares."""
    return dict(
        num_layers=cfg.num_hidden_layers,
        hidden_size=cfg.hidden_size,
        ffn_hidden_size=ffn_hidden_size,
        num_attention_heads=cfg.num_attention_heads,
        num_query_groups=cfg.num_key_value_heads,
        kv_channels=getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads,
        normalization="RMSNorm",
        layernorm_epsilon=cfg.rms_norm_eps,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=bool(getattr(cfg, "attention_bias", False)),
        init_method_std=cfg.initializer_range,
    )


def gpt_model_kwargs(cfg, rope_in_gpt_model: bool = True) -> dict:
    """GPTModel arguments from the HF config. With `rope_in_gpt_model` GPTModel applies RoPE over
    the whole head (rotary_percent 1) with the HF base; without (MLA) GPTModel builds no rotary
    embedding and the attention applies the rope its config describes."""
    kwargs = dict(
        position_embedding_type="rope",
        max_sequence_length=cfg.max_position_embeddings,
        share_embeddings_and_output_weights=bool(cfg.tie_word_embeddings),
    )
    if rope_in_gpt_model:
        kwargs.update(rotary_base=rope_theta(cfg), rotary_percent=1.0)
    return kwargs


def gqa_shape_fields(c, name: str) -> dict:
    """ModelShape fields every GQA family shares (c: a transformers config or shape.config_view);
    absent keys take transformers' defaults (head_dim hidden / heads, kv heads = heads)."""
    fields = shape.common_shape_fields(c, name)
    fields.update(
        num_kv_heads=int(c.num_key_value_heads or fields["num_heads"]),
        head_dim=int(getattr(c, "head_dim", None) or fields["hidden"] // fields["num_heads"]),
    )
    return fields


def gqa_moe_shape(
    c, name: str, *, qk_norm: bool, moe_ffn: int, is_moe_layer, qk_norm_full_width: bool = False
) -> shape.ModelShape:
    """The ModelShape of a GQA family without shared experts or MTP (c: shape.config_view)."""
    fields = gqa_shape_fields(c, name)
    return shape.ModelShape(
        **fields,
        qk_norm=qk_norm,
        qk_norm_full_width=qk_norm_full_width,
        ffn=int(c.intermediate_size),
        moe_ffn=int(moe_ffn),
        shared_ffn=0,
        mtp_layers=0,
        moe_layers=tuple(is_moe_layer(c, i) for i in range(fields["num_layers"])),
    )


def softmax_routing_config(topk: int, normalize: bool) -> dict:
    """transformers' softmax routers: softmax over all experts, top-k, renormalised when `normalize`.

    Renormalised top-k softmax equals megatron's default (top-k of the logits, then softmax of the
    chosen); unnormalised is megatron's pre-softmax. megatron's config refuses the first at top-1
    (the weight is 1, so only the aux loss trains the router, as in transformers): there the rule
    is stated explicitly (moe_sft/layers/router.py) and pre_softmax only satisfies the check.
    """
    return dict(
        moe_router_topk=topk,
        moe_router_score_function="softmax",
        moe_router_pre_softmax=not normalize or topk == 1,
        moe_router_normalize_topk=True if normalize and topk == 1 else None,
    )


def sample_attention_shape(rng) -> dict:
    """Random GQA dims for `sample_hf_config`: MHA, GQA or MQA, head_dim unrelated to hidden/heads."""
    heads = rng.choice([1, 2, 4, 8])
    return dict(
        hidden_size=rng.choice([32, 48, 64, 96, 128]),
        num_attention_heads=heads,
        num_key_value_heads=rng.choice([h for h in (1, 2, 4, 8) if heads % h == 0]),
        head_dim=rng.choice([8, 16, 24, 32, 48]),
    )


def sample_rope_and_norm(rng) -> dict:
    return dict(
        rope_parameters={
            "rope_type": "default",
            "rope_theta": rng.choice([10000.0, 500000.0, 1e6, rng.uniform(100.0, 5e4)]),
        },
        rms_norm_eps=rng.choice([1e-6, 1e-5, 1e-3]),
        tie_word_embeddings=rng.random() < 0.3,
        max_position_embeddings=4096,
    )
