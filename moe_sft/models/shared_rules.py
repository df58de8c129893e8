"""Mapping rules several families share: shared experts, the router's expert bias, and the
multi-token-prediction (MTP) layers with their copies of the embedding and the LM head
(DeepSeek-V3 and the families built like it: GLM-4.5, Kimi-K2, ...); and their one routing
config (`sigmoid_group_routing_config`).

MTP in HF checkpoints: MTP layer k is stored as `model.layers.{N + k}` (N decoder layers) with
enorm, hnorm, eh_proj, shared_head.norm, a full decoder layer, and copies of the embedding and
lm_head; megatron holds it as `mtp.layers.{k}` and reuses the main embedding and output layer.
The copies hold nothing (T.PAD_VOCAB_MTP_SHARED checks them): GLM-4.6 stores none, which the
engine leaves out (mapping.without_copies).
"""

from __future__ import annotations

from moe_sft.models import common
from moe_sft.models import transforms as T
from moe_sft.models.family import Rule

L = common.LAYER


def embedding_and_head_rules(cfg, num_mtp_layers: int) -> list[Rule]:
    """As every family, plus the MTP layers' embedding / head copies and their own modules."""
    mtp = [f"model.layers.{cfg.num_hidden_layers + k}." for k in range(num_mtp_layers)]
    if not mtp:
        return common.embedding_and_head_rules(cfg)
    embed = ("model.embed_tokens.weight",) + tuple(m + "embed_tokens.weight" for m in mtp)
    head = ("lm_head.weight",) + tuple(m + "shared_head.head.weight" for m in mtp)
    return [
        Rule("embedding.word_embeddings.weight", embed, T.PAD_VOCAB_MTP_SHARED),
        Rule("decoder.final_layernorm.weight", ("model.norm.weight",)),
        Rule("output_layer.weight", head, T.PAD_VOCAB_MTP_SHARED),
        Rule("mtp.layers.{mtp}.enorm.weight", (L + "enorm.weight",), layers="mtp"),
        Rule("mtp.layers.{mtp}.hnorm.weight", (L + "hnorm.weight",), layers="mtp"),
        Rule("mtp.layers.{mtp}.eh_proj.weight", (L + "eh_proj.weight",), layers="mtp"),
        Rule("mtp.layers.{mtp}.final_layernorm.weight", (L + "shared_head.norm.weight",), layers="mtp"),
    ]


def shared_expert_rules(num_shared_experts: int, prefix: str = "mlp.shared_experts.") -> list[Rule]:
    """The shared experts of an MoE layer as megatron's one fused shared MLP. None without shared
    experts: transformers' zero-width shared experts hold no weight (the converter skips tensors
    with no elements and the exporter writes them back)."""
    if not num_shared_experts:
        return []
    return [
        Rule(
            "decoder.layers.{layer}.mlp.shared_experts.linear_fc1.weight",
            (L + prefix + "gate_proj.weight", L + prefix + "up_proj.weight"),
            T.GATE_UP_FUSE,
            layers="moe",
        ),
        Rule(
            "decoder.layers.{layer}.mlp.shared_experts.linear_fc2.weight",
            (L + prefix + "down_proj.weight",),
            layers="moe",
        ),
    ]


def expert_bias_rule(hf_name: str = "mlp.gate.e_score_correction_bias") -> Rule:
    """The aux-loss-free routing bias (megatron's router.expert_bias, moe_router_enable_expert_bias)."""
    return Rule("decoder.layers.{layer}.mlp.router.expert_bias", (L + hf_name,), layers="moe")


HF_GROUP_SCORE_TOPK = 2  # DeepseekV3TopkRouter / Glm4MoeTopkRouter rank a group by its two best scores


def sigmoid_group_routing_config(cfg) -> dict:
    """DeepseekV3TopkRouter (and Glm4MoeTopkRouter, the same code): sigmoid scores, the expert
    bias for the choice only, `topk_group` of `n_group` groups, weights renormalised exactly when
    `norm_topk_prob`, times `routed_scaling_factor`. Where megatron's rule differs
    (layers/router.py), the config says so."""
    topk, groups, kept = cfg.num_experts_per_tok, cfg.n_group, cfg.topk_group
    same_groups = kept >= groups or topk // kept == HF_GROUP_SCORE_TOPK
    normalize = bool(cfg.norm_topk_prob)
    return dict(
        moe_router_topk=topk,
        moe_router_score_function="sigmoid",
        moe_router_enable_expert_bias=True,
        moe_router_topk_scaling_factor=cfg.routed_scaling_factor,
        moe_router_num_groups=groups,
        moe_router_group_topk=kept,
        moe_router_group_score_topk=None if same_groups else HF_GROUP_SCORE_TOPK,
        moe_router_normalize_topk=None if normalize == (topk > 1) else normalize,
    )


def sample_group_routed_moe(rng, groups: int, per_group: int, kept: int, layers: int) -> dict:
    """The MoE fields of a random DeepSeek-V3-style config (`sample_hf_config`): `groups` expert
    groups of `per_group` experts (2+ each: transformers ranks a group by its two best), `kept` of
    them per token, top-1 up to every kept expert, 0..2 shared experts, the router's normalisation
    and scaling, and 0..layers leading dense layers."""
    return dict(
        n_routed_experts=groups * per_group,
        n_group=groups,
        topk_group=kept,
        num_experts_per_tok=rng.randint(1, kept * per_group),
        n_shared_experts=rng.randint(0, 2),
        norm_topk_prob=rng.random() < 0.7,
        routed_scaling_factor=rng.choice([1.0, 2.5, rng.uniform(0.5, 3)]),
        first_k_dense_replace=rng.randint(0, layers),
    )
