"""Pack tokenized documents into THD micro-batches (pure functions).

A micro-batch is one flat token sequence holding several documents back to back; `cu_seqlens`
tells varlen attention where each document starts, so no token attends across documents and no
padding to a common length is needed (the "THD" layout of flash-attn / Transformer Engine).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch


class Doc(Protocol):
    """What packing needs from a document (moe_sft.data.chat.TokenizedDoc satisfies it)."""

    input_ids: list[int]
    assistant_mask: list[bool]


@dataclass
class PackedMicroBatch:
    tokens: torch.Tensor  # [T] int64; T = sum of doc lengths, right-padded to a multiple of pad_to
    labels: torch.Tensor  # [T] int64; labels[i] = tokens[i+1] in the same document, 0 at its last token / padding
    loss_mask: torch.Tensor  # [T] float32; 1.0 where labels[i] is an assistant token of the same document
    position_ids: torch.Tensor  # [T] int64; restart at 0 for each document (and for the padding segment)
    cu_seqlens: torch.Tensor  # [n_segments + 1] int32; 0, end of doc 0, ..., T (padding is its own segment)
    max_seqlen: int  # longest segment, padding included (varlen attention kernels need a bound)
    num_loss_tokens: int  # loss_mask.sum()
    num_padding: int = 0  # trailing padding tokens (the last segment); kept out of MoE routing


class PackingError(ValueError):
    """A document or setting that packing cannot honour; the message names the fix."""


def first_fit(lengths: Sequence[int], capacity: int, order: Sequence[int] | None = None) -> list[list[int]]:
    """Greedy first-fit bin packing: each document (in `order`) goes to the first bin with room.

    Returns bins in the order they were opened, each a list of indices into `lengths` in the order
    they were placed. Deterministic for a given order. O(n log n): a max segment tree over the bins'
    free space finds the leftmost bin with room, so millions of documents pack in seconds (the
    naive scan over open bins is O(n * bins)). Unopened bins have full capacity, so "leftmost bin
    with room" opens a new bin exactly when no open bin fits.
    """
    order = range(len(lengths)) if order is None else order
    size = 1
    while size < max(len(order), 1):
        size *= 2
    free = [capacity] * (2 * size)  # free[1] is the root; leaves are free[size:]
    bins: list[list[int]] = []
    for doc in order:
        need = lengths[doc]
        if need > capacity:
            raise PackingError(
                f"document {doc} has {need} tokens, more than pack_length={capacity}; "
                "set max_seq_len <= pack_length so longer documents are truncated or dropped first"
            )
        if need <= 0:
            raise PackingError(f"document {doc} is empty; drop empty documents before packing")
        node = 1
        while node < size:  # descend to the leftmost leaf with free >= need
            node = 2 * node if free[2 * node] >= need else 2 * node + 1
        slot = node - size
        if slot == len(bins):
            bins.append([])
        bins[slot].append(doc)
        free[node] -= need
        node //= 2
        while node:
            free[node] = max(free[2 * node], free[2 * node + 1])
            node //= 2
    return bins


def pack_documents(lengths: Sequence[int], pack_length: int, order: Sequence[int] | None = None) -> list[list[int]]:
    """Group documents into micro-batches of at most `pack_length` tokens (greedy first-fit in `order`)."""
    if pack_length <= 0:
        raise PackingError(f"pack_length={pack_length} must be positive")
    return first_fit(lengths, pack_length, order)


def padded_length(n_tokens: int, pad_to: int) -> int:
    """`n_tokens` rounded up to a multiple of `pad_to`."""
    if pad_to < 1:
        raise PackingError(f"pad_to={pad_to} must be >= 1 (1 means no padding)")
    return -(-n_tokens // pad_to) * pad_to


def build_micro_batch(docs: Sequence[Doc], pad_to: int = 1, pad_token_id: int = 0) -> PackedMicroBatch:
    """Concatenate `docs` into one packed micro-batch with shifted labels and a shifted loss mask.

    The label of token i is token i+1 of the same document: the model learns to produce token i+1
    from the prefix ending at i, so the loss counts where token i+1 is an assistant token. The last
    token of a document predicts nothing (label 0, mask 0): labels never cross a document boundary.
    Padding (to a multiple of `pad_to`, e.g. for sequence/context parallel splits) forms one extra
    segment with mask 0, so `cu_seqlens` still ends at T and attention stays within segments.
    """
    if not docs:
        raise PackingError("cannot build a micro-batch from zero documents")
    tokens: list[int] = []
    labels: list[int] = []
    loss_mask: list[bool] = []
    positions: list[int] = []
    seqlens: list[int] = []
    for doc in docs:
        ids, mask = list(doc.input_ids), list(doc.assistant_mask)
        if len(ids) != len(mask) or not ids:
            raise PackingError(f"document with {len(ids)} ids and {len(mask)} mask entries; they must match and be > 0")
        tokens += ids
        labels += ids[1:] + [0]
        loss_mask += mask[1:] + [False]
        positions += range(len(ids))
        seqlens.append(len(ids))
    n_pad = padded_length(len(tokens), pad_to) - len(tokens)
    if n_pad:
        tokens += [pad_token_id] * n_pad
        labels += [0] * n_pad
        loss_mask += [False] * n_pad
        positions += range(n_pad)
        seqlens.append(n_pad)
    cu_seqlens = torch.zeros(len(seqlens) + 1, dtype=torch.int32)
    cu_seqlens[1:] = torch.cumsum(torch.tensor(seqlens, dtype=torch.int32), 0)
    loss = torch.tensor(loss_mask, dtype=torch.float32)
    return PackedMicroBatch(
        tokens=torch.tensor(tokens, dtype=torch.long),
        labels=torch.tensor(labels, dtype=torch.long),
        loss_mask=loss,
        position_ids=torch.tensor(positions, dtype=torch.long),
        cu_seqlens=cu_seqlens,
        max_seqlen=max(seqlens),
        num_loss_tokens=int(sum(loss_mask)),
        num_padding=n_pad,
    )
