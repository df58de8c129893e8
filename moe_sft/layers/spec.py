"""Layer specs: Transformer Engine when it imports, else the torch-native spec of this package.

Both produce the same dist-checkpoint keys (the torch-native spec maps its separate norms onto
TE's fused `linear_qkv.layer_norm_weight` / `linear_fc1.layer_norm_weight` names), so a converted
checkpoint loads under either backend.
"""

from __future__ import annotations

from megatron.core.extensions.transformer_engine_spec_provider import TESpecProvider  # noqa: F401
from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
from megatron.core.models.gpt import gpt_layer_specs
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.attention import SelfAttention, SelfAttentionSubmodules
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.mlp import MLP, MLPSubmodules
from megatron.core.transformer.moe.moe_layer import MoELayer, MoESubmodules
from megatron.core.transformer.moe.shared_experts import SharedExpertMLP
from megatron.core.transformer.multi_latent_attention import MLASelfAttention, MLASelfAttentionSubmodules
from megatron.core.transformer.multi_token_prediction import (
    MultiTokenPredictionBlockSubmodules,
    MultiTokenPredictionLayer,
    MultiTokenPredictionLayerSubmodules,
    get_mtp_num_layers_to_build,
)
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.transformer_layer import (
    TransformerLayer,
    TransformerLayerSubmodules,
    get_transformer_layer_offset,
)

from moe_sft.layers.attention import VarlenCoreAttention
from moe_sft.layers.config import is_linear_attention_layer, is_moe_layer_of_config
from moe_sft.layers.experts import TorchGroupedMLP
from moe_sft.layers.full_width_qk_norm import FullWidthKNorm, FullWidthQNorm
from moe_sft.layers.gated_delta_net import GatedDeltaNet
from moe_sft.layers.gemma4_attention import gemma4_attention_spec
from moe_sft.layers.gemma4_layer import Gemma4TransformerLayer
from moe_sft.layers.gemma4_moe import Gemma4MoELayer, Gemma4Router
from moe_sft.layers.norm import Gemma4RMSNorm, LatentRMSNorm, RMSNorm
from moe_sft.layers.router import FamilyRouter


def _dense_mlp_spec() -> ModuleSpec:
    return ModuleSpec(
        module=MLP, submodules=MLPSubmodules(linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear)
    )


def _moe_spec() -> ModuleSpec:
    shared = ModuleSpec(
        module=SharedExpertMLP, submodules=MLPSubmodules(linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear)
    )
    return ModuleSpec(
        module=MoELayer,
        submodules=MoESubmodules(
            experts=ModuleSpec(module=TorchGroupedMLP), shared_experts=shared, router=FamilyRouter
        ),
    )


def _gqa_attention(config: TransformerConfig) -> ModuleSpec:
    q_norm = k_norm = RMSNorm if config.qk_layernorm else IdentityOp
    if getattr(config, "qk_norm_full_width", None):
        q_norm, k_norm = FullWidthQNorm, FullWidthKNorm
    return ModuleSpec(
        module=SelfAttention,
        params={"attn_mask_type": AttnMaskType.causal},
        submodules=SelfAttentionSubmodules(
            linear_qkv=ColumnParallelLinear,
            core_attention=VarlenCoreAttention,
            linear_proj=RowParallelLinear,
            q_layernorm=q_norm,
            k_layernorm=k_norm,
        ),
    )


def _mla_attention(config: TransformerConfig) -> ModuleSpec:
    return ModuleSpec(
        module=MLASelfAttention,
        params={"attn_mask_type": AttnMaskType.causal},
        submodules=MLASelfAttentionSubmodules(
            linear_q_proj=ColumnParallelLinear,
            linear_q_down_proj=ColumnParallelLinear,
            linear_q_up_proj=ColumnParallelLinear,
            linear_kv_down_proj=ColumnParallelLinear,
            linear_kv_up_proj=ColumnParallelLinear,
            core_attention=VarlenCoreAttention,
            linear_proj=RowParallelLinear,
            q_layernorm=LatentRMSNorm,
            kv_layernorm=LatentRMSNorm,
        ),
    )


def torch_layer_spec(config: TransformerConfig, is_moe: bool, linear_attention: bool = False) -> ModuleSpec:
    """One decoder layer built from torch-native modules (GQA, MLA or Gated DeltaNet mixer)."""
    mla = config.multi_latent_attention
    if linear_attention:  # megatron's TE spec fuses the input norm into the GDN's in_proj
        keys_map = {"input_layernorm.": "self_attention.in_proj.layer_norm_"}
        mixer = ModuleSpec(module=GatedDeltaNet)
    elif mla:  # TE fuses the MLA norms into the up projections
        keys_map = {
            "self_attention.q_layernorm.": "self_attention.linear_q_up_proj.layer_norm_",
            "self_attention.kv_layernorm.": "self_attention.linear_kv_up_proj.layer_norm_",
        }
    else:
        keys_map = {"input_layernorm.": "self_attention.linear_qkv.layer_norm_"}
    if not linear_attention:
        mixer = _mla_attention(config) if mla else _gqa_attention(config)
    if not is_moe:  # TE fuses the pre-MLP norm into linear_fc1 only for dense MLPs
        keys_map["pre_mlp_layernorm."] = "mlp.linear_fc1.layer_norm_"
    return ModuleSpec(
        module=TransformerLayer,
        submodules=TransformerLayerSubmodules(
            input_layernorm=RMSNorm,
            self_attention=mixer,
            self_attn_bda=get_bias_dropout_add,
            pre_mlp_layernorm=RMSNorm,
            mlp=_moe_spec() if is_moe else _dense_mlp_spec(),
            mlp_bda=get_bias_dropout_add,
            sharded_state_dict_keys_map=keys_map,
        ),
    )


def gemma4_layer_spec() -> ModuleSpec:
    """A Gemma 4 decoder layer: its attention norms its own output (layers/gemma4_attention.py), the
    router reads the raw residual (identity pre_mlp_layernorm), the MoE block holds the dense MLP as
    its shared expert and five norms, and the layer scales its output (layers/gemma4_moe.py,
    gemma4_layer.py). No key is renamed: Transformer Engine has no Gemma 4 layer to share names with."""
    shared = ModuleSpec(
        module=SharedExpertMLP, submodules=MLPSubmodules(linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear)
    )
    moe = ModuleSpec(
        module=Gemma4MoELayer,
        submodules=MoESubmodules(
            experts=ModuleSpec(module=TorchGroupedMLP), shared_experts=shared, router=Gemma4Router
        ),
    )
    return ModuleSpec(
        module=Gemma4TransformerLayer,
        submodules=TransformerLayerSubmodules(
            input_layernorm=Gemma4RMSNorm,
            self_attention=gemma4_attention_spec(),
            self_attn_bda=get_bias_dropout_add,
            pre_mlp_layernorm=IdentityOp,
            mlp=moe,
            mlp_bda=get_bias_dropout_add,
        ),
    )


def _check_te_covers(config: TransformerConfig) -> None:
    """TE's spec builds megatron's router and fuses MLA's latent norms with layernorm_epsilon."""
    differs = [
        name
        for name in (
            "moe_router_group_score_topk",
            "moe_router_normalize_topk",
            "mla_latent_layernorm_epsilon",
            "qk_norm_full_width",
            "linear_attention_layers",
            "gemma4_attention_layers",
            "gemma4_layers",
            "embedding_multiplier",
            "final_logit_softcapping",
        )
        if getattr(config, name, None) is not None
    ]
    if differs:
        raise ValueError(
            f"model.backend=te: this model needs {', '.join(differs)} (routing or norms "
            "as transformers computes them), which only the torch-native spec implements; "
            "use model.backend=torch"
        )


def decoder_block_spec(config: TransformerConfig, backend: str, vp_stage=None, pp_rank=None):
    """The block spec for the layers of this pipeline stage (and virtual stage)."""
    if backend == "te":
        _check_te_covers(config)
        return gpt_layer_specs.get_gpt_decoder_block_spec(
            config, use_transformer_engine=True, normalization="RMSNorm", vp_stage=vp_stage, pp_rank=pp_rank
        )
    if getattr(config, "gemma4_layers", None):
        specs, final_norm = [gemma4_layer_spec()] * config.num_layers, Gemma4RMSNorm
    else:
        specs = [
            torch_layer_spec(config, is_moe_layer_of_config(config, i), is_linear_attention_layer(config, i))
            for i in range(config.num_layers)
        ]
        final_norm = RMSNorm
    offset = get_transformer_layer_offset(config, vp_stage=vp_stage, pp_rank=pp_rank)
    count = get_num_layers_to_build(config, vp_stage=vp_stage, pp_rank=pp_rank)
    return TransformerBlockSubmodules(layer_specs=specs[offset : offset + count], layer_norm=final_norm)


def mtp_block_spec(config: TransformerConfig, backend: str, vp_stage=None):
    """The multi-token-prediction block for this stage, or None (MTP lives on the last stage).

    As megatron's own builder, each MTP layer's transformer layer has the spec of the last
    decoder layer (for DeepSeek-V3: an MoE layer).
    """
    if not config.mtp_num_layers or get_mtp_num_layers_to_build(config, vp_stage=vp_stage) == 0:
        return None
    if backend == "te":
        block = gpt_layer_specs.get_gpt_decoder_block_spec(
            config, use_transformer_engine=True, normalization="RMSNorm", vp_stage=vp_stage
        )
        return gpt_layer_specs.get_gpt_mtp_block_spec(config, block, use_transformer_engine=True, vp_stage=vp_stage)
    layer = torch_layer_spec(config, is_moe_layer_of_config(config, config.num_layers - 1))
    mtp_layer = ModuleSpec(
        module=MultiTokenPredictionLayer,
        submodules=MultiTokenPredictionLayerSubmodules(
            enorm=RMSNorm, hnorm=RMSNorm, eh_proj=ColumnParallelLinear, transformer_layer=layer, layer_norm=RMSNorm
        ),
    )
    return MultiTokenPredictionBlockSubmodules(layer_specs=[mtp_layer] * config.mtp_num_layers)
