"""Gemma 4's MoE block, router and decoder layer (moe_sft/layers/gemma4_moe.py, gemma4_layer.py) and
the model's embedding multiplier and logit soft cap (models/mtp.py's SFTGPTModel), built through the
family's layer spec and compared, fp32 on CPU, with transformers' own modules, the weights copied
through the family's mapping table (every norm, scale and layer scalar randomised, since
transformers initialises them to 1):

* a decoder layer's feed-forward half (dense MLP and experts between their norms, the router on the
  raw residual, the residual add and the layer scalar) against Gemma4TextDecoderLayer with its
  attention giving zeros: outputs and every gradient, on the tiny and sampled configs;
* the whole model with every attention output zeroed (o_proj = linear_proj = 0: the attention
  module is not in this test), on packed documents: embedding multiplier, layers, final norm, tied
  head and soft cap against Gemma4ForCausalLM's logits;
* the embedding multiplier rounded to bf16 first, bit-equal to transformers' scaled embedding.
"""

from __future__ import annotations

import random

import pytest
import torch

from moe_sft.conversion import mapping
from moe_sft.conversion.single_rank import build_single_rank_model, init_single_rank
from moe_sft.models import gemma4
from moe_sft.models.forward import packed_logits
from moe_sft.runtime import cpu_compat

FAMILY = gemma4.FAMILY
VOCAB = 96
TOL = dict(rtol=0, atol=1e-4)  # fp32; measured ≤ 1.5e-5 (sums in another order than transformers')


@pytest.fixture(scope="module", autouse=True)
def single_rank():
    init_single_rank("fp32")


def _hf_model(cfg, dtype=torch.float32):
    """transformers' model with every floating tensor random (norms, scales, layer scalars too)."""
    with cpu_compat.suspended():
        torch.manual_seed(0)
        model = FAMILY.hf_model_class(cfg).to(dtype)
        with torch.no_grad():
            for name, t in model.state_dict().items():
                if t.is_floating_point() and not name.startswith("lm_head"):
                    t.copy_(torch.randn_like(t) * (0.5 if "experts" in name or "proj" in name else 1.0))
    return model


def _load(model, hf, cfg, keep=lambda name: True) -> None:
    """Copy transformers' tensors into the megatron model through the mapping table."""
    state, ctx = hf.state_dict(), mapping.transform_context(FAMILY, cfg)
    ours = model.state_dict()
    with torch.no_grad():
        for e in mapping.expand(FAMILY, cfg):
            if keep(e.mcore) and e.mcore in ours:
                ours[e.mcore].copy_(e.transform.from_hf([state[n] for n in e.hf], ctx))


def _configs():
    rng = random.Random(45)
    return [("tiny", FAMILY.tiny_hf_config(vocab_size=VOCAB))] + [
        (f"sampled{i}", FAMILY.sample_hf_config(rng, VOCAB)) for i in range(3)
    ]


class _NoAttention(torch.nn.Module):
    def forward(self, hidden_states, **kwargs):
        return torch.zeros_like(hidden_states), None


@pytest.mark.parametrize("name,cfg", _configs(), ids=[n for n, _ in _configs()])
def test_feed_forward_half_matches_transformers_layer(name, cfg):
    """megatron's Gemma 4 layer after its attention ((h + block(h)) * layer_scalar) equals
    Gemma4TextDecoderLayer with a zero attention output, forward and backward (the input's and every
    block parameter's gradient, mapped through the table)."""
    hf = _hf_model(cfg)
    model = build_single_rank_model(FAMILY, cfg)
    i = cfg.num_hidden_layers - 1
    prefix = f"decoder.layers.{i}."
    _load(model, hf, cfg, keep=lambda n: n.startswith(prefix + "mlp.") or n == prefix + "layer_scalar")
    ours_layer, hf_layer = model.decoder.layers[i], hf.model.layers[i]
    hf_layer.self_attn = _NoAttention()

    g = torch.Generator().manual_seed(1)
    h = torch.randn(23, 1, cfg.hidden_size, generator=g) * 3
    seed = torch.randn(h.shape, generator=g)
    x_ours, x_hf = h.clone().requires_grad_(), h.transpose(0, 1).clone().requires_grad_()
    out = ours_layer._forward_mlp(x_ours)
    with cpu_compat.suspended():
        want = hf_layer(x_hf, position_embeddings=None, attention_mask=None)
    torch.testing.assert_close(out, want.transpose(0, 1), **TOL)
    (out * seed).sum().backward()
    with cpu_compat.suspended():
        (want * seed.transpose(0, 1)).sum().backward()
    torch.testing.assert_close(x_ours.grad, x_hf.grad.transpose(0, 1), **TOL)

    hf_grads = {n: p.grad for n, p in hf.named_parameters() if p.grad is not None}
    ours = dict(ours_layer.named_parameters())
    ctx, checked = mapping.transform_context(FAMILY, cfg), 0
    for e in mapping.expand(FAMILY, cfg):
        if e.mcore.startswith(prefix + "mlp."):
            want_grad = e.transform.from_hf([hf_grads[n] for n in e.hf], ctx)
            torch.testing.assert_close(ours[e.mcore.removeprefix(prefix)].grad, want_grad, **TOL, msg=e.mcore)
            checked += 1
    assert checked == 12  # router (weight, scale, per_expert_scale), experts (2), dense MLP (2), 5 norms


def _zero_attention_pair(cfg):
    hf = _hf_model(cfg)
    with torch.no_grad():
        for layer in hf.model.layers:
            layer.self_attn.o_proj.weight.zero_()
    model = build_single_rank_model(FAMILY, cfg)
    _load(model, hf, cfg, keep=lambda n: "self_attention." not in n)
    with torch.no_grad():
        for layer in model.decoder.layers:
            layer.self_attention.linear_proj.weight.zero_()
    return hf.eval(), model.eval()


@pytest.mark.parametrize("cap", [30.0, 0.5, None])
def test_model_without_attention_matches_transformers_logits(cap):
    """Embedding multiplier, the layers' feed-forward halves, final norm, tied head and the soft cap
    (0.5: most logits near the cap) of the whole model on packed documents, attention zeroed."""
    cfg = FAMILY.tiny_hf_config(vocab_size=VOCAB, final_logit_softcapping=cap)
    hf, model = _zero_attention_pair(cfg)
    g = torch.Generator().manual_seed(2)
    docs = [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in (19, 40, 7)]
    with cpu_compat.suspended(), torch.no_grad():
        refs = [hf(torch.tensor([d])).logits[0].float() for d in docs]
    ours = packed_logits(model, docs, VOCAB)
    for r, o in zip(refs, ours):
        torch.testing.assert_close(o, r, **TOL)
    if cap is not None:
        assert max(r.abs().max().item() for r in refs) <= cap


def test_embedding_multiplier_rounds_to_bf16_first():
    """transformers multiplies bf16 embeddings by sqrt(hidden) cast to bf16 (11.3125 for 128, not
    11.3137): the first hidden states are bit-equal."""
    cfg = FAMILY.tiny_hf_config(vocab_size=VOCAB)
    hf = _hf_model(cfg, torch.bfloat16)
    model = build_single_rank_model(FAMILY, cfg, precision="bf16")
    _load(model, hf, cfg, keep=lambda n: n.startswith("embedding."))
    ids = torch.randint(0, VOCAB, (1, 33), generator=torch.Generator().manual_seed(4))
    ours = model._preprocess(input_ids=ids, position_ids=torch.arange(33)[None])[0]
    with cpu_compat.suspended(), torch.no_grad():
        want = hf.model.embed_tokens(ids)
    assert ours.dtype == want.dtype == torch.bfloat16
    assert torch.equal(ours.transpose(0, 1), want)


def test_block_refuses_what_would_skip_its_norms():
    """megatron's shared-expert overlap (the dense MLP inside the dispatcher) is refused by name, and
    the chunked dispatch (layers/split_dispatch.py: its own forward, without the block's norms)
    says why it leaves the block alone."""
    import copy

    from moe_sft.layers import split_dispatch
    from moe_sft.layers.gemma4_moe import Gemma4MoELayer
    from moe_sft.layers.spec import gemma4_layer_spec

    model = build_single_rank_model(FAMILY, FAMILY.tiny_hf_config(vocab_size=VOCAB))
    moe = model.decoder.layers[0].mlp
    config = copy.copy(moe.config)
    config.moe_shared_expert_overlap = True
    with pytest.raises(ValueError, match="moe_shared_expert_overlap"):
        Gemma4MoELayer(config, gemma4_layer_spec().submodules.mlp.submodules)
    moe.token_dispatcher.ep_size = 2
    reason = split_dispatch.splittable(moe)
    assert reason is not None and "Gemma4MoELayer" in reason, reason
