"""Qwen3-Next (Qwen3-Next-80B-A3B): HF config → megatron TransformerConfig, weight map.

Faithful to transformers' `Qwen3NextForCausalLM`: a hybrid stack whose `layer_types` name each
layer's mixer, `linear_attention` (Gated DeltaNet, moe_sft/layers/gated_delta_net.py) or
`full_attention` (gated GQA: q_proj emits each head's query and an output gate,
o_proj(attn * sigmoid(gate)); per-head q/k RMSNorm; partial rotary over int(head_dim *
partial_rotary_factor) dims); every RMSNorm of the stack zero-centred (x * (1 + w)) except the
GDN's gated output norm; MoE with a softmax top-k router and one shared expert scaled by
sigmoid(shared_expert_gate(x)) (megatron's `moe_shared_expert_gate`).

HF tensor layouts this file maps: `in_proj_qkvz` interleaves per key head [q, k, v, z] (each key
head's value heads together) and `in_proj_ba` per key head [b, a]; megatron's in_proj holds
[q, k, v, z, b, a] each whole (split over TP part by part). q_proj interleaves per head [query,
gate]; megatron's gated linear_qkv holds per query group [queries, gates, key, value].

Multi-token prediction (`mtp_num_hidden_layers` in the releases' config.json; transformers neither
loads nor runs it, vLLM's qwen3_next_mtp.py / qwen3_5_mtp.py serve it): the release stores
`mtp.pre_fc_norm_embedding`, `mtp.pre_fc_norm_hidden`, `mtp.fc` [H, 2H], one decoder layer
`mtp.layers.0.*` with gated full attention and the MoE block (named as a main layer's), and
`mtp.norm`; it reuses the main embedding and lm_head. The step,
fc(cat(pre_fc_norm_embedding(embed(t_{i+1})), pre_fc_norm_hidden(h_i))) → layer → norm → lm_head,
with zero-centred norms, is megatron's MTP layer (enorm, hnorm, eh_proj, transformer_layer,
final_layernorm; embedding first in its concatenation too), whose transformer layer is built
with attention (moe_sft/layers/spec.py: mtp_block_spec), never Gated DeltaNet.
"""

from __future__ import annotations

import torch
from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

from moe_sft.models import common, glm4_moe
from moe_sft.models import shape as S
from moe_sft.models import transforms as T
from moe_sft.models.family import Family, Rule, UnsupportedConfigError
from moe_sft.models.hf_config import check_no_attention_bias, num_experts, rope_parameters

LAYER = "model.layers.{layer}."
DECODER = "decoder.layers.{layer}."


def is_moe_layer(cfg, i: int) -> bool:
    mlp_only = set(getattr(cfg, "mlp_only_layers", None) or [])
    step = getattr(cfg, "decoder_sparse_step", 1) or 1
    return i not in mlp_only and num_experts(cfg) > 0 and (i + 1) % step == 0


def layer_types(cfg) -> list[str]:
    types = getattr(cfg, "layer_types", None)
    if types:
        return list(types)
    interval = int(getattr(cfg, "full_attention_interval", 4) or 4)
    return ["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(cfg.num_hidden_layers)]


def is_linear_attention_layer(cfg, i: int) -> bool:
    return layer_types(cfg)[i] == "linear_attention"


def num_mtp_layers(cfg) -> int:
    return int(S.field(cfg, "mtp_num_hidden_layers", default=0) or 0)


def _check_mtp(cfg) -> None:
    mtp = num_mtp_layers(cfg)
    if not mtp:
        return
    if mtp > 1:
        # vLLM's predictor runs its layers in turn under one fc and one set of norms; megatron's
        # MTP layers each have their own, and chain depth after depth.
        raise UnsupportedConfigError(
            f"config.json: mtp_num_hidden_layers={mtp} is not supported (the releases have 1: more layers "
            "share one mtp.fc and its norms, which megatron's MTP layers do not)"
        )
    if S.field(cfg, "mtp_use_dedicated_embeddings", default=False):
        raise UnsupportedConfigError(
            "config.json: mtp_use_dedicated_embeddings=true is not supported (the releases' MTP module "
            "shares the main embedding, as megatron's does)"
        )
    if not all(is_moe_layer(cfg, i) for i in range(cfg.num_hidden_layers + mtp)):
        # The released MTP layer carries the MoE block; megatron builds it like the last decoder
        # layer, and vLLM picks its MLP by the index 0 of `mtp.layers.0`: with every layer MoE
        # all three agree.
        raise UnsupportedConfigError(
            f"config.json: decoder_sparse_step={getattr(cfg, 'decoder_sparse_step', 1)!r} / mlp_only_layers="
            f"{getattr(cfg, 'mlp_only_layers', None)!r} with mtp_num_hidden_layers={mtp} is not supported "
            "(the MTP layer is MoE as in the releases: every layer must be MoE)"
        )


def check_supported(cfg) -> None:
    if getattr(cfg, "hidden_act", "silu") != "silu":
        raise UnsupportedConfigError(
            f"config.json: hidden_act={cfg.hidden_act!r} is not supported; Qwen3-Next uses 'silu'."
        )
    rope_type = rope_parameters(cfg).get("rope_type", "default")
    if rope_type not in ("default", None):
        raise UnsupportedConfigError(
            f"config.json: rope_parameters.rope_type={rope_type!r} is not supported (the releases use default RoPE)."
        )
    check_no_attention_bias(cfg, "Qwen3-Next (it biases q, k, v and o_proj)")
    if not getattr(cfg, "shared_expert_intermediate_size", 0):
        raise UnsupportedConfigError(
            "config.json: shared_expert_intermediate_size=0 is not supported (transformers still builds the "
            "shared expert's gate; the releases have a shared expert)"
        )
    unknown = sorted(set(layer_types(cfg)) - {"linear_attention", "full_attention"})
    if unknown or len(layer_types(cfg)) != cfg.num_hidden_layers:
        raise UnsupportedConfigError(
            f"config.json: layer_types={getattr(cfg, 'layer_types', None)!r}: one of 'linear_attention' / "
            f"'full_attention' per layer ({cfg.num_hidden_layers} layers) is supported"
        )
    if cfg.linear_num_value_heads % cfg.linear_num_key_heads:
        raise UnsupportedConfigError(
            f"config.json: linear_num_value_heads={cfg.linear_num_value_heads} must be a multiple of "
            f"linear_num_key_heads={cfg.linear_num_key_heads} (each key head serves whole value heads)"
        )
    rot = glm4_moe.rotary_dim(cfg)
    if rot < 2 or rot % 2 or rot > glm4_moe.head_dim(cfg):
        raise UnsupportedConfigError(
            f"config.json: partial_rotary_factor={glm4_moe.partial_rotary_factor(cfg)} gives {rot} rotary dims "
            f"of head_dim {glm4_moe.head_dim(cfg)}; they must be even, >= 2 and <= head_dim"
        )
    _check_mtp(cfg)


# transformers' Gated DeltaNet input projections, named by the parts of megatron's in_proj
# [q, k, v, z, b, a] each holds: `in_proj_qkvz` (interleaved per key head) and `in_proj_ba`
IN_PROJ_PROJECTIONS = ("qkvz", "ba")


def linear_attention_config(cfg) -> dict:
    """megatron's linear_* fields, which layers run Gated DeltaNet and which transformers
    projections its in_proj fuses (one LoRA A each)."""
    return dict(
        linear_attention_projections=IN_PROJ_PROJECTIONS,
        linear_attention_layers=[i for i in range(cfg.num_hidden_layers) if is_linear_attention_layer(cfg, i)],
        linear_conv_kernel_dim=cfg.linear_conv_kernel_dim,
        linear_key_head_dim=cfg.linear_key_head_dim,
        linear_value_head_dim=cfg.linear_value_head_dim,
        linear_num_key_heads=cfg.linear_num_key_heads,
        linear_num_value_heads=cfg.linear_num_value_heads,
    )


def transformer_config_kwargs(cfg) -> dict:
    return dict(
        common.gqa_swiglu_config(cfg, ffn_hidden_size=cfg.intermediate_size),
        kv_channels=glm4_moe.head_dim(cfg),
        qk_layernorm=True,
        layernorm_zero_centered_gamma=True,
        attention_output_gate=True,
        num_moe_experts=num_experts(cfg),
        moe_ffn_hidden_size=cfg.moe_intermediate_size,
        moe_shared_expert_intermediate_size=cfg.shared_expert_intermediate_size,
        moe_shared_expert_gate=True,
        **common.softmax_routing_config(cfg.num_experts_per_tok, bool(cfg.norm_topk_prob)),
        moe_layer_freq=[1 if is_moe_layer(cfg, i) else 0 for i in range(cfg.num_hidden_layers)],
        moe_aux_loss_coeff=cfg.router_aux_loss_coef,
        **linear_attention_config(cfg),
        mtp_num_layers=num_mtp_layers(cfg) or None,
    )


def gpt_model_kwargs(cfg) -> dict:
    return dict(common.gpt_model_kwargs(cfg), rotary_percent=glm4_moe.partial_rotary_factor(cfg))


def shape(cfg, name: str = "model", projections: tuple[str, ...] = IN_PROJ_PROJECTIONS) -> S.ModelShape:
    c = S.config_view(cfg)
    fields = common.gqa_shape_fields(c, name)
    return S.ModelShape(
        **fields,
        qk_norm=True,
        ffn=int(c.intermediate_size),
        moe_ffn=int(c.moe_intermediate_size),
        shared_ffn=int(S.field(c, "shared_expert_intermediate_size", default=0) or 0),
        moe_layers=tuple(is_moe_layer(c, i) for i in range(fields["num_layers"])),
        mtp_layers=num_mtp_layers(c),
        attention_gate=True,
        shared_expert_gate=bool(S.field(c, "shared_expert_intermediate_size", default=0)),
        linear_attention=S.LinearAttention(
            layers=tuple(is_linear_attention_layer(c, i) for i in range(fields["num_layers"])),
            key_heads=int(c.linear_num_key_heads),
            value_heads=int(c.linear_num_value_heads),
            key_dim=int(c.linear_key_head_dim),
            value_dim=int(c.linear_value_head_dim),
            conv_kernel=int(c.linear_conv_kernel_dim),
            projections=projections,
        ),
    )


# ----------------------------------------------------------------------------- transforms


def _gated_qkv_from(ts, ctx: dict) -> torch.Tensor:
    """q_proj [heads * 2 * D, H] (per head: query, gate), k, v [G * D, H] → per group
    [queries, gates, key, value]."""
    q_and_gate, k, v = ts
    groups, dim = ctx["num_query_groups"], ctx["head_dim"]
    hidden = k.shape[-1]
    per_head = q_and_gate.reshape(groups, -1, 2, dim, hidden)
    q, gate = per_head[:, :, 0], per_head[:, :, 1]
    return torch.cat([q, gate, k.reshape(groups, 1, dim, hidden), v.reshape(groups, 1, dim, hidden)], dim=1).reshape(
        -1, hidden
    )


def _gated_qkv_to(t: torch.Tensor, ctx: dict) -> list[torch.Tensor]:
    groups, dim = ctx["num_query_groups"], ctx["head_dim"]
    hidden = t.shape[-1]
    per_group = t.reshape(groups, -1, dim, hidden)
    heads = (per_group.shape[1] - 2) // 2
    q, gate, k, v = torch.split(per_group, [heads, heads, 1, 1], dim=1)
    q_and_gate = torch.stack([q, gate], dim=2).reshape(-1, hidden)
    return [q_and_gate.contiguous(), k.reshape(-1, hidden).contiguous(), v.reshape(-1, hidden).contiguous()]


GATED_QKV = T.Transform("gated_qkv", _gated_qkv_from, _gated_qkv_to)


def _gdn_dims(ctx: dict) -> tuple[int, int, int, int]:
    return ctx["linear_key_heads"], ctx["linear_value_heads"], ctx["linear_key_dim"], ctx["linear_value_dim"]


def _qkvz_ba_from(ts, ctx: dict) -> torch.Tensor:
    """in_proj_qkvz [per key head: q, k, v, z] and in_proj_ba [per key head: b, a] → megatron's
    in_proj [q, k, v, z, b, a]."""
    qkvz, ba = ts
    kh, vh, kd, vd = _gdn_dims(ctx)
    r, hidden = vh // kh, qkvz.shape[-1]
    q, k, v, z = torch.split(qkvz.reshape(kh, -1, hidden), [kd, kd, r * vd, r * vd], dim=1)
    b, a = torch.split(ba.reshape(kh, 2 * r, hidden), [r, r], dim=1)
    return torch.cat([x.reshape(-1, hidden) for x in (q, k, v, z, b, a)])


def _qkvz_ba_to(t: torch.Tensor, ctx: dict) -> list[torch.Tensor]:
    kh, vh, kd, vd = _gdn_dims(ctx)
    hidden = t.shape[-1]
    q, k, v, z, b, a = torch.split(t, [kh * kd, kh * kd, vh * vd, vh * vd, vh, vh])
    per_head = lambda x: x.reshape(kh, -1, hidden)  # noqa: E731
    qkvz = torch.cat([per_head(x) for x in (q, k, v, z)], dim=1).reshape(-1, hidden)
    ba = torch.cat([per_head(b), per_head(a)], dim=1).reshape(-1, hidden)
    return [qkvz.contiguous(), ba.contiguous()]


QKVZ_BA = T.Transform("gdn_qkvz_ba", _qkvz_ba_from, _qkvz_ba_to)


def transform_context(cfg) -> dict:
    return dict(
        linear_key_heads=cfg.linear_num_key_heads,
        linear_value_heads=cfg.linear_num_value_heads,
        linear_key_dim=cfg.linear_key_head_dim,
        linear_value_dim=cfg.linear_value_head_dim,
    )


# ----------------------------------------------------------------------------- rules


def gated_attention_rules() -> list[Rule]:
    attn = LAYER + "self_attn."
    full = "full_attention"
    return [
        Rule(
            DECODER + "self_attention.linear_qkv.weight",
            (attn + "q_proj.weight", attn + "k_proj.weight", attn + "v_proj.weight"),
            GATED_QKV,
            layers=full,
        ),
        Rule(DECODER + "self_attention.linear_proj.weight", (attn + "o_proj.weight",), layers=full),
        Rule(DECODER + "self_attention.q_layernorm.weight", (attn + "q_norm.weight",), layers=full),
        Rule(DECODER + "self_attention.k_layernorm.weight", (attn + "k_norm.weight",), layers=full),
    ]


def linear_attention_rules(in_proj: tuple[str, ...], transform: T.Transform) -> list[Rule]:
    """The GDN's tensors; `in_proj`: the HF projections megatron's in_proj is made of."""
    gdn, linear = LAYER + "linear_attn.", "linear_attention"
    return [
        Rule(DECODER + "self_attention.in_proj.weight", tuple(gdn + n for n in in_proj), transform, layers=linear),
        Rule(DECODER + "self_attention.conv1d.weight", (gdn + "conv1d.weight",), layers=linear),
        Rule(DECODER + "self_attention.dt_bias", (gdn + "dt_bias",), layers=linear),
        Rule(DECODER + "self_attention.A_log", (gdn + "A_log",), layers=linear),
        Rule(DECODER + "self_attention.out_norm.weight", (gdn + "norm.weight",), layers=linear),
        Rule(DECODER + "self_attention.out_proj.weight", (gdn + "out_proj.weight",), layers=linear),
    ]


def block_rules(cfg) -> list[Rule]:
    """Norms, MoE (router, experts, gated shared expert) and dense MLPs of every decoder layer."""
    shared = [
        Rule(
            DECODER + "mlp.shared_experts.linear_fc1.weight",
            (LAYER + "mlp.shared_expert.gate_proj.weight", LAYER + "mlp.shared_expert.up_proj.weight"),
            T.GATE_UP_FUSE,
            layers="moe",
        ),
        Rule(
            DECODER + "mlp.shared_experts.linear_fc2.weight",
            (LAYER + "mlp.shared_expert.down_proj.weight",),
            layers="moe",
        ),
        Rule(DECODER + "mlp.shared_experts.gate_weight", (LAYER + "mlp.shared_expert_gate.weight",), layers="moe"),
    ]
    return (
        [
            Rule(DECODER + "input_layernorm.weight", (LAYER + "input_layernorm.weight",), layers="all"),
            Rule(DECODER + "pre_mlp_layernorm.weight", (LAYER + "post_attention_layernorm.weight",), layers="all"),
        ]
        + shared
        + common.routed_expert_rules(
            "mlp.gate.weight",
            "mlp.experts.{expert}.gate_proj.weight",
            "mlp.experts.{expert}.up_proj.weight",
            "mlp.experts.{expert}.down_proj.weight",
        )
        + common.dense_mlp_rules()
    )


MTP_LAYER_HF_PREFIX = "mtp.layers.{mtp}."  # the MTP decoder layer: the main layers' rules apply


def mtp_rules(cfg) -> list[Rule]:
    """The MTP module's own tensors (one MTP layer: `_check_mtp`); its decoder layer is mapped by
    the decoder rules under MTP_LAYER_HF_PREFIX (mapping.expand)."""
    if not num_mtp_layers(cfg):
        return []
    mtp = "mtp.layers.{mtp}."
    return [
        Rule(mtp + "enorm.weight", ("mtp.pre_fc_norm_embedding.weight",), layers="mtp"),
        Rule(mtp + "hnorm.weight", ("mtp.pre_fc_norm_hidden.weight",), layers="mtp"),
        Rule(mtp + "eh_proj.weight", ("mtp.fc.weight",), layers="mtp"),
        Rule(mtp + "final_layernorm.weight", ("mtp.norm.weight",), layers="mtp"),
    ]


def rules(cfg) -> list[Rule]:
    return (
        common.embedding_and_head_rules(cfg)
        + gated_attention_rules()
        + linear_attention_rules(tuple(f"in_proj_{p}.weight" for p in IN_PROJ_PROJECTIONS), QKVZ_BA)
        + block_rules(cfg)
        + mtp_rules(cfg)
    )


# ----------------------------------------------------------------------------- tiny and sampled configs


# The tiny hybrid model's dims (Qwen3.5's tiny config shares them): three GDN layers and one
# gated-attention layer (the released pattern). head_dim 128, not 32: at the releases' partial
# rotary factor 0.25 and rope_theta 1e6-1e7, 32 leaves 8 rotary dims, one frequency fast enough to
# tell the tokens of a conversation apart, and the quickstart stayed on its loss plateau (the
# attention can hardly learn where a word sits). 128 gives 32 rotary dims, as Qwen3-MoE's tiny
# model, and the quickstart learns (tests/cpu/test_quickstart_tiny.py, docs/log.md issue 44).
TINY_HYBRID = dict(
    hidden_size=128,
    moe_intermediate_size=64,
    shared_expert_intermediate_size=64,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=128,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=32,
    linear_value_head_dim=32,
    linear_conv_kernel_dim=4,
    num_experts=8,
    num_experts_per_tok=2,
    router_aux_loss_coef=0.01,
    max_position_embeddings=2048,
    tie_word_embeddings=False,
    use_cache=False,  # transformers' hybrid cache fails a forward of linear-attention layers only
)


def tiny_config(config_class, vocab_size: int, rope_theta: float, overrides: dict):
    kwargs = dict(
        TINY_HYBRID,
        vocab_size=vocab_size,
        rope_parameters={"rope_type": "default", "rope_theta": rope_theta, "partial_rotary_factor": 0.25},
    )
    kwargs.update(overrides)
    if "layer_types" not in overrides:
        # The config's own pattern (a full-attention layer every 4th), except that a stack shorter
        # than one period still ends on the gated-attention layer: the quickstart's 2 layers are one
        # GDN and one attention layer. Two GDN layers alone cannot look a word up by position
        # (the quickstart stayed on its plateau), and transformers' generate needs an attention layer.
        kwargs["layer_types"] = None
        kwargs["full_attention_interval"] = min(kwargs.get("full_attention_interval", 4), kwargs["num_hidden_layers"])
    return config_class(**kwargs)


def tiny_hf_config(vocab_size: int = 512, **overrides) -> Qwen3NextConfig:
    """A few-MB Qwen3-Next (TINY_HYBRID, dense MLP width 256 for dense layers)."""
    return tiny_config(Qwen3NextConfig, vocab_size, 1e6, dict(intermediate_size=256, norm_topk_prob=True) | overrides)


def sample_hybrid(rng, vocab_size: int, layers: int) -> dict:
    """A random legal hybrid stack of `layers` layers (the fields Qwen3-Next and Qwen3.5 share)."""
    experts = rng.randint(2, 10)
    key_heads = rng.choice([1, 2, 4])
    return dict(
        vocab_size=vocab_size,
        num_hidden_layers=layers,
        **dict(common.sample_attention_shape(rng), head_dim=rng.choice([8, 16, 32])),
        layer_types=[rng.choice(["linear_attention", "full_attention"]) for _ in range(layers)],
        linear_num_key_heads=key_heads,
        linear_num_value_heads=key_heads * rng.choice([1, 2, 3]),
        linear_key_head_dim=rng.choice([8, 16, 32]),
        linear_value_head_dim=rng.choice([8, 16, 32]),
        linear_conv_kernel_dim=rng.choice([2, 3, 4]),
        moe_intermediate_size=16 * rng.randint(1, 6),
        shared_expert_intermediate_size=rng.choice([16, 32]),
        num_experts=experts,
        num_experts_per_tok=rng.randint(1, experts),
        router_aux_loss_coef=0.01,
        use_cache=False,
        rms_norm_eps=rng.choice([1e-6, 1e-5]),
        tie_word_embeddings=rng.random() < 0.3,
        rope_parameters={
            "rope_type": "default",
            "rope_theta": rng.choice([10000.0, 1e6]),
            "partial_rotary_factor": rng.choice([0.25, 0.5, 1.0]),
        },
    )


def sample_hf_config(rng, vocab_size: int) -> Qwen3NextConfig:
    layers = rng.randint(1, 4)
    return Qwen3NextConfig(
        **sample_hybrid(rng, vocab_size, layers),
        intermediate_size=16 * rng.randint(1, 8),
        norm_topk_prob=rng.random() < 0.5,
        decoder_sparse_step=rng.choice([1, 1, 2]),
        mlp_only_layers=sorted(rng.sample(range(layers), rng.randint(0, layers - 1))),
    )


FAMILY = Family(
    name="qwen3_next",
    model_types=("qwen3_next",),
    hf_config_class=Qwen3NextConfig,
    hf_model_class=Qwen3NextForCausalLM,
    check_supported=check_supported,
    transformer_config_kwargs=transformer_config_kwargs,
    gpt_model_kwargs=gpt_model_kwargs,
    shape=shape,
    rules=rules,
    is_moe_layer=is_moe_layer,
    is_linear_attention_layer=is_linear_attention_layer,
    tiny_hf_config=tiny_hf_config,
    sample_hf_config=sample_hf_config,
    transform_context=transform_context,
    training_defaults={"moe_router_load_balancing_type": "aux_loss"},
    num_mtp_layers=num_mtp_layers,
    mtp_config_field="mtp_num_hidden_layers",
    mtp_layer_hf_prefix=MTP_LAYER_HF_PREFIX,
)
