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


@pytest.mark.parametrize(
    ("requested", "device", "expert_group", "topk", "chosen"),
    [
        ("auto", "cpu", 1, 8, "allgather"),  # alltoall needs CUDA streams
        ("auto", "cpu", 16, 8, "allgather"),
        ("auto", "cuda", 1, 8, "alltoall"),  # alone: a local dispatch with no host wait
        ("auto", "cuda", 2, 8, "allgather"),
        ("auto", "cuda", 8, 8, "allgather"),  # equal rows: the static-size collectives win
        ("auto", "cuda", 16, 8, "alltoall"),  # the gather would move twice the alltoall's rows
        ("auto", "cuda", 4, 2, "alltoall"),  # Mixtral's top-2
        ("alltoall", "cuda", 4, 8, "alltoall"),  # an explicit choice stands
        ("allgather", "cuda", 32, 8, "allgather"),
    ],
)
def test_auto_dispatcher_gathers_where_the_gather_moves_no_more_rows(requested, device, expert_group, topk, chosen):
    from moe_sft.models.builder import token_dispatcher

    assert token_dispatcher(requested, device, expert_group, topk) == chosen


def test_the_transformer_config_takes_the_auto_dispatcher_from_ep_times_expert_tp_and_top_k():
    hf_cfg = qwen3_moe.tiny_hf_config()  # top-k below
    topk = hf_cfg.num_experts_per_tok
    for ep, chosen in ((topk, "allgather"), (2 * topk, "alltoall")):
        opts = ModelOptions.from_recipe(
            _model(), ParallelConfig(expert_model_parallel_size=ep), "bf16", "torch", "cuda"
        )
        assert build_transformer_config(qwen3_moe.FAMILY, hf_cfg, opts).moe_token_dispatcher_type == chosen
