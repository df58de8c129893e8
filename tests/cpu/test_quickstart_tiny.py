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
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer

from moe_sft.models import registry

REPO = Path(__file__).resolve().parents[2]
TOKENIZER = REPO / "recipes" / "demo" / "tokenizer"
TRAIN = REPO / "recipes" / "demo" / "data" / "train.jsonl"
# KL(attention || uniform over the causally visible keys), nats, averaged over heads and queries,
# largest layer: at most 0.001 for the tiny models that stayed on the plateau, 0.011 or more for
# every one that learned.
MIN_KL = 0.005


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


def initial_attention_kl(family_name: str) -> list[float]:
    """Per layer, for the tiny model exactly as moe_sft.quickstart_model creates it (seed 0)."""
    tokenizer = AutoTokenizer.from_pretrained(str(TOKENIZER))
    family = registry.family_by_name(family_name)
    cfg = family.tiny_hf_config(vocab_size=len(tokenizer))
    cfg._attn_implementation = "eager"  # the attention probabilities are returned
    torch.manual_seed(0)
    model = family.hf_model_class(cfg).eval()
    with torch.no_grad():
        out = model(_demo_batch(tokenizer), output_attentions=True)
    return [_kl_from_uniform(a) for a in out.attentions]


@pytest.mark.parametrize("family", sorted(f.name for f in registry.FAMILIES))
def test_tiny_model_starts_off_the_attention_saddle(family):
    kl = initial_attention_kl(family)
    assert max(kl) >= MIN_KL, (
        f"moe_sft/models/{family}.py tiny_hf_config: every attention layer starts uniform "
        f"(KL from uniform {[round(k, 4) for k in kl]} < {MIN_KL}); the quickstart's 200 steps stay on the "
        "loss plateau. Raise initializer_range (docs/quickstart_cpu.md)"
    )
