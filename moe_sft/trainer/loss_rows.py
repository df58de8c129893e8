"""Only the positions that carry loss go through the LM head.

In SFT the prompt tokens (system, user, tool turns) have loss weight 0, and so do the last token
of every document and the padding. Their logits only ever get multiplied by 0. The head's three
GEMMs over the [tokens, vocab] logits and the cross entropy's two passes over them were among the
largest phases of the step (docs/log.md). So the
forward step picks the rows with weight > 0 on the host, where the loss mask already is, and
`SFTGPTModel` runs the head over those rows alone (`index_select` of the final hidden states,
whose backward scatters the rows' gradients back; every other position's gradient was 0 before).

Multi-token prediction: depth k's hidden state at position t predicts labels[t + k] (megatron's
roll within each packed document, moe_sft/models/mtp.py `shift_targets`), so its rows, targets and
weights are labels and mask read k places further, inside the document; with the hidden states of
all depths concatenated along the sequence, depth k's rows are offset by k x the sequence length.

With sequence parallelism the model gathers the final hidden states across the TP group first
(the output layer would have), then picks the rows. Context parallelism is left out: each rank
holds a shard of every document and the MTP roll crosses shards; there the head runs over every
position, as megatron's does.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from moe_sft.data.packing import PackedMicroBatch
from moe_sft.runtime.device import host_to_device

ENABLED = True  # benchmarks/gpu/ab_steps.py switches it off to measure it


@dataclass
class LossRows:
    rows: torch.Tensor  # [N] int64: positions in the depth-concatenated hidden states, depth-major
    targets: torch.Tensor  # [1, N] int64: each row's label
    weights: torch.Tensor  # [1, N] float32: each row's loss weight (> 0, except a lone placeholder row)
    counts: tuple[int, ...]  # rows per depth, the main head first


def host_loss_rows(labels: np.ndarray, loss_mask: np.ndarray, cu_seqlens: np.ndarray, depths: int):
    """(rows, targets, weights, counts) as numpy arrays for one packed micro-batch; see LossRows."""
    length = len(labels)
    positions = np.arange(length)
    # each position's document end (exclusive); positions past the last document keep their own
    # mask, which is 0 (padding), so any end past them will do
    bounds = np.asarray(cu_seqlens, dtype=np.int64)
    ends = np.full(length, length, dtype=np.int64)
    inside = positions < bounds[-1]
    ends[inside] = bounds[np.searchsorted(bounds, positions[inside], side="right")]
    rows, targets, weights, counts = [], [], [], []
    for k in range(depths + 1):
        ahead = positions + k
        valid = ahead < ends
        weight = np.zeros(length, dtype=np.float32)
        weight[valid] = loss_mask[ahead[valid]]
        picked = np.flatnonzero(weight)
        rows.append(picked + k * length)
        targets.append(labels[picked + k])
        weights.append(weight[picked])
        counts.append(len(picked))
    if not sum(counts):  # no loss in this micro-batch: one row of weight 0 keeps every shape non-empty
        rows, targets, weights, counts = [np.zeros(1, np.int64)], [labels[:1]], [np.zeros(1, np.float32)], [1]
        counts += [0] * depths
    return np.concatenate(rows), np.concatenate(targets), np.concatenate(weights), tuple(counts)


def loss_rows(mb: PackedMicroBatch, depths: int, device: str) -> LossRows:
    rows, targets, weights, counts = host_loss_rows(
        mb.labels.numpy(), mb.loss_mask.numpy(), mb.cu_seqlens.numpy(), depths
    )
    return LossRows(
        host_to_device(torch.from_numpy(rows), device),
        host_to_device(torch.from_numpy(targets).long()[None], device),
        host_to_device(torch.from_numpy(weights)[None], device),
        counts,
    )


def applies(cp_size: int) -> bool:
    return ENABLED and cp_size == 1
