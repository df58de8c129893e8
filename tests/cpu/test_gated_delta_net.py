"""moe_sft/layers/gated_delta_net.py: packed documents never see each other, in the convolution,
the recurrent state or the gradients; the whole hybrid model matches transformers per document on
lengths that straddle the delta rule's 64-token chunk, a 1-token document and documents longer
than the convolution kernel."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from moe_sft.layers import gated_delta_net as gdn
from moe_sft.models import registry
from moe_sft.runtime import cpu_compat

LENGTHS = (1, 3, 63, 65, 130)  # 1 token; < kernel; one short of, one past and two chunks


def _cu(lengths) -> torch.Tensor:
    return torch.tensor([0, *lengths]).cumsum(0).to(torch.int32)


def test_convolution_restarts_at_every_document():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(sum(LENGTHS), 6, generator=g, dtype=torch.float64)
    w = torch.randn(6, 4, generator=g, dtype=torch.float64)
    packed = gdn.causal_conv_per_document(x, w, _cu(LENGTHS))
    alone = [
        F.silu(F.conv1d(doc.T[None], w[:, None], padding=3, groups=6)[0, :, : len(doc)].T)
        for doc in torch.split(x, LENGTHS)
    ]
    torch.testing.assert_close(packed, torch.cat(alone), rtol=1e-12, atol=1e-12)


def test_delta_rule_state_and_gradients_stay_in_their_document():
    g = torch.Generator().manual_seed(1)
    tokens, heads = sum(LENGTHS), 2
    q = F.normalize(torch.randn(tokens, heads, 8, generator=g), dim=-1).requires_grad_()
    k = F.normalize(torch.randn(tokens, heads, 8, generator=g), dim=-1).requires_grad_()
    v = torch.randn(tokens, heads, 4, generator=g, requires_grad=True)
    decay = -torch.rand(tokens, heads, generator=g)
    beta = torch.rand(tokens, heads, generator=g)
    packed = gdn.gated_delta_rule_per_document(q, k, v, decay, beta, _cu(LENGTHS))
    weights = torch.randn(packed.shape, generator=g)
    (packed * weights).sum().backward()
    grads = [t.grad.clone() for t in (q, k, v)]
    # a change in the last document changes nothing before it, forward or backward
    v2 = v.detach().clone()
    v2[-LENGTHS[-1] :] += 1.0
    changed = gdn.gated_delta_rule_per_document(q.detach(), k.detach(), v2, decay, beta, _cu(LENGTHS))
    head = tokens - LENGTHS[-1]
    assert torch.equal(changed[:head], packed.detach()[:head])
    assert not torch.equal(changed[head:], packed.detach()[head:])
    # each document alone gives the packed rows and gradients
    start = 0
    for n in LENGTHS:
        part = [t.detach()[start : start + n].clone().requires_grad_() for t in (q, k, v)]
        out = gdn.gated_delta_rule_per_document(*part, decay[start : start + n], beta[start : start + n], None)
        torch.testing.assert_close(out, packed.detach()[start : start + n], rtol=1e-6, atol=1e-6)
        (out * weights[start : start + n]).sum().backward()
        for mine, ref in zip(part, grads):
            torch.testing.assert_close(mine.grad, ref[start : start + n], rtol=1e-5, atol=1e-6)
        start += n


def test_packed_hybrid_model_matches_transformers_per_document(tmp_path):
    from moe_sft.conversion.convert import convert
    from moe_sft.conversion.export import load_model_from_checkpoint
    from moe_sft.models.forward import packed_logits

    family = registry.family_by_name("qwen3_next")
    vocab = 300
    with cpu_compat.suspended():
        torch.manual_seed(0)
        hf = family.hf_model_class(family.tiny_hf_config(vocab_size=vocab)).eval()
        hf.save_pretrained(str(tmp_path / "hf"))
    convert(tmp_path / "hf", tmp_path / "mcore")
    g = torch.Generator().manual_seed(2)
    docs = [torch.randint(0, vocab, (n,), generator=g).tolist() for n in LENGTHS]
    with cpu_compat.suspended(), torch.no_grad():
        refs = [hf(torch.tensor([d])).logits[0].float() for d in docs]
    model = load_model_from_checkpoint(tmp_path / "mcore").eval()
    ours = packed_logits(model, docs, vocab)
    worst = max((r - o).abs().max().item() for r, o in zip(refs, ours))
    print(f"qwen3_next packed {LENGTHS}: max abs logit diff {worst:.3e}")
    assert worst <= 1e-4


def test_context_parallel_is_refused_for_the_hybrid_models():
    import pytest

    from moe_sft.config import ConfigError, load_config
    from moe_sft.trainer.assemble import HFModel, check_against_model
    from tests.cpu.test_plan import REPO

    family = registry.family_by_name("qwen3_5_moe")
    cfg = family.tiny_hf_config()
    hf = HFModel(family, cfg, family.shape(cfg))
    recipe = ["--config-path", str(REPO / "recipes"), "--config-name", "quickstart"]
    check_against_model(load_config(recipe), hf)  # CP1: fine
    with pytest.raises(ConfigError, match=r"context_parallel_size=2: this model's Gated DeltaNet"):
        check_against_model(load_config([*recipe, "parallel.context_parallel_size=2"]), hf)
