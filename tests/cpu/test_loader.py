"""The step → global batch plan: DP partition, loss normalizer, epochs, exact resume."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer

from moe_sft.data.chat import TokenizedDoc, tokenize_files
from moe_sft.data.loader import DataPlanError, PackedBatchPlan, epoch_order

DEMO = Path(__file__).resolve().parents[2] / "recipes" / "demo"


def make_docs(n: int, seed: int = 0) -> list[TokenizedDoc]:
    """Docs of 4-40 tokens; token ids are doc * 1000 + position + 1, so ids name their document."""
    rng = random.Random(seed)
    docs = []
    for d in range(n):
        length = rng.randint(4, 40)
        mask = [rng.random() < 0.4 for _ in range(length)]
        docs.append(TokenizedDoc([d * 1000 + p + 1 for p in range(length)], mask, source=f"synthetic:{d}"))
    return docs


def doc_ids(batch) -> set[int]:
    return {t // 1000 for t in batch.tokens.tolist() if t}


def same_batches(a, b) -> bool:
    fields = ("tokens", "labels", "loss_mask", "position_ids", "cu_seqlens")
    return len(a) == len(b) and all(
        all(torch.equal(getattr(x, f), getattr(y, f)) for f in fields)
        and (x.max_seqlen, x.num_loss_tokens) == (y.max_seqlen, y.num_loss_tokens)
        for x, y in zip(a, b)
    )


@pytest.fixture(scope="module")
def docs():
    return make_docs(200)


def test_layout_concrete_values(docs):
    plan = PackedBatchPlan(docs, pack_length=64, global_batch_size=4, seed=3)
    assert [len(plan.epoch_packs(e)) for e in range(3)] == [70, 70, 71]
    assert plan.steps_per_epoch == 17
    assert [plan.steps_in_epoch(e) for e in range(3)] == [17, 17, 17]
    assert plan.total_steps(3) == 51
    assert [plan.locate(s) for s in (0, 16, 17, 40)] == [(0, 0), (0, 16), (1, 0), (2, 6)]
    batches, n_loss = plan.batches_for_step(0)
    assert [b.tokens.numel() for b in batches] == [63, 64, 64, 63]
    assert n_loss == 92 == sum(b.num_loss_tokens for b in batches)


@pytest.mark.parametrize("dp_size", [2, 4])
def test_dp_ranks_partition_the_global_batch(docs, dp_size):
    plan = PackedBatchPlan(docs, pack_length=64, global_batch_size=4, seed=3)
    for step in (0, 5, 16, 17, 33):  # both sides of the epoch boundary
        whole, whole_loss = plan.batches_for_step(step, 0, 1)
        per_rank = [plan.batches_for_step(step, r, dp_size) for r in range(dp_size)]
        assert all(len(b) == 4 // dp_size for b, _ in per_rank)
        assert same_batches([mb for b, _ in per_rank for mb in b], whole)  # ranks in order = the global batch
        seen = [doc_ids(mb) for b, _ in per_rank for mb in b]
        assert sum(map(len, seen)) == len(set().union(*seen))  # no document on two ranks/micro-batches
        # Every rank knows the global normalizer, and it is the sum of all ranks' loss tokens.
        assert {loss for _, loss in per_rank} == {whole_loss}
        assert whole_loss == sum(mb.num_loss_tokens for b, _ in per_rank for mb in b)


def test_each_epoch_sees_each_document_at_most_once(docs):
    plan = PackedBatchPlan(docs, pack_length=64, global_batch_size=4, seed=3)
    for epoch, first_step in ((0, 0), (1, 17)):
        seen = []
        for step in range(first_step, first_step + plan.steps_in_epoch(epoch)):
            seen += [d for mb in plan.batches_for_step(step)[0] for d in doc_ids(mb)]
        dropped = {d for pack in plan.epoch_packs(epoch)[plan.steps_in_epoch(epoch) * 4 :] for d in pack}
        assert len(seen) == len(set(seen))
        assert set(seen) | dropped == set(range(200)) and not set(seen) & dropped
    assert plan.epoch_packs(0) != plan.epoch_packs(1)  # reshuffled each epoch


def test_shuffle_off_and_order_is_seeded():
    assert epoch_order(5, seed=0, epoch=0, shuffle=False) == [0, 1, 2, 3, 4]
    assert epoch_order(8, seed=1, epoch=0, shuffle=True) == epoch_order(8, seed=1, epoch=0, shuffle=True)
    assert epoch_order(8, seed=1, epoch=0, shuffle=True) != epoch_order(8, seed=1, epoch=1, shuffle=True)
    plan = PackedBatchPlan(make_docs(50), pack_length=64, global_batch_size=2, shuffle=False)
    assert plan.epoch_packs(0) == plan.epoch_packs(1)
    assert plan.epoch_packs(0)[0] == [0, 2, 5]  # unshuffled: first-fit over documents in file order


def test_state_round_trips_and_guards_resume(docs):
    plan = PackedBatchPlan(docs, pack_length=64, global_batch_size=4, seed=3)
    plan.next_step = 23
    state = json.loads(json.dumps(plan.state_dict()))  # survives JSON (checkpoint metadata)
    assert state == {
        "version": 1, "next_step": 23, "seed": 3, "shuffle": True, "pack_length": 64,
        "global_batch_size": 4, "num_docs": 200, "fingerprint": plan.fingerprint,
    }
    fresh = PackedBatchPlan(docs, pack_length=64, global_batch_size=4, seed=3, pad_to=8)  # pad_to may change
    fresh.load_state_dict(state)
    assert fresh.next_step == 23
    with pytest.raises(DataPlanError, match=r"data\.seed=4 but the checkpoint was saved with seed=3"):
        PackedBatchPlan(docs, pack_length=64, global_batch_size=4, seed=4).load_state_dict(state)
    with pytest.raises(DataPlanError, match=r"data\.global_batch_size=8 but .* global_batch_size=4"):
        PackedBatchPlan(docs, pack_length=64, global_batch_size=8, seed=3).load_state_dict(state)
    edited = docs[:10] + [TokenizedDoc(docs[10].input_ids, [not m for m in docs[10].assistant_mask])] + docs[11:]
    with pytest.raises(DataPlanError, match=r"checkpoint's data differs from this run's \(fingerprint"):
        PackedBatchPlan(edited, pack_length=64, global_batch_size=4, seed=3).load_state_dict(state)
    with pytest.raises(DataPlanError, match=r"num_docs: saved 200, now 199"):
        PackedBatchPlan(docs[:199], pack_length=64, global_batch_size=4, seed=3).load_state_dict(state)


def test_resume_from_step_k_matches_straight_run(docs):
    straight = PackedBatchPlan(docs, pack_length=64, global_batch_size=4, seed=7)
    expected = {(s, r): straight.batches_for_step(s, r, 2) for s in range(12, 22) for r in range(2)}
    straight.next_step = 12
    state = straight.state_dict()
    # A new process: new plan object, nothing cached, resumed at step 12 (epoch 0 ends at 17).
    resumed = PackedBatchPlan(docs, pack_length=64, global_batch_size=4, seed=7)
    resumed.load_state_dict(state)
    for step in range(resumed.next_step, 22):
        for rank in range(2):
            batches, loss = resumed.batches_for_step(step, rank, 2)
            assert same_batches(batches, expected[step, rank][0]) and loss == expected[step, rank][1]
    # Resuming on 4 data-parallel ranks instead of 2 replays the same global batches.
    for step in range(12, 22):
        four = [mb for r in range(4) for mb in resumed.batches_for_step(step, r, 4)[0]]
        assert same_batches(four, expected[step, 0][0] + expected[step, 1][0])


def test_pad_to_respected_within_pack_length(docs):
    plan = PackedBatchPlan(docs, pack_length=64, global_batch_size=4, seed=3, pad_to=16, pad_token_id=0)
    sizes = [mb.tokens.numel() for s in range(plan.steps_per_epoch) for mb in plan.batches_for_step(s)[0]]
    assert all(size % 16 == 0 and size <= 64 for size in sizes)
    assert sizes[:4] == [64, 64, 64, 64]


def test_plan_errors(docs):
    plan = PackedBatchPlan(docs, pack_length=64, global_batch_size=4)
    with pytest.raises(DataPlanError, match=r"global_batch_size=4 is not divisible by the data-parallel size 3"):
        plan.batches_for_step(0, 0, 3)
    with pytest.raises(DataPlanError, match=r"dp_rank=2, dp_size=2"):
        plan.batches_for_step(0, 2, 2)
    with pytest.raises(DataPlanError, match=r"4 micro-batches of pack_length=64, fewer than global_batch_size=8"):
        PackedBatchPlan(docs[:10], pack_length=64, global_batch_size=8)
    with pytest.raises(DataPlanError, match=r"pack_length=60 must be a positive multiple of pad_to=16"):
        PackedBatchPlan(docs, pack_length=60, global_batch_size=4, pad_to=16)
    with pytest.raises(DataPlanError, match="no documents to train on"):
        PackedBatchPlan([], pack_length=64, global_batch_size=4)


def test_demo_data_end_to_end(tmp_path):
    tok = AutoTokenizer.from_pretrained(str(DEMO / "tokenizer"))
    lines = (DEMO / "data" / "train.jsonl").read_text().splitlines()[:240]
    subset = tmp_path / "subset.jsonl"
    subset.write_text("\n".join(lines) + "\n")
    docs, stats = tokenize_files(tok, [subset], max_seq_len=128)
    assert (stats.n_rows, stats.n_dropped, stats.n_truncated) == (240, 0, 0)
    plan = PackedBatchPlan(docs, 256, global_batch_size=4, seed=1234, pad_to=8, pad_token_id=tok.pad_token_id)
    assert plan.steps_per_epoch == len(plan.epoch_packs(0)) // 4 > 0
    total = 0
    for step in range(plan.steps_per_epoch):
        ranks = [plan.batches_for_step(step, r, 2) for r in range(2)]
        assert ranks[0][1] == ranks[1][1] == sum(mb.num_loss_tokens for b, _ in ranks for mb in b)
        total += ranks[0][1]
    dropped = sum(docs[i].num_loss_tokens for p in plan.epoch_packs(0)[plan.steps_per_epoch * 4 :] for i in p)
    assert total + dropped == stats.n_loss_tokens
