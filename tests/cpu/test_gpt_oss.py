"""gpt-oss pieces the registry-wide family tests (test_families.py, test_config_space.py) do not
reach: the expert layout transforms, the per-layer attention pattern, and the configs refused."""

from __future__ import annotations

import pytest
import torch

from moe_sft.models import gpt_oss
from moe_sft.models.family import UnsupportedConfigError


@pytest.mark.parametrize(
    "transform, shape",
    [(gpt_oss.GPT_OSS_FC1, (3, 8, 12)), (gpt_oss.GPT_OSS_FC1_BIAS, (3, 12)), (gpt_oss.GPT_OSS_FC2, (3, 6, 8))],
)
def test_expert_transforms_are_bit_exact_inverses(transform, shape):
    hf = torch.randn(shape, dtype=torch.bfloat16)
    ctx = {"num_experts": shape[0]}
    back = transform.to_hf(transform.from_hf([hf], ctx), ctx)
    assert len(back) == 1 and torch.equal(back[0], hf)


def test_fc1_columns_are_deinterleaved_into_gate_then_up_per_expert():
    experts, hidden, ffn = 2, 3, 4
    hf = torch.arange(experts * hidden * 2 * ffn, dtype=torch.float32).view(experts, hidden, 2 * ffn)
    w1 = gpt_oss.GPT_OSS_FC1.from_hf([hf], {"num_experts": experts})
    w_EH2F = w1.view(experts, hidden, 2 * ffn)  # GroupedMLP's view of weight1
    for e in range(experts):
        assert torch.equal(w_EH2F[e, :, :ffn], hf[e, :, 0::2])  # gate: HF's even columns
        assert torch.equal(w_EH2F[e, :, ffn:], hf[e, :, 1::2])  # up: the odd ones
    bias = torch.arange(experts * 2 * ffn, dtype=torch.float32).view(experts, 2 * ffn)
    b1 = gpt_oss.GPT_OSS_FC1_BIAS.from_hf([bias], {})
    assert torch.equal(b1[:, :ffn], bias[:, 0::2]) and torch.equal(b1[:, ffn:], bias[:, 1::2])


def test_layer_types_give_megatrons_window_pattern_and_the_sinks():
    cfg = gpt_oss.tiny_hf_config(
        num_hidden_layers=4,
        sliding_window=16,
        layer_types=["sliding_attention", "full_attention", "full_attention", "sliding_attention"],
    )
    kwargs = gpt_oss.transformer_config_kwargs(cfg)
    assert kwargs["window_size"] == (15, 0)  # a query sees itself and the 15 keys before it
    assert kwargs["window_attn_skip_freq"] == [1, 0, 0, 1]
    assert kwargs["softmax_type"] == "learnable"
    assert (kwargs["glu_linear_offset"], kwargs["activation_func_clamp_value"]) == (
        1.0,
        7.0,
    )  # the released value, the default
    full = gpt_oss.transformer_config_kwargs(gpt_oss.tiny_hf_config(layer_types=["full_attention"] * 2))
    assert full["window_size"] is None


@pytest.mark.parametrize(
    "overrides, field",
    [
        ({"swiglu_alpha": 1.5}, "swiglu_alpha"),
        ({"attention_bias": False}, "attention_bias"),
        ({"layer_types": ["chunked_attention", "full_attention"]}, "layer_types"),
        (
            {
                "rope_parameters": {
                    "rope_type": "yarn",
                    "factor": 4.0,
                    "truncate": True,
                    "original_max_position_embeddings": 64,
                    "rope_theta": 1e4,
                }
            },
            "truncate",
        ),
    ],
)
def test_configs_it_cannot_honour_are_refused_naming_the_field(overrides, field):
    cfg = gpt_oss.tiny_hf_config()
    for key, value in overrides.items():
        setattr(cfg, key, value)
    with pytest.raises(UnsupportedConfigError, match=field):
        gpt_oss.check_supported(cfg)


def test_sliding_layers_count_only_the_pairs_inside_the_window():
    from moe_sft.models import shape as S

    for n, window in ((5, 8), (8, 8), (20, 8), (1, 1), (7, 1)):
        brute = sum(1 for q in range(n) for k in range(q + 1) if q - k < window)
        assert S.attention_pairs([n], window=window) == brute
    cfg = gpt_oss.tiny_hf_config(num_hidden_layers=4, sliding_window=16)
    s = gpt_oss.shape(cfg)
    assert s.attention_windows == (16, None, 16, None)  # HF's default layer_types alternate
    seqlens = [100, 7]
    assert S.attention_layer_pairs(s, seqlens) == 2 * S.attention_pairs(seqlens) + 2 * S.attention_pairs(
        seqlens, window=16
    )


def test_the_planner_shape_and_the_built_model_s_shape_agree():
    from moe_sft.models.builder import ModelOptions, build_transformer_config
    from moe_sft.models.shape import ModelShape

    cfg = gpt_oss.tiny_hf_config(num_hidden_layers=4)
    tconfig = build_transformer_config(gpt_oss.FAMILY, cfg, ModelOptions())
    built = ModelShape.from_config(tconfig, cfg.vocab_size, model_type="gpt_oss")
    planned = gpt_oss.shape(cfg)
    for field in ("attention_windows", "linear_bias", "attention_sinks", "qkv_bias", "num_experts", "moe_ffn"):
        assert getattr(built, field) == getattr(planned, field), field
