"""Gemma 4 MoE (moe_sft/models/gemma4.py): the mapping table against transformers' own model.

Beside the registry-driven tests (test_families.py, test_config_space.py: the whole model), these
check the table and the math on their own: every tensor of a tiny random `Gemma4ForCausalLM`
consumed exactly once, the bit-exact round trip through the table's transforms, megatron's
expected shapes, the per-layer attention dims, and the refusals.
"""

from __future__ import annotations

import random

import pytest
import torch

from moe_sft.conversion import completeness, mapping
from moe_sft.models import gemma4
from moe_sft.models.family import UnsupportedConfigError
from moe_sft.models.shape import ModelShape

FAMILY = gemma4.FAMILY


def _hf_state(cfg) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    model = FAMILY.hf_model_class(cfg).eval()
    with torch.no_grad():  # transformers initialises norms, scales and layer scalars to 1: randomise
        for name, t in model.state_dict().items():
            if t.is_floating_point() and not name.startswith("lm_head"):
                t.copy_(torch.randn_like(t))
    return {k: v.clone() for k, v in model.state_dict().items()}


def _round_trip(cfg) -> tuple[dict, dict]:
    """HF state → megatron tensors by the table → HF again; returns (megatron, HF back)."""
    state = _hf_state(cfg)
    entries = mapping.expand(FAMILY, cfg)
    completeness.check_hf_coverage(FAMILY, entries, set(state), hf_cfg=cfg)
    ctx = mapping.transform_context(FAMILY, cfg)
    mcore = {e.mcore: e.transform.from_hf([state[n] for n in e.hf], ctx) for e in entries}
    assert len(mcore) == len(entries), "two rules produce one megatron tensor"
    back = dict(mapping.state_to_hf(entries, mcore, ctx))
    for name, t in back.items():
        assert torch.equal(t, state[name]), name
    assert set(back) == set(state) - ({"lm_head.weight"} if cfg.tie_word_embeddings else set())
    return mcore, back


def test_tiny_table_covers_transformers_model_and_round_trips_bit_exactly():
    cfg = FAMILY.tiny_hf_config()
    mcore, _ = _round_trip(cfg)
    hidden, heads = cfg.hidden_size, cfg.num_attention_heads
    # layer 0 sliding: 2 kv heads x 32, q/k/v per group; layer 1 full, k-eq-v: 1 kv head x 64, [q, k]
    assert mcore["decoder.layers.0.self_attention.linear_qkv.weight"].shape == ((heads + 2 * 2) * 32, hidden)
    assert mcore["decoder.layers.1.self_attention.linear_qkv.weight"].shape == ((heads + 1) * 64, hidden)
    assert mcore["decoder.layers.1.self_attention.linear_proj.weight"].shape == (hidden, heads * 64)
    e, f = cfg.num_experts, cfg.moe_intermediate_size
    assert mcore["decoder.layers.0.mlp.experts.weight1"].shape == (hidden, e * 2 * f)
    assert mcore["decoder.layers.0.mlp.experts.weight2"].shape == (e * f, hidden)
    assert mcore["decoder.layers.0.mlp.shared_experts.linear_fc1.weight"].shape == (2 * cfg.intermediate_size, hidden)
    assert mcore["decoder.layers.1.layer_scalar"].shape == (1,)
    assert "output_layer.weight" not in mcore  # tied


def test_expert_layout_is_grouped_mlps():
    """weight1 viewed [E, H, 2F] holds expert e's (gate ‖ up)ᵀ; weight2 viewed [E, F, H] its downᵀ."""
    cfg = FAMILY.tiny_hf_config()
    state = _hf_state(cfg)
    mcore, _ = _round_trip(cfg)
    e, f, h = cfg.num_experts, cfg.moe_intermediate_size, cfg.hidden_size
    w1 = mcore["decoder.layers.0.mlp.experts.weight1"].view(e, h, 2 * f)
    w2 = mcore["decoder.layers.0.mlp.experts.weight2"].view(e, f, h)
    gate_up, down = state["model.layers.0.experts.gate_up_proj"], state["model.layers.0.experts.down_proj"]
    for k in range(e):
        assert torch.equal(w1[k][:, :f], gate_up[k][:f].t())  # the gate half first, as megatron's GLU
        assert torch.equal(w2[k], down[k].t())


def test_query_heads_stay_with_their_group():
    """linear_qkv per group: [its queries, its key(, its value)] — megatron's GQA split."""
    cfg = FAMILY.tiny_hf_config()
    state = _hf_state(cfg)
    mcore, _ = _round_trip(cfg)
    q, k = state["model.layers.0.self_attn.q_proj.weight"], state["model.layers.0.self_attn.k_proj.weight"]
    qkv = mcore["decoder.layers.0.self_attention.linear_qkv.weight"].view(2, 4, 32, -1)  # 2 groups x (2q + k + v)
    assert torch.equal(qkv[1, :2].reshape(-1, cfg.hidden_size), q[64:])
    assert torch.equal(qkv[1, 2], k[32:])


@pytest.mark.parametrize("seed", range(6))
def test_sampled_configs_round_trip(seed):
    cfg = FAMILY.sample_hf_config(random.Random(seed), vocab_size=64)
    FAMILY.check_supported(cfg)
    _round_trip(cfg)


def test_layer_attention_from_config_json_and_transformers_agree():
    """shape() reads config.json dicts (the planner, no torch): the release's global_* fields and
    transformers 5.24's per_layer_config give the same per-layer dims as transformers' config."""
    cfg = FAMILY.tiny_hf_config()
    saved = cfg.to_dict()
    release = {k: v for k, v in saved.items() if k != "per_layer_config"}
    release.update(global_head_dim=64, num_global_key_value_heads=1)
    for i in range(cfg.num_hidden_layers):
        want = (cfg.per_layer_config[i].head_dim, cfg.per_layer_config[i].num_key_value_heads)
        assert gemma4.layer_attention(saved, i) == want
        assert gemma4.layer_attention(release, i) == want
    s = FAMILY.shape(release)
    assert isinstance(s, ModelShape) and s.topk == 2 and s.shared_ffn == 96
    assert s.attention_windows == (16, None)


@pytest.mark.parametrize(
    "override, field",
    [
        (dict(enable_moe_block=False), "enable_moe_block"),
        (dict(hidden_size_per_layer_input=256), "hidden_size_per_layer_input"),
        (dict(num_kv_shared_layers=1), "num_kv_shared_layers"),
        (dict(use_bidirectional_attention="all"), "use_bidirectional_attention"),
        (dict(attention_bias=True), "attention_bias"),
        (dict(hidden_activation="silu"), "hidden_activation"),
    ],
)
def test_refusals_name_the_field(override, field):
    with pytest.raises(UnsupportedConfigError, match=field):
        FAMILY.check_supported(FAMILY.tiny_hf_config(**override))


def test_router_math_equals_transformers_router():
    """layers/gemma4_math: the scale-free norm, scale, hidden**-0.5, fp32 softmax top-k
    renormalised and per_expert_scale give transformers' weights and experts exactly."""
    from transformers.models.gemma4.modeling_gemma4 import Gemma4TextRouter

    from moe_sft.layers import gemma4_math as G

    cfg = FAMILY.tiny_hf_config()
    torch.manual_seed(1)
    router = Gemma4TextRouter(cfg)
    with torch.no_grad():
        for p in router.parameters():
            p.copy_(torch.randn_like(p))
    x = torch.randn(37, cfg.hidden_size)
    _, hf_weights, hf_index = router(x)
    logits = torch.nn.functional.linear(G.router_input(x, router.scale, cfg.rms_norm_eps), router.proj.weight)
    probs, routing_map = G.scaled_topk(logits, router.per_expert_scale, cfg.top_k_experts)
    assert torch.equal(probs.gather(-1, hf_index), hf_weights)
    assert torch.equal(routing_map, torch.zeros_like(routing_map).scatter(-1, hf_index, True))
    assert torch.equal(probs == 0, ~routing_map)


@pytest.mark.parametrize("layer_type", [gemma4.SLIDING, gemma4.FULL])
def test_rope_per_layer_type_through_megatrons_apply(layer_type):
    """Proportional RoPE (full layers: a quarter of the pairs rotated, with frequencies over the
    whole head) and the sliding layers' default RoPE, as megatron's apply_rotary_pos_emb computes
    them from layers/gemma4_math's angles, equal transformers' on every position."""
    from megatron.core.models.common.embeddings.rope_utils import _apply_rotary_pos_emb_bshd
    from transformers.models.gemma4.modeling_gemma4 import Gemma4TextRotaryEmbedding, apply_rotary_pos_emb

    from moe_sft.layers import gemma4_math as G

    cfg = FAMILY.tiny_hf_config()
    rope = cfg.rope_parameters[layer_type]
    head_dim = gemma4.layer_attention(cfg, cfg.layer_types.index(layer_type))[0]
    if rope["rope_type"] == "proportional":
        inv_freq = G.proportional_inv_freq(head_dim, rope["rope_theta"], rope["partial_rotary_factor"])
        assert (inv_freq == 0).sum() == head_dim // 2 - int(rope["partial_rotary_factor"] * head_dim // 2) > 0
    else:
        inv_freq = G.default_inv_freq(head_dim, rope["rope_theta"])
    hf_rope = Gemma4TextRotaryEmbedding(cfg)
    assert torch.equal(inv_freq, getattr(hf_rope, f"{layer_type}_inv_freq"))
    positions = torch.arange(300)
    q = torch.randn(1, positions.numel(), 3, head_dim)
    cos, sin = hf_rope(q, positions[None], layer_type)
    want = apply_rotary_pos_emb(q, cos, sin, unsqueeze_dim=2)[0]
    got = _apply_rotary_pos_emb_bshd(q[0][:, None], G.rotary_freqs(positions, inv_freq), rotary_interleaved=False)
    torch.testing.assert_close(got[:, 0], want, rtol=0, atol=1e-5)


@pytest.mark.parametrize("layer", [0, 1])
def test_linear_qkv_splits_into_transformers_projections(layer):
    """The mapped linear_qkv applied to x and split by layers/gemma4_math.split_qkv gives
    transformers' q_proj(x), k_proj(x) and v_proj(x) (k_proj(x) again on the k-eq-v full layer)."""
    from moe_sft.layers import gemma4_math as G

    cfg = FAMILY.tiny_hf_config()
    state = _hf_state(cfg)
    mcore, _ = _round_trip(cfg)
    head_dim, groups = gemma4.layer_attention(cfg, layer)
    x = torch.randn(5, 3, cfg.hidden_size)
    mixed = x @ mcore[f"decoder.layers.{layer}.self_attention.linear_qkv.weight"].t()
    q, k, v = G.split_qkv(mixed, groups, head_dim, gemma4.k_eq_v(cfg, layer))
    attn = f"model.layers.{layer}.self_attn."
    proj = lambda name: (x @ state[attn + name + ".weight"].t()).reshape(5, 3, -1, head_dim)  # noqa: E731
    torch.testing.assert_close(q, proj("q_proj"), rtol=0, atol=1e-5)
    torch.testing.assert_close(k, proj("k_proj"), rtol=0, atol=1e-5)
    torch.testing.assert_close(v, proj("k_proj" if layer == 1 else "v_proj"), rtol=0, atol=1e-5)
    assert gemma4.k_eq_v(cfg, layer) == (layer == 1)
