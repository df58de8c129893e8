"""Name patterns select the parameters megatron's optimizer excludes from weight decay (in-process,
one rank): the recipe's patterns on top of megatron's default (biases and 1-D parameters)."""

from __future__ import annotations

import pytest
import torch

from moe_sft.config import ConfigError
from moe_sft.models import registry
from moe_sft.trainer import freeze


@pytest.fixture(scope="module")
def model():
    from moe_sft.conversion.single_rank import single_rank_model

    family = registry.family_by_name("qwen3_moe")
    torch.manual_seed(0)
    return single_rank_model(family, family.tiny_hf_config(num_hidden_layers=2))


def _no_decay_names(model, patterns) -> set[str]:
    from megatron.core.optimizer import OptimizerConfig, _get_param_groups

    oc = OptimizerConfig(optimizer="adam", lr=1e-3, weight_decay=0.1)
    overrides, _ = freeze.weight_decay_overrides(oc, [model], patterns, "cpu")
    names = {param: name for name, param in freeze.global_named_parameters(model)}
    return {names[p] for g in _get_param_groups([model], oc, overrides) if g["wd_mult"] == 0.0 for p in g["params"]}


def test_patterns_add_to_megatrons_default_exclusions(model):
    default = _no_decay_names(model, [])
    assert default and all(n.endswith(".bias") or "norm" in n or "layernorm" in n for n in default), default
    assert not any("word_embeddings" in n or ".router." in n for n in default)
    more = _no_decay_names(model, ["*word_embeddings*", "*.router.*"])
    added = more - default
    assert "embedding.word_embeddings.weight" in added
    assert {n for n in added if ".router." in n} == {
        "decoder.layers.0.mlp.router.weight",
        "decoder.layers.1.mlp.router.weight",
    }
    assert all("word_embeddings" in n or ".router." in n for n in added)
    assert any(
        n.endswith("linear_qkv.weight") for n, _ in freeze.global_named_parameters(model) if n not in more
    )  # the rest still decays


def test_a_pattern_matching_nothing_is_an_error(model):
    with pytest.raises(ConfigError, match=r"optimizer.no_weight_decay_patterns \['\*embeding\*'\] match no"):
        _no_decay_names(model, ["*embeding*"])
