"""Pack tokenized documents into THD micro-batches (pure functions).

A micro-batch is one flat token sequence holding several documents back to back; `cu_seqlens`
tells varlen attention where each document starts, so no token attends across documents and no
padding to a common length is needed (the "THD" layout of flash-attn / Transformer Engine).

Two paddings, both kept out of the loss (weight 0) and out of MoE routing (`padding_mask`):

* per document, to a multiple of `doc_multiple`: context parallelism splits every document into
  2*CP chunks (and sequence parallelism each CP share over TP ranks), so each document's segment
  must be a multiple of 2*CP*TP. The padding is inside the document's segment, after its tokens
  (causal attention: no real token sees it);
* of the whole micro-batch, to a multiple of `pad_to` (SP, or one fixed shape for pipeline p2p and
  the allgather dispatcher), as one extra segment.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch


class Doc(Protocol):
    """What packing needs from a document (moe_sft.data.chat.TokenizedDoc satisfies it).

    `loss_weights` (float per token) or, for simple callers, `assistant_mask` (bool per token).
    """

    input_ids: Sequence[int]


@dataclass
class PackedMicroBatch:
    tokens: torch.Tensor  # [T] int64; T = sum of segment lengths (a multiple of pad_to)
    labels: torch.Tensor  # [T] int64; labels[i] = tokens[i+1] in the same document, 0 at its last token / padding
    loss_mask: torch.Tensor  # [T] float32 loss weight of labels[i]: its token's weight, 0 across documents / padding
    position_ids: torch.Tensor  # [T] int64; restart at 0 for each segment
    cu_seqlens: torch.Tensor  # [n_segments + 1] int32; segment boundaries (a document's padding is in its segment)
    max_seqlen: int  # longest segment (varlen attention kernels need a bound)
    num_loss_tokens: int  # positions with loss_mask > 0
    num_padding: int = 0  # padding tokens, per-document and trailing
    padding_mask: torch.Tensor | None = None  # [T] bool, True on padding: kept out of MoE routing
    cu_seqlens_unpadded: torch.Tensor | None = None  # [n_segments + 1] int32 cumsum of real lengths (TE's cu_seqlens_q
    #                                                  with cu_seqlens as cu_seqlens_q_padded); padding segment: 0
    loss_weight_sum: float = 0.0  # loss_mask.sum(): this micro-batch's share of the normaliser


class PackingError(ValueError):
    """A document or setting that packing cannot honour; the message names the fix."""


def padded_length(n_tokens: int, pad_to: int) -> int:
    """`n_tokens` rounded up to a multiple of `pad_to`."""
    if pad_to < 1:
        raise PackingError(f"pad_to={pad_to} must be >= 1 (1 means no padding)")
    return -(-n_tokens // pad_to) * pad_to


def _check_lengths(lengths: Sequence[int], capacity: int) -> None:
    if capacity <= 0:
        raise PackingError(f"pack_length={capacity} must be positive")
    for doc, need in enumerate(lengths):
        if need > capacity:
            raise PackingError(
                f"document {doc} has {need} tokens, more than pack_length={capacity}; "
                "set max_seq_len <= pack_length so longer documents are truncated or dropped first"
            )
        if need <= 0:
            raise PackingError(f"document {doc} is empty; drop empty documents before packing")


def best_fit_decreasing(lengths: Sequence[int], capacity: int) -> list[list[int]]:
    """Bin packing: documents longest first, each into the fullest bin it still fits (else a new one).

    Returns bins in the order they were opened, each a list of indices into `lengths`. Ties are
    broken by index (stable sort) and by bin age, so the result is deterministic. Best-fit
    decreasing uses at most 11/9 OPT + 6/9 bins (Dósa 2007) and in practice leaves free space only
    in the last few bins. O(n log n) search; bins are kept in a list sorted by free space.
    """
    _check_lengths(lengths, capacity)
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    bins: list[list[int]] = []
    free: list[tuple[int, int]] = []  # (free space, bin index), sorted
    for doc in order:
        need = lengths[doc]
        k = bisect.bisect_left(free, (need, -1))
        if k == len(free):
            bins.append([doc])
            bisect.insort(free, (capacity - need, len(bins) - 1))
            continue
        room, b = free.pop(k)
        bins[b].append(doc)
        bisect.insort(free, (room - need, b))
    return bins


def first_fit(lengths: Sequence[int], capacity: int, order: Sequence[int] | None = None) -> list[list[int]]:
    """Greedy first-fit bin packing: each document (in `order`) goes to the first bin with room.

    Returns bins in the order they were opened, each a list of indices into `lengths` in the order
    they were placed. O(n log n): a max segment tree over the bins' free space finds the leftmost
    bin with room.
    """
    _check_lengths(lengths, capacity)
    order = range(len(lengths)) if order is None else order
    size = 1
    while size < max(len(order), 1):
        size *= 2
    tree = [capacity] * (2 * size)  # tree[1] is the root; leaves are tree[size:]
    bins: list[list[int]] = []
    for doc in order:
        need, node = lengths[doc], 1
        while node < size:  # descend to the leftmost leaf with free >= need
            node = 2 * node if tree[2 * node] >= need else 2 * node + 1
        slot = node - size
        if slot == len(bins):
            bins.append([])
        bins[slot].append(doc)
        tree[node] -= need
        node //= 2
        while node:
            tree[node] = max(tree[2 * node], tree[2 * node + 1])
            node //= 2
    return bins


def pack_documents(lengths: Sequence[int], pack_length: int, order: Sequence[int] | None = None) -> list[list[int]]:
    """Group documents into micro-batches of at most `pack_length` tokens (greedy first-fit in `order`)."""
    return first_fit(lengths, pack_length, order)


def doc_weights(doc) -> np.ndarray:
    weights = getattr(doc, "loss_weights", None)
    return np.asarray(doc.assistant_mask if weights is None else weights, dtype=np.float32)


def build_micro_batch(
    docs: Sequence[Doc], pad_to: int = 1, pad_token_id: int = 0, doc_multiple: int = 1
) -> PackedMicroBatch:
    """Concatenate `docs` into one packed micro-batch with shifted labels and shifted loss weights.

    The label of token i is token i+1 of the same document: the model learns to produce token i+1
    from the prefix ending at i, so the loss weight of position i is that of token i+1. The last
    token of a document predicts nothing (label 0, weight 0): labels never cross a document boundary.
    Each document's segment is padded to a multiple of `doc_multiple` and the whole batch to a
    multiple of `pad_to` (one extra segment); see the module doc.
    """
    if not docs:
        raise PackingError("cannot build a micro-batch from zero documents")
    if doc_multiple < 1 or pad_to < 1:
        raise PackingError(f"doc_multiple={doc_multiple} and pad_to={pad_to} must be >= 1 (1 means no padding)")
    parts = {k: [] for k in ("tokens", "labels", "weights", "positions", "padding")}
    seg_lens, real_lens = [], []
    for doc in docs:
        ids, weights = np.asarray(doc.input_ids, dtype=np.int64), doc_weights(doc)
        n = len(ids)
        if n != len(weights) or not n:
            raise PackingError(f"document with {n} ids and {len(weights)} weights; they must match and be > 0")
        seg = padded_length(n, doc_multiple)
        _append_segment(parts, ids, weights, seg, pad_token_id)
        seg_lens.append(seg)
        real_lens.append(n)
    total = sum(seg_lens)
    n_pad = padded_length(total, math.lcm(pad_to, doc_multiple)) - total
    if n_pad:
        _append_segment(parts, np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.float32), n_pad, pad_token_id)
        seg_lens.append(n_pad)
        real_lens.append(0)
    weights = torch.from_numpy(np.concatenate(parts["weights"]))
    padding = torch.from_numpy(np.concatenate(parts["padding"]))
    return PackedMicroBatch(
        tokens=torch.from_numpy(np.concatenate(parts["tokens"])),
        labels=torch.from_numpy(np.concatenate(parts["labels"])),
        loss_mask=weights,
        position_ids=torch.from_numpy(np.concatenate(parts["positions"])),
        cu_seqlens=_cumsum(seg_lens),
        max_seqlen=max(seg_lens),
        num_loss_tokens=int(torch.count_nonzero(weights)),
        num_padding=int(padding.sum()),
        padding_mask=padding,
        cu_seqlens_unpadded=_cumsum(real_lens),
        loss_weight_sum=float(weights.double().sum()),
    )


def document_spans(mb: PackedMicroBatch) -> list[tuple[int, int]]:
    """(start, real length) of each document in `mb`, padding left out.

    Uses `cu_seqlens_unpadded` when the batch carries it (documents padded to `doc_multiple`);
    otherwise the only padding is the trailing segment.
    """
    starts = [int(x) for x in mb.cu_seqlens[:-1]]
    if mb.cu_seqlens_unpadded is not None:
        real = [int(b - a) for a, b in zip(mb.cu_seqlens_unpadded[:-1], mb.cu_seqlens_unpadded[1:])]
        return [(start, n) for start, n in zip(starts, real) if n]
    lengths = [int(b - a) for a, b in zip(mb.cu_seqlens[:-1], mb.cu_seqlens[1:])]
    if mb.num_padding:
        if not lengths or lengths[-1] != mb.num_padding:
            raise ValueError(f"expected the last segment of {lengths} to be the {mb.num_padding} padding tokens")
        starts, lengths = starts[:-1], lengths[:-1]
    return list(zip(starts, lengths))


def _append_segment(parts: dict, ids: np.ndarray, weights: np.ndarray, seg: int, pad_token_id: int) -> None:
    n, pad = len(ids), seg - len(ids)
    parts["tokens"] += [ids, np.full(pad, pad_token_id, dtype=np.int64)]
    parts["labels"] += [ids[1:], np.zeros(min(n, 1) + pad, dtype=np.int64)]
    parts["weights"] += [weights[1:], np.zeros(min(n, 1) + pad, dtype=np.float32)]
    parts["positions"].append(np.arange(seg, dtype=np.int64) if n else np.arange(pad, dtype=np.int64))
    parts["padding"] += [np.zeros(n, dtype=bool), np.ones(pad, dtype=bool)]


def _cumsum(lengths: list[int]) -> torch.Tensor:
    cu = torch.zeros(len(lengths) + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(torch.tensor(lengths, dtype=torch.int32), 0)
    return cu


def packing_efficiency(real_tokens: int, n_packs: int, pack_length: int) -> float:
    """Non-padding tokens / capacity (n_packs * pack_length)."""
    return real_tokens / max(n_packs * pack_length, 1)
