"""The recipe reaches megatron's TransformerConfig by field name, with no hand relay: every recipe
field named like a TransformerConfig field arrives, null meaning the family's or megatron's default,
and the values derived from other fields (expert TP, a frozen expert bias, activation offload) are
computed in one place."""

from __future__ import annotations

import dataclasses

import pytest
from megatron.core.transformer.transformer_config import TransformerConfig

from moe_sft.config.schema import ModelConfig, ParallelConfig
from moe_sft.models import deepseek_v3, qwen3_moe
from moe_sft.models.builder import ModelOptions, build_transformer_config


def _model(**kw) -> ModelConfig:
    return ModelConfig(mcore_path="/unused", **kw)


def test_every_recipe_field_named_like_megatron_arrives_by_that_name():
    names = {f.name for f in dataclasses.fields(TransformerConfig)}
    model = _model(
        hidden_dropout=0.25,
        moe_aux_loss_coeff=0.02,
        recompute_granularity="selective",
        recompute_modules=["moe_act"],
        moe_expert_capacity_factor=1.5,
        moe_router_dtype="fp64",
    )
    parallel = ParallelConfig(
        tensor_model_parallel_size=2,
        sequence_parallel=True,
        expert_model_parallel_size=4,
        num_layers_in_first_pipeline_stage=3,
    )
    opts = ModelOptions.from_recipe(model, parallel, "fp32", "torch", "cpu")
    for section in (model, parallel):
        for f in dataclasses.fields(section):
            value = getattr(section, f.name)
            if f.name in names and value is not None and f.name != "expert_tensor_parallel_size":
                assert opts.transformer[f.name] == value, f.name
    assert opts.transformer["expert_tensor_parallel_size"] == 2  # null = TP
    assert "hf_path" not in opts.transformer and "freeze_router" not in opts.transformer


def test_null_means_the_default_and_derived_values_are_resolved_once():
    parallel = ParallelConfig(tensor_model_parallel_size=4, expert_tensor_parallel_size=None)
    assert parallel.expert_tp == 4
    assert ParallelConfig(tensor_model_parallel_size=4, expert_tensor_parallel_size=1).expert_tp == 1
    opts = ModelOptions.from_recipe(
        _model(freeze_expert_bias=True, moe_router_dtype=None, activation_offload_modules=["expert_fc1"]),
        ParallelConfig(),
        "fp32",
        "torch",
        "cpu",
    )
    assert opts.transformer["moe_router_bias_update_rate"] == 0.0
    assert opts.transformer["moe_router_dtype"] is None  # null is a value here: the model's dtype
    assert opts.transformer["fine_grained_activation_offloading"] is True
    assert opts.transformer["offload_modules"] == ["expert_fc1"]
    assert "moe_aux_loss_coeff" not in opts.transformer  # null: the HF config's value


@pytest.mark.parametrize("family", [qwen3_moe.FAMILY, deepseek_v3.FAMILY], ids=lambda f: f.name)
def test_the_transformer_config_holds_the_recipe_values(family):
    hf_cfg = family.tiny_hf_config()
    model = _model(
        hidden_dropout=0.1, moe_token_dispatcher_type="auto", recompute_granularity="full", moe_aux_loss_coeff=0.003
    )
    config = build_transformer_config(
        family, hf_cfg, ModelOptions.from_recipe(model, ParallelConfig(), "fp32", "torch", "cpu")
    )
    assert config.hidden_dropout == 0.1 and config.moe_aux_loss_coeff == 0.003
    assert config.moe_token_dispatcher_type == "allgather"  # auto on CPU
    assert (config.recompute_method, config.recompute_num_layers) == ("uniform", 1)  # full's defaults
    default = build_transformer_config(family, hf_cfg, ModelOptions())
    assert default.hidden_dropout == 0.0 and default.moe_router_dtype == "fp32"
