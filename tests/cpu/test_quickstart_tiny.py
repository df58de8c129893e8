"""Every family's tiny quickstart model starts off the uniform-attention saddle.

A layer whose query/key logits start near zero attends uniformly and sits at a saddle (W_q and
W_k each get a gradient proportional to the other). When every layer starts there, the quickstart
(recipes/quickstart.yaml, 200 steps) stays on its loss plateau (about 1.94) and learns nothing.
Measured on CPU, fp32 (docs/quickstart_cpu.md): the Mixtral, DeepSeek-V3 and Kimi-K2 tiny models
(no qk-norm) with initializer_range 0.02 start with KL from uniform 0.0002-0.001 and gave 0/200
exact match. With 0.05 (KL 0.011-0.040) they give 197-200/200. Qwen3-MoE, GLM-4.5 and MiniMax-M2
normalise q and k (KL about 0.4), and gpt-oss's sinks and sliding window (0.16) do the same job.
The check is necessary, not sufficient: Kimi-K2 at 0.035 (KL 0.0085) reached only 71/200, and too
large an init hurts too (0.1: 85-143/200). Whether the model learns is measured by the runs in
docs/quickstart_cpu.md; this check catches a tiny config that cannot.

Two more properties came from the hybrid families (issue 44, docs/log.md): the quickstart's
2-layer model needs an attention layer (two Gated DeltaNet layers stayed on the plateau, and
transformers' generate fails without one), and the attention needs more than one rotary frequency
fast enough to tell the tokens of a conversation apart (8 rotary dims, head_dim 32 at partial
rotary 0.25, gave one and stayed on the plateau; 16 dims give two, as GLM-4.5's and MiniMax-M2's,
and learned slowly; the hybrid tiny model now has 32, three).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer

from moe_sft.models import registry
from moe_sft.quickstart_model import NUM_LAYERS

REPO = Path(__file__).resolve().parents[2]
TOKENIZER = REPO / "recipes" / "demo" / "tokenizer"
TRAIN = REPO / "recipes" / "demo" / "data" / "train.jsonl"
# KL(attention || uniform over the causally visible keys), nats, averaged over heads and queries,
# largest layer: at most 0.001 for the tiny models that stayed on the plateau, 0.011 or more for
# every one that learned.
MIN_KL = 0.005
# Rotary frequencies of at least this many radians per token (a full turn within ~125 tokens, the
# length of a few demo turns): every tiny model that learned has two or more, the hybrid one with
# head_dim 32 had one (1.0; the next, 0.018-0.03, turns once in ~250 tokens).
FAST_FREQUENCY = 0.05
MIN_FAST_FREQUENCIES = 2


def _demo_batch(tokenizer, rows: int = 8) -> torch.Tensor:
    with TRAIN.open() as f:
        convs = [json.loads(next(f))["messages"] for _ in range(rows)]
    ids = [tokenizer.apply_chat_template(c, tokenize=True, return_dict=True)["input_ids"] for c in convs]
    n = min(len(i) for i in ids)
    return torch.tensor([i[:n] for i in ids])


def _kl_from_uniform(probs: torch.Tensor) -> float:
    """probs: (batch, heads, q, k) causal attention. Queries with fewer than 8 keys are left out."""
    n = probs.shape[-1]
    kls = []
    for q in range(8, n):
        p = probs[..., q, : q + 1]
        entropy = -(p * p.clamp_min(1e-30).log()).sum(-1)
        kls.append((torch.log(torch.tensor(q + 1.0)) - entropy).mean())
    return float(torch.stack(kls).mean())


def _quickstart_model(family_name: str, tokenizer):
    """The tiny model exactly as moe_sft.quickstart_model creates it (its layer count, seed 0)."""
    family = registry.family_by_name(family_name)
    cfg = family.tiny_hf_config(vocab_size=len(tokenizer), num_hidden_layers=NUM_LAYERS)
    cfg._attn_implementation = "eager"  # the attention probabilities are returned
    torch.manual_seed(0)
    return family.hf_model_class(cfg).eval()


def initial_attention_kl(family_name: str) -> list[float]:
    """Per attention layer (linear-attention layers return no probabilities) of the quickstart's model."""
    tokenizer = AutoTokenizer.from_pretrained(str(TOKENIZER))
    model = _quickstart_model(family_name, tokenizer)
    with torch.no_grad():
        out = model(_demo_batch(tokenizer), output_attentions=True)
    return [_kl_from_uniform(a) for a in out.attentions if a is not None]


@pytest.mark.parametrize("family", sorted(f.name for f in registry.FAMILIES))
def test_tiny_model_starts_off_the_attention_saddle(family):
    kl = initial_attention_kl(family)
    assert kl, (
        f"moe_sft/models/{family}.py tiny_hf_config: the quickstart's {NUM_LAYERS}-layer model has no "
        "attention layer; it stays on the loss plateau and transformers' generate fails (docs/log.md issue 44)"
    )
    assert max(kl) >= MIN_KL, (
        f"moe_sft/models/{family}.py tiny_hf_config: every attention layer starts uniform "
        f"(KL from uniform {[round(k, 4) for k in kl]} < {MIN_KL}); the quickstart's 200 steps stay on the "
        "loss plateau. Raise initializer_range (docs/quickstart_cpu.md)"
    )


@pytest.mark.parametrize("family", sorted(f.name for f in registry.FAMILIES))
def test_tiny_model_attention_tells_nearby_positions_apart(family):
    tokenizer = AutoTokenizer.from_pretrained(str(TOKENIZER))
    rotary = _quickstart_model(family, tokenizer).model.rotary_emb
    # radians per token: one table, or one per layer type (Gemma 4's sliding_attention_inv_freq, ...)
    tables = {n: b for n, b in rotary.named_buffers() if n.endswith("inv_freq") and "original" not in n}
    assert tables, f"{family}: no inv_freq buffer in {type(rotary).__name__}"
    for name, inv_freq in tables.items():
        fast = sorted((round(float(f), 4) for f in inv_freq if f >= FAST_FREQUENCY), reverse=True)
        assert len(fast) >= MIN_FAST_FREQUENCIES, (
            f"moe_sft/models/{family}.py tiny_hf_config: {2 * inv_freq.numel()} rotary dims ({name}) give the "
            f"rotary frequencies {fast} of at least {FAST_FREQUENCY} rad/token, fewer than {MIN_FAST_FREQUENCIES}: "
            "the attention can hardly learn where a word sits and the quickstart stays on its loss plateau. Give "
            "the tiny model more rotary dims (head_dim, partial_rotary_factor) or a smaller rope_theta (docs/log.md "
            "issue 44)"
        )
