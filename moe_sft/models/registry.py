"""HF `model_type` → Family. Unknown types are an error that lists the supported ones."""

from __future__ import annotations

from moe_sft.models import (
    deepseek_v3,
    gemma4,
    glm4_moe,
    gpt_oss,
    kimi_k2,
    minimax_m2,
    mixtral,
    qwen3_5_moe,
    qwen3_moe,
    qwen3_next,
)
from moe_sft.models.family import Family, UnsupportedConfigError

FAMILIES: tuple[Family, ...] = (
    qwen3_moe.FAMILY,
    mixtral.FAMILY,
    deepseek_v3.FAMILY,
    glm4_moe.FAMILY,
    kimi_k2.FAMILY,
    minimax_m2.FAMILY,
    gpt_oss.FAMILY,
    qwen3_next.FAMILY,
    qwen3_5_moe.FAMILY,
    gemma4.FAMILY,
)


def _model_types(family: Family) -> tuple[str, ...]:
    """The family's own types and that of a multimodal checkpoint holding its language model."""
    return family.model_types + ((family.composite.model_type,) if family.composite else ())


def supported_model_types() -> list[str]:
    return sorted(t for f in FAMILIES for t in _model_types(f))


def family_for_model_type(model_type: str, source: str = "config.json") -> Family:
    for family in FAMILIES:
        if model_type in _model_types(family):
            return family
    raise UnsupportedConfigError(
        f"{source}: model_type={model_type!r} is not supported by moe-sft; supported: "
        f"{', '.join(supported_model_types())}."
    )


def family_by_name(name: str) -> Family:
    for family in FAMILIES:
        if family.name == name:
            return family
    raise ValueError(f"unknown model family {name!r}; known: {[f.name for f in FAMILIES]}")
