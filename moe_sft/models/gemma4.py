"""Gemma 4 MoE (26B-A4B) language model: HF config → megatron TransformerConfig, weight map.

Faithful to transformers' `Gemma4ForCausalLM` (`gemma4_text` with `enable_moe_block=True`;
transformers 5.24 models/gemma4/modeling_gemma4.py is the reference). Per decoder layer:

    h = x + post_attention_layernorm(attn(input_layernorm(x)))
    dense = post_feedforward_layernorm_1(mlp(pre_feedforward_layernorm(h)))
    w, idx = router(h)         # norm without scale, * scale * hidden**-0.5, proj, fp32 softmax,
                               # top-k, renormalised, * per_expert_scale[idx]
    moe = post_feedforward_layernorm_2(experts(pre_feedforward_layernorm_2(h), w, idx))
    out = (h + post_feedforward_layernorm(dense + moe)) * layer_scalar

Attention: q/k RMSNorm per head, a v RMSNorm without scale, softmax scale 1.0; sliding layers
(`sliding_window`) use `head_dim` and `num_key_value_heads` with default RoPE, full layers
`global_head_dim` and `num_global_key_value_heads` (transformers keeps both in
`per_layer_config`) with `proportional` RoPE (the first `partial_rotary_factor` of the frequency
pairs over the whole head, the rest unrotated); with `attention_k_eq_v` full layers have no
v_proj and use k_proj's output (before k_norm and RoPE) as V. Embeddings are multiplied by
sqrt(hidden_size) (in the weight's dtype), the LM head is tied, logits may be soft-capped
(`final_logit_softcapping`). Every norm is `x * w` (not Gemma 3's `x * (1 + w)`).

The megatron side this table maps onto (the mapping plan in docs/log.md, 2026-11-29 "issue 45
step 1"; `gemma4_layers` selects the layer spec, layers/spec.py `gemma4_layer_spec`, and
`gemma4_attention_layers` each layer's attention, layers/gemma4_attention.py):

* megatron's TransformerLayer with `pre_mlp_layernorm` an identity and a persistent
  `layer_scalar` buffer multiplying its output (layers/gemma4_layer.py);
* the attention owns its output norm (`self_attention.post_layernorm`), the scale-free v norm,
  per-layer head dims and query groups, k-eq-v (linear_qkv holding [q, k] per group) and its
  per-layer-type RoPE;
* the MLP is megatron's MoELayer (layers/gemma4_moe.py) with the dense MLP as its shared expert
  (`mlp.shared_experts.*`, TP like any dense MLP, experts EP/ETP) and five norms of its own:
  `pre_shared_layernorm` (pre_feedforward_layernorm), `post_shared_layernorm` (_1),
  `pre_experts_layernorm` (pre_feedforward_layernorm_2), `post_experts_layernorm` (_2),
  `post_layernorm` (post_feedforward_layernorm). The router sees the un-normed residual and
  holds `scale` and `per_expert_scale`.

Attention dims differ between sliding and full layers, so the attention rules are written per
layer (the layer index in the names, `layers="none"`), each with its own interleave.
"""

from __future__ import annotations

import math

import torch
from transformers import Gemma4Config, Gemma4ForCausalLM, Gemma4ForConditionalGeneration, Gemma4TextConfig

from moe_sft.layers.config import Gemma4AttentionKind
from moe_sft.models import common
from moe_sft.models import shape as S
from moe_sft.models import transforms as T
from moe_sft.models.family import Composite, Family, Rule, UnsupportedConfigError

L = common.LAYER
DECODER = "decoder.layers.{layer}."
SLIDING, FULL = "sliding_attention", "full_attention"
GLOBAL_HEAD_DIM = 512  # transformers' default of `global_head_dim` (Gemma4TextConfig.__post_init__)
DEFAULT_ROPE = {  # transformers' rope_parameters when a config has none (Gemma4TextConfig.__post_init__)
    SLIDING: {"rope_type": "default", "rope_theta": 10_000.0},
    FULL: {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1_000_000.0},
}


# --- config reading: a transformers config or a config.json dict (shape() needs no torch) -------


def _get(cfg, name: str, default=None):
    value = cfg.get(name) if isinstance(cfg, dict) else getattr(cfg, name, None)
    return default if value is None else value


def layer_types(cfg) -> list[str]:
    """transformers' rule: 5 sliding layers per full one unless listed; the last layer is full."""
    n = int(_get(cfg, "num_hidden_layers"))
    types = list(_get(cfg, "layer_types") or [SLIDING if (i + 1) % 6 else FULL for i in range(n)])
    types[-1] = FULL
    return types


def layer_attention(cfg, i: int) -> tuple[int, int]:
    """(head dim, key/value heads) of decoder layer i.

    A transformers config resolves them through `per_layer_config`; a config.json dict holds
    either that (as transformers 5.24 saves it, keyed by the layer index as a string) or the
    release's `global_head_dim` / `num_global_key_value_heads`.
    """
    if not isinstance(cfg, dict) and hasattr(cfg, "per_layer_config"):
        layer = cfg.per_layer_config[i]
        return int(layer.head_dim), int(layer.num_key_value_heads)
    head_dim, kv_heads = int(_get(cfg, "head_dim", 256)), int(_get(cfg, "num_key_value_heads"))
    if layer_types(cfg)[i] != FULL:
        return head_dim, kv_heads
    per_layer = (_get(cfg, "per_layer_config") or {}).get(str(i)) or (_get(cfg, "per_layer_config") or {}).get(i)
    if per_layer:
        return int(per_layer.get("head_dim", head_dim)), int(per_layer.get("num_key_value_heads", kv_heads))
    global_kv = _get(cfg, "num_global_key_value_heads") if _get(cfg, "attention_k_eq_v", False) else None
    return int(_get(cfg, "global_head_dim", GLOBAL_HEAD_DIM)), int(global_kv or kv_heads)


def k_eq_v(cfg, i: int) -> bool:
    """Layer i takes V from k_proj (transformers' `use_alternative_attention`)."""
    return bool(_get(cfg, "attention_k_eq_v", False)) and layer_types(cfg)[i] == FULL


def attention_kind(cfg, i: int) -> Gemma4AttentionKind:
    """Layer i's attention for moe_sft/layers/gemma4_attention.py: its dims, k-eq-v and the RoPE of
    its layer type (transformers' Gemma4TextRotaryEmbedding: `default` ignores the partial factor)."""
    kind = layer_types(cfg)[i]
    head_dim, kv_heads = layer_attention(cfg, i)
    rope = (_get(cfg, "rope_parameters") or DEFAULT_ROPE).get(kind) or DEFAULT_ROPE[kind]
    return Gemma4AttentionKind(
        head_dim=head_dim,
        num_query_groups=kv_heads,
        k_eq_v=k_eq_v(cfg, i),
        rope_type=rope.get("rope_type", "default"),
        rope_theta=float(rope["rope_theta"]),
        partial_rotary_factor=float(rope.get("partial_rotary_factor", 1.0)),
        rope_factor=float(rope.get("factor", 1.0)),
    )


def is_moe_layer(cfg, i: int) -> bool:
    return True


# --- refusals -------------------------------------------------------------------------------


def check_supported(cfg) -> None:
    """Refuse, by name, what the Gemma 4 MoE releases do not use and moe-sft does not compute."""
    if not _get(cfg, "enable_moe_block", False):
        raise UnsupportedConfigError(
            "config.json: enable_moe_block=false: the dense Gemma 4 models are not MoE; use an MoE release (26B-A4B)"
        )
    checks = [
        ("hidden_size_per_layer_input", lambda v: not v, "per-layer input embeddings (the small dense Gemma 4)"),
        ("num_kv_shared_layers", lambda v: not v, "key/value sharing across layers (the small dense Gemma 4)"),
        ("use_bidirectional_attention", lambda v: v in (None, "vision"), "bidirectional attention over text"),
        ("attention_bias", lambda v: not v, "biases on the attention projections"),
        ("attention_dropout", lambda v: not v, "attention dropout"),
        ("hidden_activation", lambda v: v == "gelu_pytorch_tanh", "an activation other than gelu_pytorch_tanh"),
    ]
    for name, ok, what in checks:
        value = _get(cfg, name)
        if not ok(value):
            raise UnsupportedConfigError(f"config.json: {name}={value!r} is not supported: {what}.")
    unknown = sorted(set(layer_types(cfg)) - {SLIDING, FULL})
    if unknown:
        raise UnsupportedConfigError(f"config.json: layer_types has {unknown}; Gemma 4 layers are {SLIDING} or {FULL}.")
    rope = _get(cfg, "rope_parameters") or {}
    for kind, allowed in ((SLIDING, ("default",)), (FULL, ("default", "proportional"))):
        rope_type = (rope.get(kind) or {}).get("rope_type", "default")
        if kind in layer_types(cfg) and rope_type not in allowed:
            raise UnsupportedConfigError(
                f"config.json: rope_parameters.{kind}.rope_type={rope_type!r} is not supported; use {' or '.join(allowed)}."
            )


# --- megatron config and shape ----------------------------------------------------------------


def transformer_config_kwargs(cfg) -> dict:
    """megatron's TransformerConfig fields and SFTTransformerConfig's Gemma 4 fields: every layer's
    attention (`gemma4_attention_layers`: dims, k-eq-v, RoPE), the Gemma 4 layer, the embedding
    multiplier and the logit soft cap. The base attention dims are the sliding layers'."""
    types = layer_types(cfg)
    head_dim, kv_heads = layer_attention(cfg, types.index(SLIDING)) if SLIDING in types else layer_attention(cfg, 0)
    ffn = int(cfg.intermediate_size)
    return dict(
        num_layers=cfg.num_hidden_layers,
        hidden_size=cfg.hidden_size,
        ffn_hidden_size=ffn,
        num_attention_heads=cfg.num_attention_heads,
        num_query_groups=kv_heads,
        kv_channels=head_dim,
        normalization="RMSNorm",
        layernorm_epsilon=cfg.rms_norm_eps,
        gated_linear_unit=True,
        activation_func=gelu_tanh,
        bias_activation_fusion=False,
        add_bias_linear=False,
        add_qkv_bias=False,
        qk_layernorm=True,
        softmax_scale=1.0,
        init_method_std=cfg.initializer_range,
        window_size=(int(cfg.sliding_window) - 1, 0) if SLIDING in types else None,
        window_attn_skip_freq=[1 if t == SLIDING else 0 for t in types],
        gemma4_attention_layers=tuple(attention_kind(cfg, i) for i in range(len(types))),
        # Sliding and full layers' attention tensors differ in shape, so the dist checkpoint keeps
        # one key per layer (megatron's TransformerBlock.sharded_state_dict) instead of stacking them.
        hetereogenous_dist_checkpoint=True,
        num_moe_experts=int(cfg.num_experts),
        moe_ffn_hidden_size=int(cfg.moe_intermediate_size),
        moe_shared_expert_intermediate_size=ffn,
        **common.softmax_routing_config(int(cfg.top_k_experts), normalize=True),
        gemma4_layers=True,
        # transformers' Gemma4TextScaledWordEmbedding: sqrt(hidden), cast to the weight's dtype
        embedding_multiplier=math.sqrt(int(cfg.hidden_size)),
        final_logit_softcapping=cfg.final_logit_softcapping,
    )


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    """transformers' `gelu_pytorch_tanh`."""
    return torch.nn.functional.gelu(x, approximate="tanh")


def gpt_model_kwargs(cfg) -> dict:
    # RoPE differs per layer type (theta, head dim, proportional): the attention applies it
    # (as MLA's does), GPTModel builds none.
    kwargs = common.gpt_model_kwargs(cfg, rope_in_gpt_model=False)
    kwargs["position_embedding_type"] = "none"
    return kwargs


def shape(cfg, name: str = "model") -> S.ModelShape:
    """The sliding layers' attention dims as the shape's own, every layer's in `attention_layers`
    (full layers: global_head_dim, their kv heads, k-eq-v), the attention's output norm and the
    block's five norms and router scales (plan/params.py counts them exactly)."""
    cfg = text_config(cfg)
    c = S.config_view(cfg)
    fields = S.common_shape_fields(c, name)
    raw = cfg if isinstance(cfg, dict) else c
    types = layer_types(raw)
    head_dim, kv_heads = layer_attention(raw, types.index(SLIDING) if SLIDING in types else 0)
    window = int(c.sliding_window or 512)
    return S.ModelShape(
        **fields,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        qk_norm=True,
        ffn=int(c.intermediate_size),
        moe_ffn=int(c.moe_intermediate_size),
        shared_ffn=int(c.intermediate_size),
        mtp_layers=0,
        moe_layers=tuple(True for _ in range(fields["num_layers"])),
        attention_windows=tuple(window if t == SLIDING else None for t in types),
        attention_layers=tuple(S.LayerAttention(*layer_attention(raw, i), k_eq_v(raw, i)) for i in range(len(types))),
        attention_output_norm=True,
        moe_block_norms=5,
        router_scales=True,
    )


# --- transforms ---------------------------------------------------------------------------------


def attention_transform(groups: int, head_dim: int, with_v: bool) -> T.Transform:
    """q [G*R*D, H], k [G*D, H] (, v [G*D, H]) → linear_qkv [G*(R+2)*D, H] (or [G*(R+1)*D, H]
    for a k-eq-v layer: per group [queries, key], the key also being the value)."""
    parts = 3 if with_v else 2

    def from_hf(ts: T.Tensors, ctx: dict) -> torch.Tensor:
        hidden = ts[0].shape[-1]
        q_GRDH = ts[0].reshape(groups, -1, head_dim, hidden)
        kv = [t.reshape(groups, 1, head_dim, hidden) for t in ts[1:]]
        return torch.cat([q_GRDH, *kv], dim=1).reshape(-1, hidden)

    def to_hf(t: torch.Tensor, ctx: dict) -> list[torch.Tensor]:
        hidden = t.shape[-1]
        per_group = t.reshape(groups, -1, head_dim, hidden)
        split = torch.split(per_group, [per_group.shape[1] - (parts - 1)] + [1] * (parts - 1), dim=1)
        return [x.reshape(-1, hidden).contiguous() for x in split]

    return T.Transform(f"gemma4_q{'kv' if with_v else 'k'}_interleave_g{groups}_d{head_dim}", from_hf, to_hf)


def _fc1_from(ts: T.Tensors, ctx: dict) -> torch.Tensor:
    """gate_up_proj [E, 2F, H] (gate rows first) → GroupedMLP.weight1 [H, E*2F], viewed as
    [E, H, 2F] with the gate half first (transforms.EXPERTS_FC1's layout)."""
    w = ts[0]
    return w.transpose(1, 2).contiguous().view(w.shape[2], -1)


def _fc1_to(t: torch.Tensor, ctx: dict) -> list[torch.Tensor]:
    return [t.reshape(ctx["num_experts"], t.shape[0], -1).transpose(1, 2).contiguous()]


def _fc2_from(ts: T.Tensors, ctx: dict) -> torch.Tensor:
    """down_proj [E, H, F] → GroupedMLP.weight2 [E*F, H] (block e = down_eᵀ)."""
    w = ts[0]
    return w.transpose(1, 2).contiguous().view(-1, w.shape[1])


def _fc2_to(t: torch.Tensor, ctx: dict) -> list[torch.Tensor]:
    return [t.reshape(ctx["num_experts"], -1, t.shape[-1]).transpose(1, 2).contiguous()]


GEMMA4_FC1 = T.Transform("gemma4_gate_up_stack", _fc1_from, _fc1_to)
GEMMA4_FC2 = T.Transform("gemma4_down_stack", _fc2_from, _fc2_to)


# --- the mapping table ----------------------------------------------------------------------------


def attention_rules(cfg) -> list[Rule]:
    """Per layer: its dims (sliding vs full) and whether V is K decide linear_qkv's interleave."""
    rules = []
    for i in range(int(cfg.num_hidden_layers)):
        hf, mc = f"model.layers.{i}.self_attn.", f"decoder.layers.{i}.self_attention."
        head_dim, kv_heads = layer_attention(cfg, i)
        with_v = not k_eq_v(cfg, i)
        projections = ("q_proj", "k_proj", "v_proj") if with_v else ("q_proj", "k_proj")
        rules.append(
            Rule(
                mc + "linear_qkv.weight",
                tuple(f"{hf}{p}.weight" for p in projections),
                attention_transform(kv_heads, head_dim, with_v),
            )
        )
    attn = L + "self_attn."
    return rules + [
        Rule(DECODER + "input_layernorm.weight", (L + "input_layernorm.weight",), layers="all"),
        Rule(DECODER + "self_attention.q_layernorm.weight", (attn + "q_norm.weight",), layers="all"),
        Rule(DECODER + "self_attention.k_layernorm.weight", (attn + "k_norm.weight",), layers="all"),
        Rule(DECODER + "self_attention.linear_proj.weight", (attn + "o_proj.weight",), layers="all"),
        Rule(DECODER + "self_attention.post_layernorm.weight", (L + "post_attention_layernorm.weight",), layers="all"),
    ]


def block_rules() -> list[Rule]:
    """The parallel dense MLP + MoE block and the layer scalar."""
    mlp = DECODER + "mlp."
    norms = (
        ("pre_shared_layernorm", "pre_feedforward_layernorm"),
        ("post_shared_layernorm", "post_feedforward_layernorm_1"),
        ("pre_experts_layernorm", "pre_feedforward_layernorm_2"),
        ("post_experts_layernorm", "post_feedforward_layernorm_2"),
        ("post_layernorm", "post_feedforward_layernorm"),
    )
    return [
        Rule(
            mlp + "shared_experts.linear_fc1.weight",
            (L + "mlp.gate_proj.weight", L + "mlp.up_proj.weight"),
            T.GATE_UP_FUSE,
            layers="all",
        ),
        Rule(mlp + "shared_experts.linear_fc2.weight", (L + "mlp.down_proj.weight",), layers="all"),
        *(Rule(f"{mlp}{m}.weight", (f"{L}{h}.weight",), layers="all") for m, h in norms),
        Rule(mlp + "router.weight", (L + "router.proj.weight",), layers="all"),
        Rule(mlp + "router.scale", (L + "router.scale",), layers="all"),
        Rule(mlp + "router.per_expert_scale", (L + "router.per_expert_scale",), layers="all"),
        Rule(mlp + "experts.weight1", (L + "experts.gate_up_proj",), GEMMA4_FC1, layers="all"),
        Rule(mlp + "experts.weight2", (L + "experts.down_proj",), GEMMA4_FC2, layers="all"),
        Rule(DECODER + "layer_scalar", (L + "layer_scalar",), layers="all"),
    ]


def rules(cfg) -> list[Rule]:
    return common.embedding_and_head_rules(cfg) + attention_rules(cfg) + block_rules()


# --- configs for tests and the parity sweep ----------------------------------------------------------


def tiny_hf_config(vocab_size: int = 512, **overrides) -> Gemma4TextConfig:
    """A few-MB Gemma 4 MoE: a sliding and a k-eq-v full layer with wider heads and one kv head,
    a window shorter than the test documents, soft-capped logits (dims multiples of 16 for
    grouped_mm)."""
    kwargs = dict(
        vocab_size=vocab_size,
        hidden_size=128,
        intermediate_size=96,
        moe_intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        global_head_dim=64,
        num_global_key_value_heads=1,
        attention_k_eq_v=True,
        enable_moe_block=True,
        num_experts=8,
        top_k_experts=2,
        hidden_size_per_layer_input=0,
        num_kv_shared_layers=0,
        sliding_window=16,
        max_position_embeddings=4096,
        final_logit_softcapping=30.0,
        tie_word_embeddings=True,
        rms_norm_eps=1e-6,
    )
    kwargs.update(overrides)
    layers = kwargs["num_hidden_layers"]  # sliding layers, then the full one transformers wants last
    kwargs.setdefault("layer_types", [SLIDING] * (layers - 1) + [FULL])
    return Gemma4TextConfig(**kwargs)


def sample_hf_config(rng, vocab_size: int) -> Gemma4TextConfig:
    """A random legal Gemma 4 MoE config: layer types (the last full), windows, k-eq-v, head dims
    for both layer kinds, partial rotary factors, soft capping on or off."""
    layers = rng.randint(1, 4)
    types = [rng.choice([SLIDING, FULL]) for _ in range(layers - 1)] + [FULL]
    heads = rng.choice([2, 4, 8])
    experts = rng.randint(2, 10)
    return Gemma4TextConfig(
        vocab_size=vocab_size,
        hidden_size=rng.choice([32, 64, 96, 128]),
        intermediate_size=16 * rng.randint(1, 6),
        moe_intermediate_size=16 * rng.randint(1, 4),
        num_hidden_layers=layers,
        layer_types=types,
        num_attention_heads=heads,
        num_key_value_heads=rng.choice([h for h in (1, 2, 4, 8) if heads % h == 0]),
        head_dim=rng.choice([8, 16, 32]),
        global_head_dim=rng.choice([16, 32, 64]),
        num_global_key_value_heads=rng.choice([h for h in (1, 2) if heads % h == 0]),
        attention_k_eq_v=rng.random() < 0.5,
        enable_moe_block=True,
        num_experts=experts,
        top_k_experts=rng.randint(1, experts),
        hidden_size_per_layer_input=0,
        num_kv_shared_layers=0,
        sliding_window=rng.choice([4, 8, 16, 64]),
        final_logit_softcapping=rng.choice([None, 30.0, 5.0]),
        rope_parameters={
            SLIDING: {"rope_type": "default", "rope_theta": rng.choice([10000.0, 1e4 * rng.uniform(0.1, 10)])},
            FULL: {
                "rope_type": rng.choice(["proportional", "default"]),
                "partial_rotary_factor": rng.choice([0.25, 0.5, 1.0]),
                "rope_theta": rng.choice([1e6, 1e4]),
            },
        },
        rms_norm_eps=rng.choice([1e-6, 1e-5, 1e-3]),
        tie_word_embeddings=rng.random() < 0.7,
        max_position_embeddings=4096,
    )


# --- the vision-language releases (Gemma4ForConditionalGeneration) -------------------------------


def text_config(cfg):
    """The language model's config of a vision-language config (object or config.json dict); a
    text-only one is its own."""
    if isinstance(cfg, dict):
        return cfg.get("text_config", cfg) if cfg.get("model_type") == COMPOSITE_TYPE else cfg
    return cfg.text_config if getattr(cfg, "model_type", None) == COMPOSITE_TYPE else cfg


# Towers as small as transformers builds them (one layer each); the clipped linears' bounds and the
# vision standardisation are buffers in the checkpoint, so the tiny model holds them too.
TINY_VISION = dict(
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=1,
    num_attention_heads=2,
    num_key_value_heads=2,
    head_dim=16,
    patch_size=4,
    position_embedding_size=64,
    pooling_kernel_size=2,
    use_clipped_linears=True,
    standardize=True,
)
TINY_AUDIO = dict(
    hidden_size=32,
    num_hidden_layers=1,
    num_attention_heads=2,
    subsampling_conv_channels=[8, 4],
    conv_kernel_size=3,
    output_proj_dims=48,
)


def tiny_vl_hf_config(vocab_size: int = 512, **overrides) -> Gemma4Config:
    """The tiny model as a multimodal release: tiny_hf_config's language model, a one-layer vision
    tower and a one-layer audio tower, each with its embedder into the language model."""
    text = tiny_hf_config(vocab_size, **overrides)
    return Gemma4Config(text_config=text.to_dict(), vision_config=TINY_VISION, audio_config=TINY_AUDIO)


COMPOSITE_TYPE = "gemma4"
COMPOSITE = Composite(
    model_type=COMPOSITE_TYPE,
    hf_model_class=Gemma4ForConditionalGeneration,
    text_config=text_config,
    # transformers' Gemma4Model holds the language model as `language_model`; lm_head stays at the
    # top (tied to the embeddings in the releases, so absent from their files)
    renames=(("model.", "model.language_model."),),
    carried={
        r"model\.vision_tower\..*": "vision tower",
        r"model\.embed_vision\..*": "vision embedder",
        r"model\.audio_tower\..*": "audio tower",
        r"model\.embed_audio\..*": "audio embedder",
    },
    tiny_hf_config=tiny_vl_hf_config,
)


def transform_context(cfg) -> dict:
    """Each layer's key/value heads: an adapter on linear_qkv interleaves its rows per group
    (conversion/adapter_merge.py), and the full layers have their own count."""
    return {"query_groups_per_layer": tuple(layer_attention(cfg, i)[1] for i in range(int(cfg.num_hidden_layers)))}


FAMILY = Family(
    name="gemma4",
    model_types=("gemma4_text",),
    hf_config_class=Gemma4TextConfig,
    hf_model_class=Gemma4ForCausalLM,
    check_supported=check_supported,
    transformer_config_kwargs=transformer_config_kwargs,
    gpt_model_kwargs=gpt_model_kwargs,
    shape=shape,
    rules=rules,
    is_moe_layer=is_moe_layer,
    tiny_hf_config=tiny_hf_config,
    sample_hf_config=sample_hf_config,
    training_defaults={"moe_router_load_balancing_type": "none"},
    composite=COMPOSITE,
    transform_context=transform_context,
)
