"""Every shipped recipe composes into the schema, and trainer.output_dir / trainer.max_steps
overrides work for each (the interface other tools rely on)."""

from __future__ import annotations

from pathlib import Path

import pytest

from moe_sft.config import load_config

RECIPES = sorted(p.stem for p in (Path(__file__).resolve().parents[2] / "recipes").glob("*.yaml"))


def test_the_family_recipes_are_shipped():
    assert {"quickstart", "qwen3_30b_a3b", "mixtral_8x7b", "deepseek_v3"} <= set(RECIPES)


@pytest.mark.parametrize("name", RECIPES)
def test_recipe_loads_with_overrides(name, monkeypatch):
    monkeypatch.chdir(Path(__file__).resolve().parents[2])
    cfg = load_config(
        ["--config-path", "recipes", "--config-name", name, "trainer.output_dir=/tmp/x", "trainer.max_steps=7"]
    )
    assert cfg.trainer.output_dir == "/tmp/x" and cfg.trainer.max_steps == 7
    assert cfg.model.moe_expert_capacity_factor is None  # dropless unless asked
    # each family's own balancing: aux loss (Qwen3, Mixtral); bias + sequence aux (DeepSeek-V3)
    expected = "seq_aux_loss" if name.startswith("deepseek") else "aux_loss"
    assert cfg.model.moe_router_load_balancing_type == expected
