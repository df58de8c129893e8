"""MiniMax-M2 (230B-A10B; M2.1, M2.5 share the architecture): HF config → megatron, weight map.

Faithful to transformers' `MiniMaxM2ForCausalLM`:
- GQA whose q_norm / k_norm are RMSNorms over the whole projection (num_heads * head_dim, k:
  num_kv_heads * head_dim), not per head as megatron's qk_layernorm: SFTTransformerConfig's
  `qk_norm_full_width` (moe_sft/layers/full_width_qk_norm.py; under TP the sum of squares is
  all-reduced over the TP group);
- partial rotary (`rotary_dim` in the released config.json, `partial_rotary_factor` in
  transformers 5's rope_parameters): rotate-half on the first int(head_dim * factor) dims of each
  head, the rest passed through, as megatron's RoPE with `rotary_percent`;
- every layer MoE, no shared experts: `num_local_experts` SwiGLU experts (w1 gate, w3 up, w2 down)
  of width `intermediate_size`; MiniMaxM2TopKRouter: sigmoid scores, the expert bias
  (`e_score_correction_bias`, megatron's router.expert_bias) for the choice only, the chosen
  scores renormalised to sum 1 always (also at top-1), no scaling factor, no expert groups;
- the load-balancing aux loss with `router_aux_loss_coef`.

Multi-token prediction: the release's config.json declares `num_mtp_modules` (3) with
`mtp_transformer_layers` 1, stored after the decoder as `model.layers.{N + k}.*` (how sglang and
vLLM skip them). transformers' model has none and the modules' inner layout is not documented
(MiniMax-AI/MiniMax-M2 issue #47: the published MTP weights are not meant to be used), so they
are not converted: conversion logs them as dropped (`dropped_for_config`) and the model trains
without MTP.

FP8: the release is block-quantised (float8_e4m3fn, 128x128 blocks, `weight_scale_inv` beside
each quantised weight; router, expert bias and lm_head unquantised), the format DeepSeek-V3 uses:
the streaming reader dequantises it (moe_sft/conversion/fp8.py).
"""

from __future__ import annotations

from pathlib import Path

from transformers import MiniMaxM2Config, MiniMaxM2ForCausalLM

from moe_sft.models import common
from moe_sft.models import shape as S
from moe_sft.models.family import Family, Rule, UnsupportedConfigError
from moe_sft.models.hf_config import check_no_attention_bias, check_rope_default, num_experts, rope_parameters

FP8_FORMATS = (None, "e4m3", "float8_e4m3fn")


def is_moe_layer(cfg, i: int) -> bool:
    return True  # MiniMaxM2DecoderLayer: always a sparse MoE block


def rotary_dim(cfg) -> int:
    """transformers' `int(head_dim * partial_rotary_factor)` (MiniMaxM2RotaryEmbedding); a
    config.json dict (shape(), the planner) may still hold the released `rotary_dim` instead."""
    c = S.config_view(cfg)
    head_dim = int(c.head_dim or c.hidden_size // c.num_attention_heads)
    legacy = getattr(c, "rotary_dim", None)
    factor = rope_parameters(c).get("partial_rotary_factor") or (legacy / head_dim if legacy else 1.0)
    return int(head_dim * factor)


def _refuse(field: str, value, fix: str) -> None:
    raise UnsupportedConfigError(f"config.json: {field}={value!r} is not supported for MiniMax-M2; {fix}")


# Fields of the released config.json (read by MiniMax's remote code, ignored by transformers'
# MiniMaxM2 classes) with the only value transformers' model computes.
_FIXED = {
    "use_qk_norm": (True, "transformers' MiniMax-M2 always applies q_norm / k_norm"),
    "qk_norm_type": ("per_layer", "only the norm over all heads of a layer ('per_layer') is implemented"),
    "scoring_func": ("sigmoid", "MiniMax-M2 routes with sigmoid scores"),
    "use_routing_bias": (True, "MiniMax-M2's router always adds e_score_correction_bias"),
    "shared_intermediate_size": (0, "MiniMax-M2 has no shared experts"),
    "postnorm": (False, "MiniMax-M2 uses pre-norm layers"),
}


def check_supported(cfg) -> None:
    if getattr(cfg, "hidden_act", "silu") != "silu":
        _refuse("hidden_act", cfg.hidden_act, "MiniMax-M2 uses 'silu'.")
    if getattr(cfg, "router_jitter_noise", 0.0):
        _refuse("router_jitter_noise", cfg.router_jitter_noise, "set it to 0.")
    if getattr(cfg, "sliding_window", None):
        _refuse("sliding_window", cfg.sliding_window, "MiniMax-M2 uses full attention; set it to null.")
    for field, (value, why) in _FIXED.items():
        given = getattr(cfg, field, None)
        if given is not None and given != value:
            _refuse(field, given, f"{why} ({field}={value!r}).")
    scaling = getattr(cfg, "routed_scaling_factor", None)
    if scaling not in (None, 1, 1.0):
        _refuse("routed_scaling_factor", scaling, "transformers' MiniMaxM2TopKRouter applies no scaling; remove it.")
    kinds = set(getattr(cfg, "attn_type_list", None) or [1])
    if kinds != {1}:
        _refuse("attn_type_list", sorted(kinds), "only full softmax attention (1) layers; 0 is lightning attention.")
    check_rope_default(cfg)
    head_dim = cfg.head_dim or cfg.hidden_size // cfg.num_attention_heads
    rot = rotary_dim(cfg)
    if rot <= 0 or rot > head_dim or rot % 2:
        _refuse(
            "rope_parameters.partial_rotary_factor (rotary_dim)",
            rope_parameters(cfg).get("partial_rotary_factor", getattr(cfg, "rotary_dim", None)),
            f"the rotary dim int(head_dim * factor) = {rot} must be even and within 1..head_dim={head_dim}.",
        )
    check_no_attention_bias(cfg, "MiniMax-M2")
    _check_quantization(cfg)


def _check_quantization(cfg) -> None:
    quant = getattr(cfg, "quantization_config", None)
    if not quant:
        return
    quant = quant if isinstance(quant, dict) else quant.to_dict()
    if quant.get("quant_method") != "fp8":
        _refuse("quantization_config.quant_method", quant.get("quant_method"), "only block FP8 ('fp8') sources.")
    if quant.get("fmt") not in FP8_FORMATS:
        _refuse("quantization_config.fmt", quant.get("fmt"), "only e4m3 (float8_e4m3fn).")
    block = quant.get("weight_block_size")
    if block is not None and len(block) != 2:
        _refuse("quantization_config.weight_block_size", block, "two block dims (the release: [128, 128]).")


def num_declared_mtp_modules(cfg) -> int:
    if getattr(cfg, "use_mtp", True) is False:
        return 0
    return int(getattr(cfg, "num_mtp_modules", 0) or 0)


def dropped_for_config(cfg) -> dict[str, str]:
    """The declared MTP modules `model.layers.{N + k}.*`: not converted (module docstring)."""
    n, mtp = cfg.num_hidden_layers, num_declared_mtp_modules(cfg)
    if not mtp:
        return {}
    layers = "|".join(str(n + k) for k in range(mtp))
    why = (
        f"MiniMax-M2 MTP modules (num_mtp_modules={mtp}, model.layers.{n}..{n + mtp - 1}): transformers' "
        "model has none and their layout is not documented, so MTP is dropped and training runs without it"
    )
    return {rf"model\.layers\.({layers})\..*": why}


def _routing_config(cfg) -> dict:
    """MiniMaxM2TopKRouter (module docstring). megatron's sigmoid router renormalises exactly when
    top-k > 1; transformers' always does (at top-1 the weight is 1)."""
    topk = cfg.num_experts_per_tok
    return dict(
        moe_router_topk=topk,
        moe_router_score_function="sigmoid",
        moe_router_enable_expert_bias=True,
        moe_router_normalize_topk=None if topk > 1 else True,
    )


def transformer_config_kwargs(cfg) -> dict:
    return dict(
        common.gqa_swiglu_config(cfg, ffn_hidden_size=cfg.intermediate_size),
        qk_layernorm=True,
        qk_norm_full_width=True,
        num_moe_experts=num_experts(cfg),
        moe_ffn_hidden_size=cfg.intermediate_size,
        **_routing_config(cfg),
        moe_aux_loss_coeff=cfg.router_aux_loss_coef,
    )


def gpt_model_kwargs(cfg) -> dict:
    head_dim = cfg.head_dim or cfg.hidden_size // cfg.num_attention_heads
    return dict(common.gpt_model_kwargs(cfg), rotary_percent=rotary_dim(cfg) / head_dim)


def shape(cfg, name: str = "model") -> S.ModelShape:
    c = S.config_view(cfg)
    return common.gqa_moe_shape(
        c, name, qk_norm=True, moe_ffn=c.intermediate_size, is_moe_layer=is_moe_layer, qk_norm_full_width=True
    )


def rules(cfg) -> list[Rule]:
    moe = "block_sparse_moe."
    return (
        common.embedding_and_head_rules(cfg)
        + common.gqa_attention_rules(cfg, qk_norm=True)
        + [
            Rule(
                "decoder.layers.{layer}.mlp.router.expert_bias",
                (common.LAYER + moe + "e_score_correction_bias",),
                layers="moe",
            )
        ]
        + common.routed_expert_rules(
            moe + "gate.weight",
            moe + "experts.{expert}.w1.weight",
            moe + "experts.{expert}.w3.weight",
            moe + "experts.{expert}.w2.weight",
        )
    )


# What MiniMax-M2's config.json holds for its remote code (configuration_minimax_m2.py) beyond
# transformers' MiniMaxM2Config; the tiny model declares no MTP module (use_mtp false), as it
# has none. `rotary_dim` and `attn_type_list` follow the tiny config (tiny_hf_config).
RELEASE_REMOTE_FIELDS = {
    "auto_map": {
        "AutoConfig": "configuration_minimax_m2.MiniMaxM2Config",
        "AutoModelForCausalLM": "modeling_minimax_m2.MiniMaxM2ForCausalLM",
    },
    "mtp_transformer_layers": 1,
    "num_mtp_modules": 0,
    "qk_norm_type": "per_layer",
    "scoring_func": "sigmoid",
    "shared_intermediate_size": 0,
    "use_mtp": False,
    "use_qk_norm": True,
    "use_routing_bias": True,
}


def tiny_hf_config(vocab_size: int = 512, **overrides) -> MiniMaxM2Config:
    """A few-MB MiniMax-M2 (dims multiple of 16 for grouped_mm), half-width rotary as released."""
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
        router_aux_loss_coef=0.001,
        rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 5e6, "partial_rotary_factor": 0.5},
        bos_token_id=None,  # the released ids (200034, 200020) lie outside a tiny vocabulary
        eos_token_id=None,
    )
    kwargs.update(overrides)
    cfg = MiniMaxM2Config(**kwargs)
    # the release's own fields, at the tiny model's values: serving engines read them (vLLM:
    # rotary_dim, scoring_func), transformers' class neither writes nor reads them
    release = dict(RELEASE_REMOTE_FIELDS, rotary_dim=rotary_dim(cfg), attn_type_list=[1] * cfg.num_hidden_layers)
    for field, value in release.items():
        if field not in overrides:
            setattr(cfg, field, value)
    return cfg


def sample_hf_config(rng, vocab_size: int) -> MiniMaxM2Config:
    """GQA dims (MHA, GQA, MQA; head_dim unrelated to hidden), rotary dims from 2 to the whole
    head, 2 to 12 experts with top-1 up to all, tied or not, eps, theta."""
    attention = common.sample_attention_shape(rng)
    head_dim = attention["head_dim"]
    rot = 2 * rng.randint(1, head_dim // 2)
    rope_norm = common.sample_rope_and_norm(rng)
    rope_norm["rope_parameters"]["partial_rotary_factor"] = rot / head_dim
    experts = rng.randint(2, 12)
    return MiniMaxM2Config(
        vocab_size=vocab_size,
        num_hidden_layers=rng.randint(1, 3),
        **attention,
        intermediate_size=16 * rng.randint(1, 6),
        num_local_experts=experts,
        num_experts_per_tok=rng.randint(1, experts),
        router_aux_loss_coef=0.001,
        **rope_norm,
    )


FAMILY = Family(
    name="minimax_m2",
    model_types=("minimax_m2",),
    hf_config_class=MiniMaxM2Config,
    hf_model_class=MiniMaxM2ForCausalLM,
    check_supported=check_supported,
    transformer_config_kwargs=transformer_config_kwargs,
    gpt_model_kwargs=gpt_model_kwargs,
    shape=shape,
    rules=rules,
    is_moe_layer=is_moe_layer,
    tiny_hf_config=tiny_hf_config,
    sample_hf_config=sample_hf_config,
    dropped_for_config=dropped_for_config,
    training_defaults={"moe_router_load_balancing_type": "aux_loss"},
    remote_code=Path(__file__).parent / "remote_code" / "minimax_m2",
)
