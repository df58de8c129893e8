"""Reading HF config fields whose names differ across transformers versions (4.x vs 5.x)."""

from __future__ import annotations

import math

from moe_sft.models.family import UnsupportedConfigError


def num_experts(cfg) -> int:
    for name in ("num_experts", "num_local_experts", "n_routed_experts"):
        value = getattr(cfg, name, None)
        if value:
            return int(value)
    return 0


def rope_parameters(cfg) -> dict:
    params = getattr(cfg, "rope_parameters", None)  # transformers 5
    if params:
        return dict(params)
    legacy = dict(getattr(cfg, "rope_scaling", None) or {})
    legacy.setdefault("rope_theta", getattr(cfg, "rope_theta", 10000.0))
    legacy.setdefault("rope_type", legacy.get("type", "default"))
    return legacy


def rope_theta(cfg) -> float:
    return float(rope_parameters(cfg)["rope_theta"])


def check_rope_default(cfg) -> None:
    rope_type = rope_parameters(cfg).get("rope_type", "default")
    if rope_type not in ("default", None):
        raise UnsupportedConfigError(
            f"config.json: rope type {rope_type!r} (rope_scaling / rope_parameters) is not supported "
            "for this family; remove the rope scaling entry or use a model with default RoPE."
        )


def check_no_attention_bias(cfg, where: str) -> None:
    """megatron biases all attention projections or none (add_qkv_bias / add_bias_linear); an HF
    attention_bias also on the output projection (Qwen3-MoE) or the MLA down projections
    (DeepSeek-V3) has no megatron equivalent."""
    if getattr(cfg, "attention_bias", False):
        raise UnsupportedConfigError(
            f"config.json: attention_bias=true is not supported for {where} (megatron has no bias on "
            "exactly those projections; the released checkpoints use attention_bias=false)"
        )


def yarn_mscales(rope: dict) -> tuple[float, float]:
    """megatron's (mscale, mscale_all_dim) giving transformers' YaRN cos/sin scale.

    transformers scales cos/sin by `attention_factor` when given, else by
    get_mscale(f, mscale) / get_mscale(f, mscale_all_dim) only when both are non-zero, else by
    get_mscale(f) (modeling_rope_utils._compute_yarn_parameters); megatron always by the ratio.
    mscale_all_dim also sets the softmax scale in both models, so it is kept and mscale solved for:
    0.1 * mscale * ln f + 1 = target * get_mscale(f, mscale_all_dim).
    """
    factor, all_dim = float(rope["factor"]), float(rope.get("mscale_all_dim") or 0.0)
    mscale, given = rope.get("mscale"), rope.get("attention_factor")
    if given is None and mscale and all_dim:
        return float(mscale), all_dim
    if factor <= 1:  # get_mscale is 1 whatever its mscale
        return 1.0, all_dim
    log_f = math.log(factor)
    target = float(given) if given is not None else 0.1 * log_f + 1.0
    return (target * (0.1 * all_dim * log_f + 1.0) - 1.0) / (0.1 * log_f), all_dim
