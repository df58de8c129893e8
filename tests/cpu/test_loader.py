"""The step → global batch loader: DP sharding, epochs, mixture weights, held-out split, packing
efficiency, exact resume (also when the DP size changes), eval batches, prefetch."""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import AutoTokenizer

from moe_sft.data.chat import TokenizedDoc, tokenize_files
from moe_sft.data.loader import DataPlanError, EvalBatches, PackedLoader
from moe_sft.data.sampling import holdout_docs, permute
from moe_sft.data.store import MemoryDocs

DEMO = Path(__file__).resolve().parents[2] / "recipes" / "demo"


def make_docs(n: int, seed: int = 0, lo: int = 4, hi: int = 40, base: int = 0) -> list[TokenizedDoc]:
    """Docs of lo-hi tokens; token ids are (base + doc) * 1000 + position + 1, so ids name their document."""
    rng = random.Random(seed)
    docs = []
    for d in range(n):
        length = rng.randint(lo, hi)
        mask = [rng.random() < 0.4 for _ in range(length)]
        docs.append(TokenizedDoc([(base + d) * 1000 + p + 1 for p in range(length)], mask, source=f"synthetic:{d}"))
    return docs


def doc_ids(batch) -> list[int]:
    return sorted({t // 1000 for t in batch.tokens.tolist() if t})


def same_batches(a, b) -> bool:
    fields = ("tokens", "labels", "loss_mask", "position_ids", "cu_seqlens")
    return len(a) == len(b) and all(
        all(torch.equal(getattr(x, f), getattr(y, f)) for f in fields)
        and (x.max_seqlen, x.num_loss_tokens) == (y.max_seqlen, y.num_loss_tokens)
        for x, y in zip(a, b)
    )


def global_sample_ids(loader: PackedLoader, step: int, dp_size: int) -> list[list[int]]:
    """The documents of every micro-batch of `step`, gathered rank by rank as the trainer's ranks get them."""
    return [doc_ids(mb) for r in range(dp_size) for mb in loader.batches_for_step(step, r, dp_size)[0]]


@pytest.fixture(scope="module")
def docs():
    return make_docs(200)


def test_layout_concrete_values(docs):
    loader = PackedLoader(docs, pack_length=64, global_batch_size=4, seed=3, window=64)
    assert loader.num_samples == 200 and loader.num_windows == 4
    assert [len(loader.epoch_packs(e)) for e in range(2)] == [71, 70]  # packing depends on the order
    assert [loader.steps_in_epoch(e) for e in range(2)] == [17, 17]
    batches, weight = loader.batches_for_step(0)
    assert [b.tokens.numel() for b in batches] == [64, 61, 63, 64]
    assert weight == sum(b.loss_weight_sum for b in batches) == 97.0
    assert loader.step_info(0) == {"data/packing_efficiency": 252 / 256, "data/epoch": 0.0}


@pytest.mark.parametrize("dp_size", [2, 4])
def test_dp_ranks_partition_the_global_batch(docs, dp_size):
    loader = PackedLoader(docs, pack_length=64, global_batch_size=4, seed=3, window=64)
    for step in (0, 5, 16, 17, 33):  # both sides of the epoch boundary
        whole, whole_weight = loader.batches_for_step(step, 0, 1)
        per_rank = [loader.batches_for_step(step, r, dp_size) for r in range(dp_size)]
        assert all(len(b) == 4 // dp_size for b, _ in per_rank)
        assert same_batches([mb for b, _ in per_rank for mb in b], whole)  # ranks in order = the global batch
        # Every rank knows the global normaliser, and it is the sum of all ranks' loss weights.
        assert {w for _, w in per_rank} == {whole_weight}
        assert whole_weight == sum(mb.loss_weight_sum for b, _ in per_rank for mb in b)


@settings(max_examples=40, deadline=None)
@given(
    n=st.integers(1, 120),
    gbs=st.integers(1, 6),
    dp=st.sampled_from([1, 2, 3]),
    window=st.integers(1, 80),
    pack_length=st.sampled_from([40, 64, 100]),
    seed=st.integers(0, 3),
    data=st.data(),
)
def test_each_epoch_is_sharded_without_duplicates_or_gaps(n, gbs, dp, window, pack_length, seed, data):
    gbs *= dp
    docs = make_docs(n, seed=seed)
    try:
        loader = PackedLoader(docs, pack_length=pack_length, global_batch_size=gbs, seed=seed, window=window)
    except DataPlanError as e:  # only when an epoch really packs into fewer micro-batches than one step
        assert "no full step" in str(e)
        one = PackedLoader(docs, pack_length=pack_length, global_batch_size=1, seed=seed, window=window)
        assert len(one.epoch_packs(0)) < gbs
        return
    epoch = data.draw(st.integers(0, 2))
    first = sum(loader.steps_in_epoch(e) for e in range(epoch))
    steps = loader.steps_in_epoch(epoch)
    seen = []
    for step in range(first, first + steps):
        for rank in range(dp):
            batches, _ = loader.batches_for_step(step, rank, dp)
            seen += [d for mb in batches for d in doc_ids(mb)]
    packs = loader.epoch_packs(epoch)
    dropped = [int(d) for p in packs[steps * gbs :] for d in p.docs]
    assert len(seen) == len(set(seen))  # no document twice in an epoch, across ranks and steps
    assert sorted(seen + dropped) == list(range(n))  # no gap: only the dropped last incomplete step is missing
    assert len(packs) - steps * gbs < gbs


def test_shuffle_off_and_order_is_seeded(docs):
    assert permute(np.arange(8), 8, 1).tolist() == permute(np.arange(8), 8, 1).tolist()
    assert permute(np.arange(8), 8, 1).tolist() != permute(np.arange(8), 8, 2).tolist()
    plain = PackedLoader(docs, pack_length=64, global_batch_size=2, shuffle=False, window=64)
    assert [p.docs.tolist() for p in plain.epoch_packs(0)] == [p.docs.tolist() for p in plain.epoch_packs(1)]
    # Unshuffled: the first window's first bin holds its longest document (4: 40 tokens) and the best fit.
    assert plain.epoch_packs(0)[0].docs.tolist() == [4, 44] and (len(docs[4]), len(docs[44])) == (40, 24)
    assert max(len(d) for d in docs[:64]) == 40
    shuffled = PackedLoader(docs, pack_length=64, global_batch_size=2, seed=5, window=64)
    e0, e1 = ([sorted(p.docs.tolist()) for p in shuffled.epoch_packs(e)] for e in (0, 1))
    assert e0 != e1  # reshuffled each epoch


@settings(max_examples=60, deadline=None)
@given(n=st.integers(0, 3000), key=st.integers(0, 2**63))
def test_permutation_is_a_bijection(n, key):
    out = permute(np.arange(n), n, key)
    assert sorted(out.tolist()) == list(range(n))


def test_mixture_weights_and_held_out_split():
    a, b = make_docs(30, seed=1), make_docs(40, seed=2, base=100)
    store = MemoryDocs([a, b])
    loader = PackedLoader(store, pack_length=64, global_batch_size=1, seed=0, window=1000, weights=[2.0, 0.5])
    assert loader.num_samples == 2 * 30 + 20
    drawn = []
    for epoch in range(2):
        packs = loader.epoch_packs(epoch)
        refs = [(int(f), int(d)) for p in packs for f, d in zip(p.sources, p.docs)]
        assert sorted(d for f, d in refs if f == 0) == sorted(list(range(30)) * 2)  # every doc twice
        half = [d for f, d in refs if f == 1]
        assert len(half) == len(set(half)) == 20  # a random half, without replacement
        drawn.append(set(half))
    assert drawn[0] != drawn[1]  # a different half each epoch

    held = PackedLoader(store, pack_length=64, global_batch_size=1, seed=0, window=1000, eval_fraction=0.1)
    assert held.train_sizes == [27, 36] and held.num_samples == 63
    train = {(int(f), int(d)) for p in held.epoch_packs(0) for f, d in zip(p.sources, p.docs)}
    evals = {(f, int(d)) for f, n in enumerate((30, 40)) for d in holdout_docs(n, 0.1, 0, f)}
    assert len(evals) == 7 and not train & evals and len(train | evals) == 70


def _run_ids(loader, steps, dp):
    return {s: global_sample_ids(loader, s, dp) for s in steps}


@pytest.mark.parametrize("dp_before, dp_after", [(2, 2), (2, 1), (1, 2), (2, 4)])
def test_resume_continues_with_the_straight_runs_samples(docs, dp_before, dp_after):
    settings = dict(pack_length=64, global_batch_size=4, seed=7, window=48)
    straight = PackedLoader(docs, **settings)
    expected = _run_ids(straight, range(0, 40), dp_before)  # crosses two epoch boundaries (17 steps each)
    first = PackedLoader(docs, **settings)
    for step in range(0, 12):
        assert global_sample_ids(first, step, dp_before) == expected[step]
        first.next_step = step + 1
    state = json.loads(json.dumps(first.state_dict()))  # survives the checkpoint's serialisation
    resumed = PackedLoader(docs, **settings)  # a new process: nothing cached
    resumed.load_state_dict(state)
    assert resumed.next_step == 12
    assert _run_ids(resumed, range(12, 40), dp_after) == {s: expected[s] for s in range(12, 40)}
    # A second resume, inside the next epoch, from the resumed run's own state.
    resumed.next_step = 25
    again = PackedLoader(docs, **settings)
    again.load_state_dict(json.loads(json.dumps(resumed.state_dict())))
    assert _run_ids(again, range(25, 40), dp_before) == {s: expected[s] for s in range(25, 40)}


def test_state_round_trips_and_guards_resume(docs):
    loader = PackedLoader(docs, pack_length=64, global_batch_size=4, seed=3)
    loader.next_step = 23
    state = json.loads(json.dumps(loader.state_dict()))
    assert loader.steps_in_epoch(0) == 17  # step 23 is step 6 of epoch 1: micro-batch 24 of its only window
    assert state == {
        "version": 2,
        "next_step": 23,
        "cursor": [1, 0, 24],
        "seed": 3,
        "shuffle": True,
        "pack_length": 64,
        "global_batch_size": 4,
        "window": 8192,
        "doc_multiple": 1,
        "weights": [1.0],
        "eval_fraction": 0.0,
        "num_docs": [200],
        "fingerprint": loader.store.fingerprint,
    }
    fresh = PackedLoader(docs, pack_length=64, global_batch_size=4, seed=3, pad_to=8)  # pad_to may change
    fresh.load_state_dict(state)
    assert fresh.next_step == 23
    with pytest.raises(DataPlanError, match=r"data\.seed=4 but the checkpoint was saved with seed=3"):
        PackedLoader(docs, pack_length=64, global_batch_size=4, seed=4).load_state_dict(state)
    with pytest.raises(DataPlanError, match=r"trainer\.global_batch_size=8 but .* global_batch_size=4"):
        PackedLoader(docs, pack_length=64, global_batch_size=8, seed=3).load_state_dict(state)
    with pytest.raises(DataPlanError, match=r"data\.pack_window=100 but .* pack_window=8192"):
        PackedLoader(docs, pack_length=64, global_batch_size=4, seed=3, window=100).load_state_dict(state)
    with pytest.raises(DataPlanError, match=r"data.pad_documents_to=4 but .* pad_documents_to=1; set it back"):
        PackedLoader(docs, pack_length=64, global_batch_size=4, seed=3, doc_multiple=4).load_state_dict(state)
    edited = docs[:10] + [TokenizedDoc(docs[10].input_ids, [not m for m in docs[10].assistant_mask])] + docs[11:]
    with pytest.raises(DataPlanError, match=r"checkpoint's data differs from this run's \(fingerprint"):
        PackedLoader(edited, pack_length=64, global_batch_size=4, seed=3).load_state_dict(state)
    with pytest.raises(DataPlanError, match=r"num_docs: saved \[200\], now \[199\]"):
        PackedLoader(docs[:199], pack_length=64, global_batch_size=4, seed=3).load_state_dict(state)
    with pytest.raises(DataPlanError, match=r"data state version 1 is not 2; .*checkpoint\.resume=never"):
        fresh.load_state_dict(dict(state, version=1))


def test_padding_multiples_are_respected(docs):
    loader = PackedLoader(docs, pack_length=64, global_batch_size=4, seed=3, pad_to=16, doc_multiple=8)
    for step in range(loader.steps_in_epoch(0)):
        for mb in loader.batches_for_step(step)[0]:
            cu = mb.cu_seqlens.tolist()
            assert mb.tokens.numel() % 16 == 0 and mb.tokens.numel() <= 64
            assert all((b - a) % 8 == 0 for a, b in zip(cu, cu[1:]))


def test_plan_errors(docs):
    loader = PackedLoader(docs, pack_length=64, global_batch_size=4)
    with pytest.raises(DataPlanError, match=r"global_batch_size=4 is not divisible by the data-parallel size 3"):
        loader.batches_for_step(0, 0, 3)
    with pytest.raises(DataPlanError, match=r"dp_rank=2, dp_size=2"):
        loader.batches_for_step(0, 2, 2)
    with pytest.raises(DataPlanError, match=r"the 10 samples of an epoch pack into fewer than global_batch_size=8"):
        PackedLoader(docs[:10], pack_length=64, global_batch_size=8)
    with pytest.raises(DataPlanError, match=r"pack_length=60 must be a positive multiple of pad_to=16"):
        PackedLoader(docs, pack_length=60, global_batch_size=4, pad_to=16)
    with pytest.raises(DataPlanError, match="no documents to train on"):
        PackedLoader([], pack_length=64, global_batch_size=4)
    with pytest.raises(DataPlanError, match=r"train_weights has 2 entries for 1 train files"):
        PackedLoader(docs, pack_length=64, global_batch_size=4, weights=[1, 1])


def test_prefetch_gives_the_same_batches(docs):
    loader = PackedLoader(docs, pack_length=64, global_batch_size=4, seed=3)
    direct = PackedLoader(docs, pack_length=64, global_batch_size=4, seed=3, prefetch=False)
    for step in range(20):
        batches = loader.batches_for_step(step, 1, 2)
        loader.prefetch(step + 1, 1, 2)
        assert (
            same_batches(batches[0], direct.batches_for_step(step, 1, 2)[0])
            and batches[1] == direct.batches_for_step(step, 1, 2)[1]
        )


def test_eval_batches_cover_the_set_once_with_equal_counts_per_rank(docs):
    store = MemoryDocs([docs[:150], docs[150:]])
    refs = [(0, d) for d in range(0, 150, 3)] + [(1, d) for d in range(50)]
    evals = EvalBatches(store, refs, 64, window=40, pad_to=8)
    for dp, per_call in ((1, 2), (3, 2), (4, 1)):
        groups = [list(evals.for_rank(r, dp, per_call)) for r in range(dp)]
        assert len({len(g) for g in groups}) == 1 and all(len(c) == per_call for g in groups for c in g)
        batches = [mb for g in groups for call in g for mb in call]
        seen = [t // 1000 for mb in batches for t in mb.tokens.tolist() if t]
        assert sorted(set(seen)) == sorted({d if f == 0 else 150 + d for f, d in refs})
        assert sum(mb.loss_weight_sum for mb in batches) == pytest.approx(
            sum(store.doc(f, d).loss_weight_sum for f, d in refs)
        )
        assert all(mb.tokens.numel() % 8 == 0 for mb in batches)


# ----------------------------------------------------------------------------- packing efficiency


def _lengths_docs(lengths) -> list[TokenizedDoc]:
    return [TokenizedDoc(np.ones(n, dtype=np.int64), np.ones(n, dtype=np.float32)) for n in lengths]


def _efficiency(loader: PackedLoader) -> float:
    packs = loader.epoch_packs(0)
    return sum(p.tokens for p in packs) / (len(packs) * loader.pack_length)


@pytest.fixture(scope="module")
def demo_lengths():
    tok = AutoTokenizer.from_pretrained(str(DEMO / "tokenizer"))
    docs, _ = tokenize_files(tok, [DEMO / "data" / "train.jsonl"], max_seq_len=4096)
    return [len(d) for d in docs]


def long_tail_lengths(n: int, seed: int = 0, max_len: int = 4096) -> list[int]:
    """Lognormal (median ~300 tokens) with a tail to max_len: most SFT sets look like this."""
    rng = np.random.default_rng(seed)
    return np.clip(rng.lognormal(mean=np.log(300), sigma=1.1, size=n), 16, max_len).astype(int).tolist()


def test_packing_efficiency_at_4096_is_at_least_95_percent(demo_lengths):
    demo = PackedLoader(_lengths_docs(demo_lengths), pack_length=4096, global_batch_size=4)
    tail_lengths = long_tail_lengths(10000)
    assert max(tail_lengths) == 4096 and np.median(tail_lengths) < 400
    tail = PackedLoader(_lengths_docs(tail_lengths), pack_length=4096, global_batch_size=8)
    assert _efficiency(demo) >= 0.95 and _efficiency(tail) >= 0.95, (_efficiency(demo), _efficiency(tail))
    # Packing only one global batch's worth of samples at a time is what falls short on the tail.
    small = PackedLoader(_lengths_docs(tail_lengths), pack_length=4096, global_batch_size=8, window=64)
    assert _efficiency(small) < _efficiency(tail) - 0.02


def test_per_document_multiple_for_context_parallelism():
    from moe_sft.config.validate import doc_multiple_for

    # CP splits each document into 2*CP chunks; with SP each CP share is split again over TP.
    assert [
        doc_multiple_for(tp, cp, sp)
        for tp, cp, sp in ((1, 1, False), (2, 1, True), (1, 2, False), (2, 2, True), (4, 4, False))
    ] == [1, 1, 4, 8, 8]


def test_an_epoch_with_no_full_step_is_dropped_and_the_next_one_trains():
    """An epoch's packing follows its shuffle: here epoch 0 packs into 10 micro-batches (one step of
    10) and epoch 1 into 9. Epoch 1 has no full step, so all of it is dropped (as any epoch's
    incomplete last step is) and step 1 is epoch 2's first; before, the run stopped there with
    "no full step" although the data plan had passed at the start."""
    docs = make_docs(34, seed=2)
    loader = PackedLoader(docs, pack_length=100, global_batch_size=10, seed=2, window=11)
    assert [len(loader.epoch_packs(e)) for e in range(3)] == [10, 9, 10]
    assert [loader.steps_in_epoch(e) for e in range(3)] == [1, 0, 1]
    assert {p.epoch for p in loader.step_packs(0)} == {0}
    assert {p.epoch for p in loader.step_packs(1)} == {2}
    assert loader.step_packs(1) == loader.epoch_packs(2)


def test_a_plan_whose_epochs_keep_packing_short_stops_with_the_fix(monkeypatch):
    """Epoch 0 has its one step, but the loader gives up after `_MAX_EMPTY_EPOCHS` epochs in a row
    with none (here 1, so epoch 1 is already too many)."""
    from moe_sft.data import loader as loader_module

    monkeypatch.setattr(loader_module, "_MAX_EMPTY_EPOCHS", 1)
    loader = PackedLoader(make_docs(34, seed=2), pack_length=100, global_batch_size=10, seed=2, window=11)
    with pytest.raises(DataPlanError, match="no full step; lower global_batch_size or pack_length"):
        loader.step_packs(1)
