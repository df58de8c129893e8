"""Parity with transformers over each family's legal config space (moe_sft/conversion/parity.py):
a fixed-seed sample of random configs per family, and the configs that were wrong before (each
named after what it broke). `python tools/parity_sweep.py` runs the long sweep."""

from __future__ import annotations

import pytest

from moe_sft.conversion import parity
from moe_sft.models import registry

FAMILIES = [f.name for f in registry.FAMILIES]
SAMPLE_SEEDS = range(1000, 1004)  # tools/parity_sweep.py starts at 0: CI checks other draws


def _check(tmp_path, family_name, cfg, seed=0):
    family = registry.family_by_name(family_name)
    family.check_supported(cfg)
    result = parity.check_config(family, cfg, seed, tmp_path)
    print(f"{family_name}: max abs logit diff {result.max_logit_diff:.3e} {result.details}")
    assert result.passed, (result.error, result.max_logit_diff, result.details)
    return result


@pytest.mark.parametrize("family_name", FAMILIES)
def test_random_configs_match_transformers(tmp_path, family_name):
    family = registry.family_by_name(family_name)
    failed = [r for r in parity.sweep(family, SAMPLE_SEEDS) if not r.passed]
    assert not failed, [(r.seed, r.error or r.max_logit_diff, r.details, r.config) for r in failed]


def _deepseek(**overrides):
    return registry.family_by_name("deepseek_v3").tiny_hf_config(vocab_size=301, **overrides)


def test_mla_rope_theta_is_used(tmp_path):
    """megatron's MLA config kept its default base 10000 when the builder dropped rotary_base."""
    _check(tmp_path, "deepseek_v3", _deepseek(rope_parameters={"rope_type": "default", "rope_theta": 50000.0}))


def test_mla_yarn_with_kimi_k2_rope(tmp_path):
    yarn = {
        "rope_type": "yarn",
        "rope_theta": 50000.0,
        "factor": 32.0,
        "original_max_position_embeddings": 32,
        "beta_fast": 1.0,
        "beta_slow": 1.0,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
    }
    _check(tmp_path, "deepseek_v3", _deepseek(rope_parameters=yarn))


def test_yarn_mscale_without_mscale_all_dim(tmp_path):
    """transformers ignores mscale unless mscale_all_dim is non-zero too; megatron used the ratio."""
    yarn = {
        "rope_type": "yarn",
        "rope_theta": 10000.0,
        "factor": 4.0,
        "original_max_position_embeddings": 32,
        "mscale": 0.707,
        "mscale_all_dim": 0.0,
    }
    _check(tmp_path, "deepseek_v3", _deepseek(rope_parameters=yarn))


def test_group_limited_routing_ranks_groups_by_their_top_two(tmp_path):
    """8 groups, 4 kept, 6 experts per token: megatron ranked groups by their top 6 // 4 = 1."""
    _check(tmp_path, "deepseek_v3", _deepseek(n_routed_experts=16, n_group=8, topk_group=4, num_experts_per_tok=6))


@pytest.mark.parametrize("topk,norm", [(3, False), (1, True)])
def test_deepseek_norm_topk_prob_is_honoured(tmp_path, topk, norm):
    """megatron's sigmoid router renormalises exactly when top-k > 1, HF exactly when norm_topk_prob."""
    _check(tmp_path, "deepseek_v3", _deepseek(num_experts_per_tok=topk, norm_topk_prob=norm))


def test_deepseek_without_shared_experts(tmp_path):
    """n_shared_experts=0: transformers builds zero-width shared experts; they convert to none and
    are written back empty (the round trip and the export's loading are checked)."""
    _check(tmp_path, "deepseek_v3", _deepseek(n_shared_experts=0))


def test_mla_latent_norms_use_transformers_epsilon(tmp_path):
    """HF builds q_a_layernorm / kv_a_layernorm with eps 1e-6 whatever rms_norm_eps says."""
    _check(tmp_path, "deepseek_v3", _deepseek(rms_norm_eps=1e-2))


@pytest.mark.parametrize(
    "family_name,overrides",
    [("mixtral", {}), ("qwen3_moe", {"norm_topk_prob": True}), ("qwen3_moe", {"norm_topk_prob": False})],
)
def test_top1_routing(tmp_path, family_name, overrides):
    """megatron's config refused a renormalised softmax top-1 with a traceback."""
    family = registry.family_by_name(family_name)
    _check(tmp_path, family_name, family.tiny_hf_config(vocab_size=301, num_experts_per_tok=1, **overrides))


def test_routing_rule_is_megatrons_for_the_released_configs():
    """The released V3 / K2 routers (8 of 256, 4 of 8 groups, normalised) take megatron's code
    (and the fused kernel on CUDA): nothing is redefined where megatron already agrees."""
    from moe_sft.kernels import routing

    token = routing._ACTIVE.set((None, None))
    try:
        assert routing.routing_rule(8, False, 8, 4, "sigmoid").is_megatrons
        assert routing.routing_rule(8, False, 1, 1, "sigmoid").is_megatrons
    finally:
        routing._ACTIVE.reset(token)
    token = routing._ACTIVE.set((2, None))
    try:
        assert not routing.routing_rule(6, False, 8, 4, "sigmoid").is_megatrons
    finally:
        routing._ACTIVE.reset(token)


def test_verify_default_catches_a_wrong_rope_base(tmp_path):
    """--verify's defaults (lengths 17/33/9, tolerance 1e-3) let a wrong MLA rope base through
    (3.7e-4 with a 4-dim rope head); the defaults now use positions up to 160 and 1e-4."""
    import json

    from moe_sft.conversion.convert import convert
    from moe_sft.conversion.verify import LOGIT_TOLERANCE, verify

    family = registry.family_by_name("deepseek_v3")
    cfg = _deepseek(qk_rope_head_dim=4, rope_parameters={"rope_type": "default", "rope_theta": 50000.0})
    model = parity.perturbed_hf_model(family, cfg, seed=0)
    with parity.cpu_compat.suspended():
        model.save_pretrained(str(tmp_path / "hf"))
    convert(tmp_path / "hf", tmp_path / "mcore")
    assert verify(tmp_path / "hf", tmp_path / "mcore") <= LOGIT_TOLERANCE
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    config["rope_parameters"]["rope_theta"] = 10000.0  # what the MLA bug trained with
    (tmp_path / "hf" / "config.json").write_text(json.dumps(config))
    diff = verify(tmp_path / "hf", tmp_path / "mcore")
    print(f"rope base 10000 vs 50000: max abs logit diff {diff:.3e}")
    assert diff > LOGIT_TOLERANCE
