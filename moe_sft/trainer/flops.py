"""Model FLOPs of a training step over packed micro-batches, and the peak used for MFU.

The shape and the FLOP formula are moe_sft/models/shape.py's (one for planner, telemetry and
benchmark); this module counts them over PackedMicroBatches.
Only real tokens count: the padding segment of a micro-batch is wasted work, not model FLOPs.
The LM head counts every real token, as megatron's formula does, although the trainer runs it
only over the tokens that carry loss (moe_sft/trainer/loss_rows.py): on the benchmark's data that
leaves 11-12% (Qwen3-30B-A3B shape) and 19-21% (reduced DeepSeek-V3, two heads) of these FLOPs
unexecuted. `executed_step_flops` is what the trainer does run (the benchmarks' hardware TFLOP/s).
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
from moe_sft.trainer.loss_rows import host_loss_rows


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
    head = 3 * 2 * s.hidden * s.vocab
    skipped = 0
    for mb in micro_batches:
        _, _, _, counts = host_loss_rows(mb.labels.numpy(), mb.loss_mask.numpy(), mb.cu_seqlens.numpy(), s.mtp_layers)
        skipped += (1 + s.mtp_layers) * sum(document_lengths(mb)) - sum(counts)
    return train_step_flops(s, micro_batches, causal) - head * skipped
