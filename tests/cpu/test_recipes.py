"""Every shipped recipe composes into the schema, and trainer.output_dir / trainer.max_steps
overrides work for each (the interface other tools rely on)."""

from __future__ import annotations

from pathlib import Path

import pytest

from moe_sft.config import load_config
from moe_sft.models import registry
from moe_sft.plan.shapes import load_shape

RECIPES = sorted(p.stem for p in (Path(__file__).resolve().parents[2] / "recipes").glob("*.yaml"))


def test_the_family_recipes_are_shipped():
    assert {"quickstart", "qwen3_30b_a3b", "mixtral_8x7b", "deepseek_v3"} <= set(RECIPES)
    assert {"deepseek_v3_1", "kimi_k2", "glm4_5", "glm4_5_air", "minimax_m2"} <= set(RECIPES)
    assert {"gpt_oss_20b", "gpt_oss_120b", "gpt_oss_120b_h200"} <= set(RECIPES)
    assert {"gemma4_26b_a4b", "gemma4_26b_a4b_h200", "gemma4_26b_a4b_lora", "gemma4_26b_a4b_lora_h200"} <= set(RECIPES)


@pytest.mark.parametrize("name", RECIPES)
def test_recipe_loads_with_overrides(name, monkeypatch):
    monkeypatch.chdir(Path(__file__).resolve().parents[2])
    cfg = load_config(
        ["--config-path", "recipes", "--config-name", name, "trainer.output_dir=/tmp/x", "trainer.max_steps=7"]
    )
    assert cfg.trainer.output_dir == "/tmp/x" and cfg.trainer.max_steps == 7
    assert cfg.model.moe_expert_capacity_factor is None  # dropless unless asked
    # each family's own balancing: aux loss (Qwen3, Mixtral, MiniMax-M2); bias + sequence aux
    # (DeepSeek-V3, Kimi-K2, GLM-4.5); the quickstart's tiny model is a Qwen3-MoE
    assert cfg.model.moe_router_load_balancing_type == _family_balancing(cfg)


def _family_balancing(cfg) -> str:
    if not cfg.model.hf_config:
        return "aux_loss"
    shape, _ = load_shape(cfg.model.hf_config)
    return registry.family_for_model_type(shape.model_type).training_defaults["moe_router_load_balancing_type"]
