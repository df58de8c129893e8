"""Qwen3.5 / Qwen3.6 MoE (Qwen3.5-35B-A3B, 122B-A10B, 397B-A17B) language model: HF config →
megatron TransformerConfig, weight map.

Faithful to transformers' `Qwen3_5MoeForCausalLM` (`qwen3_5_moe_text`). The architecture is
Qwen3-Next's (moe_sft/models/qwen3_next.py: hybrid Gated DeltaNet / gated attention layers,
zero-centred norms, gated shared expert) with three differences: the GDN's projections are
separate, `in_proj_qkv` ([q, k, v] whole), `in_proj_z`, `in_proj_b`, `in_proj_a`, which megatron's
in_proj concatenates; every layer is MoE and the router always renormalises its top-k; the rotary
embedding is multimodal (`mrope_section`), which for text (every section at the token's position)
is the 1-D partial RoPE. Multi-token prediction is Qwen3-Next's (`mtp.*`, qwen3_next.mtp_rules).

The vision-language releases (`Qwen3_5MoeForConditionalGeneration`, model_type `qwen3_5_moe`) hold
this language model under `model.language_model.*` beside the vision tower `model.visual.*`
(`COMPOSITE`): the language model is converted and trained on text, the vision tower carried
through and written back at export.
"""

from __future__ import annotations

import torch
from transformers import (
    Qwen3_5MoeConfig,
    Qwen3_5MoeForCausalLM,
    Qwen3_5MoeForConditionalGeneration,
    Qwen3_5MoeTextConfig,
)

from moe_sft.models import common, qwen3_next
from moe_sft.models import transforms as T
from moe_sft.models.family import Composite, Family, Rule, UnsupportedConfigError
from moe_sft.models.hf_config import num_experts

# transformers' Gated DeltaNet input projections, named by the parts of megatron's in_proj
# [q, k, v, z, b, a] each holds
IN_PROJ_PROJECTIONS = ("qkv", "z", "b", "a")


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
    kwargs.update(linear_attention_projections=IN_PROJ_PROJECTIONS)
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
    return qwen3_next.shape(_with_qwen3_next_fields(text_config(cfg)), name, IN_PROJ_PROJECTIONS)


def text_config(cfg):
    """The language model's config of a vision-language config (object or config.json dict); a
    text-only one is its own."""
    if isinstance(cfg, dict):
        return cfg.get("text_config", cfg) if cfg.get("model_type") == COMPOSITE_TYPE else cfg
    return cfg.text_config if getattr(cfg, "model_type", None) == COMPOSITE_TYPE else cfg


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
    projections = tuple(f"in_proj_{p}.weight" for p in IN_PROJ_PROJECTIONS)
    return (
        common.embedding_and_head_rules(cfg)
        + qwen3_next.gated_attention_rules()
        + qwen3_next.linear_attention_rules(projections, QKV_Z_B_A)
        + qwen3_next.block_rules(_with_qwen3_next_fields(cfg))
        + qwen3_next.mtp_rules(cfg)
    )


def tiny_hf_config(vocab_size: int = 512, **overrides) -> Qwen3_5MoeTextConfig:
    """A few-MB Qwen3.5 MoE: the tiny hybrid stack of qwen3_next.TINY_HYBRID."""
    return qwen3_next.tiny_config(Qwen3_5MoeTextConfig, vocab_size, 1e7, overrides)


def sample_hf_config(rng, vocab_size: int) -> Qwen3_5MoeTextConfig:
    return Qwen3_5MoeTextConfig(**qwen3_next.sample_hybrid(rng, vocab_size, rng.randint(1, 4)))


# A vision tower as small as transformers builds one (one block), for the tiny VL model.
TINY_VISION = dict(
    depth=1,
    hidden_size=32,
    intermediate_size=64,
    num_heads=2,
    num_position_embeddings=16,
    patch_size=4,
    spatial_merge_size=2,
    temporal_patch_size=2,
)


def tiny_vl_hf_config(vocab_size: int = 512, **overrides) -> Qwen3_5MoeConfig:
    """The tiny model as a vision-language release: tiny_hf_config's language model and a
    one-block vision tower."""
    text = tiny_hf_config(vocab_size, **overrides)
    vision = dict(TINY_VISION, out_hidden_size=text.hidden_size)  # the merger feeds the language model
    return Qwen3_5MoeConfig(text_config=text.to_dict(), vision_config=vision, tie_word_embeddings=False)


COMPOSITE_TYPE = "qwen3_5_moe"
COMPOSITE = Composite(
    model_type=COMPOSITE_TYPE,
    hf_model_class=Qwen3_5MoeForConditionalGeneration,
    text_config=text_config,
    # transformers' Qwen3_5MoeModel holds the language model as `language_model`; lm_head stays
    # at the top (and the releases' `mtp.*` too)
    renames=(("model.", "model.language_model."),),
    carried={r"model\.visual\..*": "vision"},
    tiny_hf_config=tiny_vl_hf_config,
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
    training_defaults={"moe_router_load_balancing_type": "aux_loss"},
    composite=COMPOSITE,
    num_mtp_layers=qwen3_next.num_mtp_layers,
    mtp_config_field="mtp_num_hidden_layers",
    mtp_layer_hf_prefix=qwen3_next.MTP_LAYER_HF_PREFIX,
)
