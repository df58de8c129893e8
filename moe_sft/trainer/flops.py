"""Model FLOPs of a training step over packed micro-batches, and the peak used for MFU.

The shape and the FLOP formula are moe_sft/models/shape.py's (one for planner, telemetry and
benchmark); this module counts them over PackedMicroBatches.
Only real tokens count: the padding segment of a micro-batch is wasted work, not model FLOPs.
The LM head counts every real token, as megatron's formula does, although the trainer runs it
only over the tokens that carry loss (moe_sft/trainer/loss_rows.py): on the benchmark's data that
leaves 11-12% (Qwen3-30B-A3B shape) and 19-21% (reduced DeepSeek-V3, two heads) of these FLOPs
unexecuted. `executed_step_flops` is what the trainer does run (the benchmarks' hardware TFLOP/s).

A LoRA / DoRA step executes less than full SFT's 3x forward (`lora_step_flops`): the forward, the
input gradients (every matmul's, through the frozen base too: the adapters below need them) and
the adapters' weight gradients, but no weight gradient of a frozen matrix. Per frozen matmul that
is 2 of its 3 passes; the attention scores (no weights) keep all 3; each adapter (x A, then B) runs
all 3. That is the count to compare a LoRA step's time with; model FLOPs of full SFT stay the
units of MFU, labelled as such.
"""

from __future__ import annotations

from moe_sft.data.packing import document_spans
from moe_sft.models.shape import (  # noqa: F401  (the FLOP formula, re-exported for its callers)
    PEAK_BF16_TFLOPS,
    ModelShape,
    attention_layer_pairs,
    attention_pair_flops,
    attention_pairs,
    attention_projection_flops,
    attention_score_flops,
    default_peak_tflops,
    forward_flops,
    forward_flops_per_token,
    mlp_flops,
)
from moe_sft.plan.layout import Layout
from moe_sft.plan.peft_memory import PeftPlan, layer_linears, targeted
from moe_sft.trainer.loss_rows import host_loss_rows

ONE_RANK = Layout(world=1, tp=1, pp=1, vpp=None, cp=1, ep=1, etp=1)


def document_lengths(mb) -> list[int]:
    """Real document lengths of a PackedMicroBatch: its segments less padding."""
    return [n for _, n in document_spans(mb)]


def train_step_flops(s: ModelShape, micro_batches, causal: bool = True) -> int:
    """Model FLOPs of forward + backward (3x forward) over PackedMicroBatches."""
    total = 0
    for mb in micro_batches:
        total += forward_flops(s, document_lengths(mb), causal)
    return 3 * total


def executed_step_flops(s: ModelShape, micro_batches, causal: bool = True) -> int:
    """`train_step_flops` with each LM head (MTP's too) counted over the rows the trainer runs it on
    (moe_sft/trainer/loss_rows.py) instead of every real token. Without context parallelism only:
    under CP the heads see every row."""
    return train_step_flops(s, micro_batches, causal) - 3 * 2 * s.hidden * s.vocab * skipped_head_rows(s, micro_batches)


def skipped_head_rows(s: ModelShape, micro_batches) -> int:
    """Rows of every LM head (MTP's too) that carry no loss: the trainer does not run the head there."""
    skipped = 0
    for mb in micro_batches:
        _, _, _, counts = host_loss_rows(mb.labels.numpy(), mb.loss_mask.numpy(), mb.cu_seqlens.numpy(), s.mtp_layers)
        skipped += (1 + s.mtp_layers) * sum(document_lengths(mb)) - sum(counts)
    return skipped


def adapter_forward_flops_per_token(s: ModelShape, p: PeftPlan) -> int:
    """Forward FLOPs per token of the adapters over the decoder layers (MTP has none): per targeted
    linear, x A per fused part (rank x in each) then B (out x rank); per routed expert a token
    visits (top-k), A1 (hidden x r), B1 per gate/up (r x ffn), A2 (ffn x r), B2 (r x hidden).
    DoRA's row norms (per weight, not per token) are not counted."""
    total, r = 0, p.rank
    for i, moe in enumerate(s.moe_layers):
        for lin in layer_linears(s, ONE_RANK, moe, i):
            if targeted(f"decoder.layers.{i}.{lin.name}", p.target_modules):
                total += 2 * r * (lin.in_local * lin.parts + lin.out_local)
        if moe and targeted(f"decoder.layers.{i}.mlp.experts", p.target_modules):
            b1 = 2 if s.glu else 1
            total += s.topk * 2 * r * (s.hidden + b1 * s.moe_ffn + s.moe_ffn + s.hidden)
    return total


def lora_step_flops(
    s: ModelShape, micro_batches, p: PeftPlan, causal: bool = True, heads_over_loss_rows: bool = False
) -> int:
    """FLOPs a LoRA step executes over PackedMicroBatches: `train_step_flops` less the weight
    gradients of the frozen matmuls (their forward FLOPs: every per-token part, the LM head and
    MTP included; routers and LM head / embeddings train on request), plus the adapters' forward,
    input gradients and weight gradients (3x their forward). `heads_over_loss_rows`: each head's
    forward and input gradient counted over the rows with loss only (the trainer's, as
    `executed_step_flops`)."""
    tokens = sum(sum(document_lengths(mb)) for mb in micro_batches)
    frozen = sum(forward_flops_per_token(s).values())
    if p.train_router:
        frozen -= 2 * s.hidden * s.num_experts * (sum(s.moe_layers) + (s.mtp_layers if s.moe_layers[-1] else 0))
    head = 2 * s.hidden * s.vocab
    if p.train_embeddings:
        frozen -= head * (1 + s.mtp_layers)  # the (shared) LM head's weight gradient runs per head
    total = train_step_flops(s, micro_batches, causal) - tokens * frozen
    total += 3 * tokens * adapter_forward_flops_per_token(s, p)
    if heads_over_loss_rows:
        total -= (3 if p.train_embeddings else 2) * head * skipped_head_rows(s, micro_batches)
    return total
