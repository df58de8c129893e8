"""gpt-oss (20B, 120B): HF config → megatron TransformerConfig, weight map.

Faithful to transformers' `GptOssForCausalLM`:
- GQA attention with q/k/v/o biases and a learned sink logit per head. megatron expresses the
  sinks as `softmax_type="learnable"`, whose `softmax_offset` our core attention owns
  (moe_sft/layers/attention.py).
- Sliding-window (`sliding_window`) and full-attention layers, as `layer_types` lists them
  (megatron: `window_size` with a per-layer `window_attn_skip_freq` pattern).
- YaRN RoPE over the whole head, without truncating the correction range (`truncate: false`).
- Every layer MoE. The router has a bias and takes the softmax of the top-k logits (megatron's
  default: top-k, then softmax).
- Experts with biases and the clamped SwiGLU: gate clamped above at `swiglu_limit`, up clamped to
  ±limit, (up + 1) · gate · σ(1.702 gate). megatron: quick_gelu with `glu_linear_offset=1` and
  `activation_func_clamp_value` (moe_sft/layers/experts.py).
- HF stacks each layer's experts in one tensor, fc1 with gate and up columns interleaved:
  `GPT_OSS_FC1` de-interleaves them into megatron's [gate | up] halves. The released
  checkpoints store the expert weights in MXFP4; moe_sft/conversion/mxfp4.py dequantises them as
  they are read.
"""

from __future__ import annotations

import torch
from megatron.core.activations import quick_gelu
from transformers import GptOssConfig, GptOssForCausalLM

from moe_sft.models import common
from moe_sft.models import shape as S
from moe_sft.models import transforms as T
from moe_sft.models.family import Family, Rule, UnsupportedConfigError
from moe_sft.models.hf_config import num_experts, rope_parameters, yarn_mscales

L = common.LAYER
SWIGLU_ALPHA = 1.702  # quick_gelu's constant: megatron has no other
SWIGLU_LIMIT = 7.0  # every released checkpoint's; transformers < 5.24 hard-codes it (no config field)
HF_READS_SWIGLU_LIMIT = hasattr(GptOssConfig, "swiglu_limit")


def is_moe_layer(cfg, i: int) -> bool:
    return True


def _layer_types(cfg) -> list[str]:
    types = getattr(cfg, "layer_types", None)
    if types:
        return list(types)
    return ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(cfg.num_hidden_layers)]


def check_supported(cfg) -> None:
    alpha = float(getattr(cfg, "swiglu_alpha", SWIGLU_ALPHA))
    if alpha != SWIGLU_ALPHA:
        raise UnsupportedConfigError(
            f"config.json: swiglu_alpha={alpha} is not supported; megatron's quick_gelu has {SWIGLU_ALPHA}."
        )
    rope = rope_parameters(cfg)
    if rope.get("rope_type", "default") not in ("default", "yarn"):
        raise UnsupportedConfigError(
            f"config.json: rope type {rope['rope_type']!r} is not supported for gpt-oss; use default or yarn."
        )
    if rope.get("rope_type") == "yarn" and rope.get("truncate", True) is not False:
        raise UnsupportedConfigError(
            "config.json: rope_parameters.truncate must be false for gpt-oss (the released models' value)."
        )
    unknown = sorted(set(_layer_types(cfg)) - {"sliding_attention", "full_attention"})
    if unknown:
        raise UnsupportedConfigError(
            f"config.json: layer_types has {unknown}; gpt-oss layers are sliding_attention or full_attention."
        )
    if not getattr(cfg, "attention_bias", True):
        raise UnsupportedConfigError(
            "config.json: attention_bias=false is not supported; gpt-oss biases q, k, v and o_proj."
        )


def _rope_kwargs(cfg) -> dict:
    rope = rope_parameters(cfg)
    if rope.get("rope_type", "default") != "yarn":
        return {}
    mscale, mscale_all_dim = yarn_mscales(rope)
    return dict(
        yarn_rotary_scaling_factor=float(rope["factor"]),
        yarn_original_max_position_embeddings=int(rope["original_max_position_embeddings"]),
        yarn_beta_fast=float(rope.get("beta_fast") or 32),
        yarn_beta_slow=float(rope.get("beta_slow") or 1),
        yarn_mscale=mscale,
        yarn_mscale_all_dim=mscale_all_dim,
        yarn_correction_range_round_to_int=False,
    )


def transformer_config_kwargs(cfg) -> dict:
    types = _layer_types(cfg)
    return dict(
        common.gqa_swiglu_config(cfg, ffn_hidden_size=cfg.intermediate_size),
        add_bias_linear=True,
        add_qkv_bias=True,
        activation_func=quick_gelu,
        glu_linear_offset=1.0,
        activation_func_clamp_value=float(getattr(cfg, "swiglu_limit", SWIGLU_LIMIT)),
        bias_activation_fusion=False,
        qk_layernorm=False,
        softmax_type="learnable",
        window_size=(int(cfg.sliding_window) - 1, 0) if "sliding_attention" in types else None,
        window_attn_skip_freq=[1 if t == "sliding_attention" else 0 for t in types],
        num_moe_experts=num_experts(cfg),
        moe_ffn_hidden_size=cfg.intermediate_size,
        **common.softmax_routing_config(cfg.num_experts_per_tok, normalize=True),
        moe_aux_loss_coeff=cfg.router_aux_loss_coef,
        **_rope_kwargs(cfg),
    )


def gpt_model_kwargs(cfg) -> dict:
    kwargs = common.gpt_model_kwargs(cfg)
    if rope_parameters(cfg).get("rope_type") == "yarn":
        kwargs["position_embedding_type"] = "yarn"
    return kwargs


def shape(cfg, name: str = "model") -> S.ModelShape:
    c = S.config_view(cfg)
    fields = common.gqa_shape_fields(c, name)
    return S.ModelShape(
        **fields,
        qk_norm=False,
        qkv_bias=True,
        linear_bias=True,
        attention_sinks=True,
        ffn=int(c.intermediate_size),
        moe_ffn=int(c.intermediate_size),
        shared_ffn=0,
        mtp_layers=0,
        moe_layers=tuple(is_moe_layer(c, i) for i in range(fields["num_layers"])),
        attention_windows=tuple(int(c.sliding_window) if t == "sliding_attention" else None for t in _layer_types(c)),
    )


def _fc1_from(ts: T.Tensors, ctx: dict) -> torch.Tensor:
    """gate_up_proj [E, H, 2F], columns gate_0, up_0, gate_1, ... → GroupedMLP.weight1 [H, E*2F]
    (viewed as [E, H, 2F] with the gate half first)."""
    w = ts[0]
    w_EH2F = torch.cat([w[..., 0::2], w[..., 1::2]], dim=-1).contiguous()
    return w_EH2F.view(w.shape[1], -1)


def _fc1_to(t: torch.Tensor, ctx: dict) -> list[torch.Tensor]:
    hidden = t.shape[0]
    w_EH2F = t.reshape(ctx["num_experts"], hidden, -1)
    gate, up = torch.chunk(w_EH2F, 2, dim=-1)
    return [torch.stack([gate, up], dim=-1).reshape(w_EH2F.shape).contiguous()]


def _fc1_bias_from(ts: T.Tensors, ctx: dict) -> torch.Tensor:
    """gate_up_proj_bias [E, 2F] interleaved → [E, 2F] with the gate half first."""
    b = ts[0]
    return torch.cat([b[..., 0::2], b[..., 1::2]], dim=-1).contiguous()


def _fc1_bias_to(t: torch.Tensor, ctx: dict) -> list[torch.Tensor]:
    gate, up = torch.chunk(t, 2, dim=-1)
    return [torch.stack([gate, up], dim=-1).reshape(t.shape).contiguous()]


def _fc2_from(ts: T.Tensors, ctx: dict) -> torch.Tensor:
    """down_proj [E, F, H] (x @ W orientation, as GroupedMLP's) → weight2 [E*F, H]."""
    w = ts[0]
    return w.contiguous().view(-1, w.shape[-1])


def _fc2_to(t: torch.Tensor, ctx: dict) -> list[torch.Tensor]:
    return [t.reshape(ctx["num_experts"], -1, t.shape[-1]).contiguous()]


GPT_OSS_FC1 = T.Transform("gpt_oss_gate_up_deinterleave", _fc1_from, _fc1_to)
GPT_OSS_FC1_BIAS = T.Transform("gpt_oss_gate_up_bias_deinterleave", _fc1_bias_from, _fc1_bias_to)
GPT_OSS_FC2 = T.Transform("gpt_oss_down_stack", _fc2_from, _fc2_to)


def rules(cfg) -> list[Rule]:
    attn, mlp = L + "self_attn.", L + "mlp."
    layer = "decoder.layers.{layer}."
    return (
        common.embedding_and_head_rules(cfg)
        + common.gqa_attention_rules(cfg, qk_norm=False)
        + [
            Rule(layer + "self_attention.linear_proj.bias", (attn + "o_proj.bias",), layers="all"),
            Rule(layer + "self_attention.core_attention.softmax_offset", (attn + "sinks",), layers="all"),
            Rule(layer + "mlp.router.weight", (mlp + "router.weight",), layers="moe"),
            Rule(layer + "mlp.router.bias", (mlp + "router.bias",), layers="moe"),
            Rule(layer + "mlp.experts.weight1", (mlp + "experts.gate_up_proj",), GPT_OSS_FC1, layers="moe"),
            Rule(layer + "mlp.experts.bias1", (mlp + "experts.gate_up_proj_bias",), GPT_OSS_FC1_BIAS, layers="moe"),
            Rule(layer + "mlp.experts.weight2", (mlp + "experts.down_proj",), GPT_OSS_FC2, layers="moe"),
            Rule(layer + "mlp.experts.bias2", (mlp + "experts.down_proj_bias",), layers="moe"),
        ]
    )


def tiny_hf_config(vocab_size: int = 512, **overrides) -> GptOssConfig:
    """A few-MB gpt-oss for tests (dims multiple of 16 for grouped_mm; a window shorter than the
    test documents, so the sliding layers differ from the full ones)."""
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
        sliding_window=16,
        max_position_embeddings=2048,  # = factor x original_max_position_embeddings, as transformers checks
        tie_word_embeddings=False,
        router_aux_loss_coef=0.01,
        rms_norm_eps=1e-5,
        rope_parameters={
            "rope_type": "yarn",
            "factor": 32.0,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "truncate": False,
            "original_max_position_embeddings": 64,
            "rope_theta": 150000.0,
        },
    )
    kwargs.update(overrides)
    return GptOssConfig(**kwargs)


def sample_hf_config(rng, vocab_size: int) -> GptOssConfig:
    layers = rng.randint(1, 4)
    experts = rng.randint(2, 10)
    yarn = rng.random() < 0.7
    rope = {"rope_type": "default", "rope_theta": rng.choice([10000.0, 150000.0, rng.uniform(100.0, 5e4)])}
    if yarn:
        rope.update(
            rope_type="yarn",
            factor=rng.choice([2.0, 8.0, 32.0]),
            beta_fast=rng.choice([16.0, 32.0]),
            beta_slow=rng.choice([1.0, 2.0]),
            truncate=False,
            original_max_position_embeddings=rng.choice([16, 64, 256]),
        )
    return GptOssConfig(
        vocab_size=vocab_size,
        num_hidden_layers=layers,
        **common.sample_attention_shape(rng),
        intermediate_size=16 * rng.randint(1, 6),
        num_local_experts=experts,
        num_experts_per_tok=rng.randint(1, experts),
        sliding_window=rng.choice([4, 8, 16, 64]),
        layer_types=[rng.choice(["sliding_attention", "full_attention"]) for _ in range(layers)],
        # another limit only where the installed transformers' modeling reads it from the config
        swiglu_limit=rng.choice([7.0, 2.0, 1.0]) if HF_READS_SWIGLU_LIMIT else SWIGLU_LIMIT,
        router_aux_loss_coef=0.01,
        rope_parameters=rope,
        rms_norm_eps=rng.choice([1e-6, 1e-5, 1e-3]),
        tie_word_embeddings=rng.random() < 0.3,
        max_position_embeddings=4096,
    )


FAMILY = Family(
    name="gpt_oss",
    model_types=("gpt_oss",),
    hf_config_class=GptOssConfig,
    hf_model_class=GptOssForCausalLM,
    check_supported=check_supported,
    transformer_config_kwargs=transformer_config_kwargs,
    gpt_model_kwargs=gpt_model_kwargs,
    shape=shape,
    rules=rules,
    is_moe_layer=is_moe_layer,
    tiny_hf_config=tiny_hf_config,
    sample_hf_config=sample_hf_config,
    training_defaults={"moe_router_load_balancing_type": "aux_loss"},
)
