"""Property tests for packing: documents → first-fit packs → THD micro-batches."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from moe_sft.data.chat import TokenizedDoc
from moe_sft.data.packing import (
    PackingError,
    best_fit_decreasing,
    build_micro_batch,
    first_fit,
    pack_documents,
    padded_length,
)


def naive_first_fit(lengths, capacity, order):
    """Reference: scan the open bins left to right (the definition of first-fit)."""
    bins, free = [], []
    for doc in order:
        for b, room in enumerate(free):
            if room >= lengths[doc]:
                bins[b].append(doc)
                free[b] -= lengths[doc]
                break
        else:
            bins.append([doc])
            free.append(capacity - lengths[doc])
    return bins


@st.composite
def documents(draw, max_docs=12, max_len=24):
    """Docs whose token ids are unique across the set (doc * 1000 + position + 1), so loss or
    duplication of any token is visible, with arbitrary assistant masks."""
    n_docs = draw(st.integers(1, max_docs))
    docs = []
    for d in range(n_docs):
        n = draw(st.integers(1, max_len))
        mask = draw(st.lists(st.booleans(), min_size=n, max_size=n))
        docs.append(TokenizedDoc([d * 1000 + p + 1 for p in range(n)], mask))
    return docs


@settings(max_examples=200, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 50), min_size=0, max_size=60),
    capacity=st.integers(50, 120),
    data=st.data(),
)
def test_first_fit_matches_reference_and_respects_capacity(lengths, capacity, data):
    order = data.draw(st.permutations(range(len(lengths))))
    bins = first_fit(lengths, capacity, order)
    assert bins == naive_first_fit(lengths, capacity, order)
    placed = [doc for b in bins for doc in b]
    assert sorted(placed) == list(range(len(lengths)))  # every document exactly once
    assert all(sum(lengths[d] for d in b) <= capacity for b in bins)
    for b in bins:  # within a bin, documents keep the processing order
        assert sorted(b, key=list(order).index) == b


@settings(max_examples=150, deadline=None)
@given(docs=documents(), pad_to=st.sampled_from([1, 2, 4, 8, 16]))
def test_micro_batch_properties(docs, pad_to):
    mb = build_micro_batch(docs, pad_to=pad_to, pad_token_id=0)
    n_real = sum(len(d.input_ids) for d in docs)
    T = mb.tokens.numel()
    assert T == padded_length(n_real, pad_to) and T % pad_to == 0 and T - n_real < pad_to
    for t in (mb.tokens, mb.labels, mb.loss_mask, mb.position_ids):
        assert t.shape == (T,)
    assert mb.tokens.dtype == torch.long and mb.labels.dtype == torch.long
    assert mb.loss_mask.dtype == torch.float32 and mb.position_ids.dtype == torch.long
    # No token lost or duplicated, in document order.
    assert mb.tokens[:n_real].tolist() == [t for d in docs for t in d.input_ids]
    assert mb.tokens[n_real:].tolist() == [0] * (T - n_real)
    # cu_seqlens: int32, 0 .. T, one segment per document plus one for padding.
    cu = mb.cu_seqlens.tolist()
    assert mb.cu_seqlens.dtype == torch.int32
    assert cu[0] == 0 and cu[-1] == T
    assert len(cu) == len(docs) + 1 + (1 if T > n_real else 0)
    seg_lens = [b - a for a, b in zip(cu, cu[1:])]
    assert seg_lens[: len(docs)] == [len(d.input_ids) for d in docs]
    assert mb.max_seqlen == max(seg_lens)
    expected_loss = 0
    for i, (a, b) in enumerate(zip(cu, cu[1:])):
        ids = mb.tokens[a:b].tolist()
        # Positions restart at each document (and at the padding segment).
        assert mb.position_ids[a:b].tolist() == list(range(b - a))
        # Labels are the next token of the same document; the last token predicts nothing.
        assert mb.labels[a:b].tolist() == ids[1:] + [0]
        mask = docs[i].assistant_mask if i < len(docs) else [False] * (b - a)
        assert mb.loss_mask[a:b].tolist() == [float(m) for m in mask[1:]] + [0.0]
        expected_loss += sum(mask[1:])
    assert mb.num_loss_tokens == expected_loss == int(mb.loss_mask.sum().item())


@settings(max_examples=100, deadline=None)
@given(docs=documents(max_docs=30), pack_length=st.sampled_from([24, 32, 48, 64]), pad_to=st.sampled_from([1, 4, 8]))
def test_packs_never_exceed_pack_length_and_keep_every_loss_token(docs, pack_length, pad_to):
    lengths = [len(d.input_ids) for d in docs]
    packs = pack_documents(lengths, pack_length)
    batches = [build_micro_batch([docs[i] for i in p], pad_to=pad_to) for p in packs]
    assert all(b.tokens.numel() <= pack_length for b in batches)
    assert sorted(t for b in batches for t in b.tokens.tolist() if t) == sorted(t for d in docs for t in d.input_ids)
    assert sum(b.num_loss_tokens for b in batches) == sum(d.num_loss_tokens for d in docs)


def test_micro_batch_concrete_values():
    docs = [
        TokenizedDoc([5, 6, 7], [False, True, True]),
        TokenizedDoc([8, 9], [False, True]),
    ]
    mb = build_micro_batch(docs, pad_to=4, pad_token_id=99)
    assert mb.tokens.tolist() == [5, 6, 7, 8, 9, 99, 99, 99]
    assert mb.labels.tolist() == [6, 7, 0, 9, 0, 0, 0, 0]
    assert mb.loss_mask.tolist() == [1.0, 1.0, 0.0, 1.0, 0.0, 0.0, 0.0, 0.0]
    assert mb.position_ids.tolist() == [0, 1, 2, 0, 1, 0, 1, 2]
    assert mb.cu_seqlens.tolist() == [0, 3, 5, 8]
    assert mb.max_seqlen == 3
    assert mb.num_loss_tokens == 3


def test_first_fit_concrete_order():
    # capacity 10: [6] [6] then 4 fits bin 0, 5 opens bin 2, 3 fits bin 1, 1 fits bin 1
    assert pack_documents([6, 6, 4, 5, 3, 1], 10) == [[0, 2], [1, 4, 5], [3]]
    assert pack_documents([6, 6, 4, 5, 3, 1], 10, order=[5, 4, 3, 2, 1, 0]) == [[5, 4, 3], [2, 1], [0]]


def test_oversized_or_empty_document_is_a_clear_error():
    with pytest.raises(PackingError, match=r"document 1 has 11 tokens, more than pack_length=10.*max_seq_len"):
        pack_documents([3, 11], 10)
    with pytest.raises(PackingError, match="document 0 is empty"):
        pack_documents([0], 10)
    with pytest.raises(PackingError, match="zero documents"):
        build_micro_batch([])
    with pytest.raises(PackingError, match="pad_to=0"):
        build_micro_batch([TokenizedDoc([1], [True])], pad_to=0)


# ----------------------------------------------------------------------------- best-fit decreasing


def naive_best_fit_decreasing(lengths, capacity):
    """Reference: longest first (stable), into the open bin with the least room that fits (oldest on ties)."""
    bins, free = [], []
    for doc in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        fits = [b for b in range(len(bins)) if free[b] >= lengths[doc]]
        if fits:
            b = min(fits, key=lambda b: (free[b], b))
            bins[b].append(doc)
            free[b] -= lengths[doc]
        else:
            bins.append([doc])
            free.append(capacity - lengths[doc])
    return bins


@settings(max_examples=200, deadline=None)
@given(lengths=st.lists(st.integers(1, 50), min_size=0, max_size=80), capacity=st.integers(50, 120))
def test_best_fit_decreasing_matches_reference_and_respects_capacity(lengths, capacity):
    bins = best_fit_decreasing(lengths, capacity)
    assert bins == naive_best_fit_decreasing(lengths, capacity)
    assert sorted(d for b in bins for d in b) == list(range(len(lengths)))  # every document exactly once
    assert all(sum(lengths[d] for d in b) <= capacity for b in bins)
    # Any-fit: a bin is opened only for a document no open bin can take, so any two bins together
    # exceed the capacity (at most one bin is half empty or less).
    loads = [sum(lengths[d] for d in b) for b in bins]
    assert all(loads[i] + loads[j] > capacity for i in range(len(loads)) for j in range(i + 1, len(loads)))


def test_best_fit_decreasing_concrete():
    # Longest first: 6 -> bin0, 6 -> bin1, 5 -> bin2; 4 fits bin0 and bin1 (free 4) and bin2 (free 5): the
    # tightest, oldest is bin0; 3 -> bin1 (free 4 beats 5); 1 -> bin1 (free 1 is the tightest).
    assert best_fit_decreasing([6, 6, 4, 5, 3, 1], 10) == [[0, 2], [1, 4, 5], [3]]
    assert best_fit_decreasing([7, 2, 3, 8], 10) == [[3, 1], [0, 2]]


# ----------------------------------------------------------------------------- per-document padding, weights


@st.composite
def weighted_documents(draw, max_docs=8, max_len=20):
    docs = []
    for d in range(draw(st.integers(1, max_docs))):
        n = draw(st.integers(1, max_len))
        weights = draw(st.lists(st.sampled_from([0.0, 0.0, 1.0, 0.5, 2.0]), min_size=n, max_size=n))
        docs.append(TokenizedDoc([d * 1000 + p + 1 for p in range(n)], weights))
    return docs


@settings(max_examples=150, deadline=None)
@given(docs=weighted_documents(), doc_multiple=st.sampled_from([1, 2, 4, 8]), pad_factor=st.sampled_from([1, 2, 4]))
def test_micro_batch_with_per_document_padding(docs, doc_multiple, pad_factor):
    pad_to = doc_multiple * pad_factor
    mb = build_micro_batch(docs, pad_to=pad_to, pad_token_id=0, doc_multiple=doc_multiple)
    T, n_real = mb.tokens.numel(), sum(len(d) for d in docs)
    assert T % pad_to == 0
    cu, cu_real = mb.cu_seqlens.tolist(), mb.cu_seqlens_unpadded.tolist()
    seg = [b - a for a, b in zip(cu, cu[1:])]
    real = [b - a for a, b in zip(cu_real, cu_real[1:])]
    # CP needs every segment (documents and the trailing padding) to be a multiple of doc_multiple.
    assert all(s % doc_multiple == 0 for s in seg)
    assert real[: len(docs)] == [len(d) for d in docs] and all(r == 0 for r in real[len(docs) :])
    assert all(s - r < doc_multiple for s, r in zip(seg[: len(docs)], real)) and len(seg) - len(docs) <= 1
    # The real tokens, in order, exactly where padding_mask is False; padding is the rest.
    assert mb.num_padding == T - n_real == int(mb.padding_mask.sum())
    assert mb.tokens[~mb.padding_mask].tolist() == [t for d in docs for t in d.input_ids]
    assert mb.tokens[mb.padding_mask].tolist() == [0] * (T - n_real)
    for i, (a, b) in enumerate(zip(cu, cu[1:])):
        assert mb.position_ids[a:b].tolist() == list(range(b - a))
        if i < len(docs):
            ids, w = docs[i].input_ids, docs[i].loss_weights
            assert mb.labels[a:b].tolist() == ids[1:] + [0] * (b - a - len(ids) + 1)
            assert mb.loss_mask[a:b].tolist() == list(w[1:]) + [0.0] * (b - a - len(ids) + 1)
    assert mb.loss_weight_sum == pytest.approx(sum(sum(d.loss_weights[1:]) for d in docs))
    assert mb.num_loss_tokens == sum(sum(1 for w in d.loss_weights[1:] if w > 0) for d in docs)
    assert not mb.loss_mask[mb.padding_mask].any()


def test_per_document_padding_concrete_values():
    docs = [TokenizedDoc([5, 6, 7], [0.0, 1.0, 0.5]), TokenizedDoc([8, 9], [0.0, 2.0])]
    mb = build_micro_batch(docs, pad_to=8, pad_token_id=99, doc_multiple=4)
    assert mb.tokens.tolist() == [5, 6, 7, 99, 8, 9, 99, 99]
    assert mb.labels.tolist() == [6, 7, 0, 0, 9, 0, 0, 0]
    assert mb.loss_mask.tolist() == [1.0, 0.5, 0.0, 0.0, 2.0, 0.0, 0.0, 0.0]
    assert mb.position_ids.tolist() == [0, 1, 2, 3, 0, 1, 2, 3]
    assert mb.cu_seqlens.tolist() == [0, 4, 8] and mb.cu_seqlens_unpadded.tolist() == [0, 3, 5]
    assert mb.padding_mask.tolist() == [False, False, False, True, False, False, True, True]
    assert (mb.num_padding, mb.num_loss_tokens, mb.loss_weight_sum, mb.max_seqlen) == (3, 3, 3.5, 4)
