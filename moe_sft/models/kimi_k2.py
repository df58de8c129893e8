"""Kimi-K2 (moonshotai/Kimi-K2-*): the DeepSeek-V3 architecture under `model_type: kimi_k2`.

Its config.json names `DeepseekV3ForCausalLM` and an `auto_map` into the repository's own
configuration_deepseek.py / modeling_deepseek.py; transformers has no kimi_k2 class (its Kimi-K2.5
config maps a `kimi_k2` text config onto DeepseekV3Config). moe-sft reads config.json and the
weights only, never that remote code: the config is read into `KimiK2Config`, transformers'
DeepseekV3Config under Kimi's model type (registered with AutoConfig, so hf_source reads it like
any other type), and everything else (translation, rules, shape, MTP) is deepseek_v3.py's.
Because the config keeps `model_type`, `architectures` and `auto_map` as given, the converted
checkpoint's hf/config.json and the exported one say `kimi_k2` again.

Released values (Kimi-K2-Instruct): 61 layers (1 dense), MLA with 64 heads, 384 experts top-8 in
one group, 1 shared expert, routed_scaling_factor 2.827, rope_theta 50000 + YaRN (factor 32,
beta_fast = beta_slow = 1), no MTP layer, FP8 block-quantised weights (dequantised while
converting, conversion/fp8.py). `check_supported` holds every field to DeepSeek-V3's meaning
and names the field that differs.
"""

from __future__ import annotations

from pathlib import Path

from transformers import AutoConfig, DeepseekV3Config, DeepseekV3ForCausalLM
from transformers.conversion_mapping import get_checkpoint_conversion_mapping, register_checkpoint_conversion_mapping
from transformers.models.auto.configuration_auto import CONFIG_MAPPING

from moe_sft.models import deepseek_v3 as ds
from moe_sft.models.family import Family, UnsupportedConfigError
from moe_sft.models.hf_config import num_experts, rope_parameters

MODEL_TYPE = "kimi_k2"


class KimiK2Config(DeepseekV3Config):
    """transformers' DeepseekV3Config under `model_type: kimi_k2` (no new field, no new code)."""

    model_type = MODEL_TYPE


# AutoConfig is how every reader of config.json (conversion, trainer, export, verify) builds the
# config; registering the type there (transformers' public extension point) keeps model_type.
# transformers finds its checkpoint layout (one tensor per expert, as released, fused in memory)
# by model type too: Kimi's is DeepSeek-V3's, as transformers' own kimi_k25 text model uses it.
if MODEL_TYPE not in CONFIG_MAPPING:
    AutoConfig.register(MODEL_TYPE, KimiK2Config)
if get_checkpoint_conversion_mapping(MODEL_TYPE) is None:
    register_checkpoint_conversion_mapping(MODEL_TYPE, get_checkpoint_conversion_mapping("deepseek_v3"))

_REMOTE_CODE = (
    "moe-sft reads config.json and the weights only, never the checkpoint's remote modeling code "
    "(auto_map / trust_remote_code); the model runs as transformers' DeepseekV3ForCausalLM"
)
# Fields only the remote configuration_deepseek.py declares: {field: (allowed values, meaning)}.
# None in allowed: any value (the field does not change the network moe-sft builds).
_REMOTE_FIELDS = {
    "scoring_func": (("sigmoid",), "DeepSeek-V3 scores experts with a sigmoid"),
    "topk_method": (("noaux_tc",), "DeepSeek-V3's bias-steered group-limited top-k"),
    "moe_layer_freq": ((1,), "every layer after first_k_dense_replace is an MoE layer"),
    "ep_size": (None, "inference expert parallelism of the remote code"),
    "seq_aux": (None, "training-only sequence aux loss switch; the recipe sets its own"),
    "aux_loss_alpha": (None, "training-only aux loss weight; the recipe sets moe_aux_loss_coeff"),
    "auto_map": (None, "names the remote code, which is not run"),
    "quantization_config": (None, "checked below"),
}
_YARN_KEYS = {
    "rope_type",
    "type",
    "rope_theta",
    "factor",
    "original_max_position_embeddings",
    "beta_fast",
    "beta_slow",
    "mscale",
    "mscale_all_dim",
    "attention_factor",
    "truncate",
}
_ARCHITECTURES = (None, ["DeepseekV3ForCausalLM"])
_FP8_FORMATS = (None, "e4m3", "float8_e4m3fn")


def _fail(field: str, value, why: str) -> None:
    raise UnsupportedConfigError(f"config.json: {field}={value!r} is not supported for Kimi-K2: {why}.")


# What transformers' config reads and writes, plus what other transformers 5.x versions write for
# DeepSeek-V3 (derived or inference-only fields): a config saved by one version reads in another.
_DEEPSEEK_FIELDS = frozenset(DeepseekV3Config().to_dict()) | {
    "head_dim",
    "qk_head_dim",
    "rope_interleave",
    "output_router_logits",
    "num_mtp_layers",
    "dtype",
    "torch_dtype",
}


def _check_remote_fields(cfg) -> None:
    for field in sorted(set(cfg.to_dict()) - _DEEPSEEK_FIELDS):
        if field not in _REMOTE_FIELDS:
            _fail(
                field,
                getattr(cfg, field, None),
                f"not a field of transformers' DeepseekV3Config nor a known DeepSeek-V3 field; {_REMOTE_CODE}, "
                "so a field only that code understands cannot be honoured (remove it if it does not "
                "change the network)",
            )
        allowed, meaning = _REMOTE_FIELDS[field]
        if allowed is not None and getattr(cfg, field) not in allowed:
            _fail(field, getattr(cfg, field), f"{meaning} ({', '.join(map(repr, allowed))}); {_REMOTE_CODE}")


def _check_quantization(cfg) -> None:
    quant = getattr(cfg, "quantization_config", None)
    if not quant:
        return
    quant = quant if isinstance(quant, dict) else quant.to_dict()
    method = quant.get("quant_method")
    if method != "fp8":
        _fail(
            "quantization_config.quant_method",
            method,
            "the converter reads bf16 or FP8 block-quantised weights (Kimi-K2-Instruct's release); an "
            "INT4 release (Kimi-K2-Thinking's compressed-tensors) must be dequantised to bf16 first",
        )
    if quant.get("fmt") not in _FP8_FORMATS:
        _fail("quantization_config.fmt", quant.get("fmt"), "only e4m3 FP8 weights are dequantised")
    if len(quant.get("weight_block_size") or (128, 128)) != 2:
        _fail("quantization_config.weight_block_size", quant.get("weight_block_size"), "2-D blocks only")


def _check_mla_and_experts(cfg) -> None:
    if cfg.num_key_value_heads not in (None, cfg.num_attention_heads):
        _fail(
            "num_key_value_heads",
            cfg.num_key_value_heads,
            f"multi-latent attention gives each of the num_attention_heads={cfg.num_attention_heads} "
            "heads its own keys and values (no GQA)",
        )
    for field in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
        if not getattr(cfg, field, None) or getattr(cfg, field) <= 0:
            _fail(field, getattr(cfg, field, None), "DeepSeek-V3's multi-latent attention needs it > 0")
    if cfg.q_lora_rank is not None and cfg.q_lora_rank <= 0:
        _fail("q_lora_rank", cfg.q_lora_rank, "null (a plain q projection) or > 0")
    experts, groups = num_experts(cfg), cfg.n_group or 1
    if experts and experts % groups:
        _fail("n_group", cfg.n_group, f"n_routed_experts={experts} must split into equal groups")
    if experts and not 1 <= (cfg.topk_group or 1) <= groups:
        _fail("topk_group", cfg.topk_group, f"between 1 and n_group={groups}")
    if experts and cfg.num_experts_per_tok > (cfg.topk_group or 1) * (experts // groups):
        _fail("num_experts_per_tok", cfg.num_experts_per_tok, "more than the experts of the kept groups")
    if (cfg.pretraining_tp or 1) != 1:
        _fail("pretraining_tp", cfg.pretraining_tp, "only 1 (no sliced projections)")


def check_supported(cfg) -> None:
    """DeepSeek-V3's checks, then every field Kimi's config.json may hold, by name."""
    if getattr(cfg, "architectures", None) not in _ARCHITECTURES:
        _fail("architectures", cfg.architectures, "Kimi-K2 checkpoints are DeepseekV3ForCausalLM")
    ds.check_supported(cfg)
    _check_remote_fields(cfg)
    _check_quantization(cfg)
    _check_mla_and_experts(cfg)
    unknown = sorted(set(rope_parameters(cfg)) - _YARN_KEYS)
    if unknown:
        _fail(f"rope_scaling.{unknown[0]}", rope_parameters(cfg)[unknown[0]], "not a YaRN parameter")


KIMI_ROPE = {
    "rope_type": "yarn",
    "rope_theta": 50000.0,
    "factor": 32.0,
    "original_max_position_embeddings": 4096,
    "beta_fast": 1.0,
    "beta_slow": 1.0,
    "mscale": 1.0,
    "mscale_all_dim": 1.0,
}


def tiny_hf_config(vocab_size: int = 512, **overrides) -> KimiK2Config:
    """deepseek_v3's tiny sizes with Kimi-K2's values: one expert group, one shared expert,
    routed_scaling_factor 2.827, one dense layer, its YaRN rope, no MTP; the release's remote-code
    fields and `auto_map` (deepseek_v3.RELEASE_REMOTE_FIELDS: Kimi's are DeepSeek-V3's)."""
    kwargs = ds.tiny_hf_config(vocab_size).to_dict()
    for key in ("model_type", "transformers_version", "rope_parameters", "head_dim", "qk_head_dim"):  # derived
        kwargs.pop(key, None)
    kwargs.update(
        architectures=["DeepseekV3ForCausalLM"],
        n_group=1,
        topk_group=1,
        n_shared_experts=1,
        routed_scaling_factor=2.827,
        first_k_dense_replace=1,
        num_nextn_predict_layers=0,
        rope_parameters=dict(KIMI_ROPE),
    )
    kwargs.update(overrides)
    return KimiK2Config(**kwargs)


def sample_hf_config(rng, vocab_size: int) -> KimiK2Config:
    """DeepSeek-V3's config space (deepseek_v3.sample_hf_config) under Kimi's model type."""
    kwargs = ds.sample_hf_config(rng, vocab_size).to_dict()
    kwargs.pop("model_type", None)
    kwargs.pop("transformers_version", None)
    return KimiK2Config(**kwargs)


FAMILY = Family(
    name=MODEL_TYPE,
    model_types=(MODEL_TYPE,),
    hf_config_class=KimiK2Config,
    hf_model_class=DeepseekV3ForCausalLM,
    check_supported=check_supported,
    transformer_config_kwargs=ds.transformer_config_kwargs,
    gpt_model_kwargs=ds.gpt_model_kwargs,
    shape=ds.shape,
    rules=ds.rules,
    is_moe_layer=ds.is_moe_layer,
    tiny_hf_config=tiny_hf_config,
    sample_hf_config=sample_hf_config,
    dropped=ds.FAMILY.dropped,
    training_defaults=dict(ds.FAMILY.training_defaults),
    transform_context=ds.FAMILY.transform_context,
    num_mtp_layers=ds.num_mtp_layers,
    mtp_config_field=ds.FAMILY.mtp_config_field,
    remote_code=Path(__file__).parent / "remote_code" / "kimi_k2",
)
