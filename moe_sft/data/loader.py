"""A deterministic, resumable plan: optimizer step → the packed micro-batches of that step.

Per epoch e the documents are permuted with a seed derived from (seed, e), packed first-fit into
micro-batches of at most `pack_length` tokens, and the micro-batches are cut into steps of
`global_batch_size` (micro-batches per optimizer step across all data-parallel ranks). The last
incomplete step of an epoch is dropped; since every epoch has its own permutation, a different
handful of documents is skipped each epoch, and no step mixes two epochs (so "epoch" stays exact).

Everything is a function of (documents, pack_length, global_batch_size, seed, shuffle), so:
* any rank computes any step without communication, including the loss normalizer: the number
  of assistant tokens in the *whole* global batch (loss = sum(token_loss * mask) / that count);
* resuming is exact: the state is just the next step index, plus checks that the data and the
  settings are the same as when the state was saved;
* the data-parallel size may change between runs: the global batch, not the rank, is the unit.
"""

from __future__ import annotations

import hashlib
import random
from array import array
from collections.abc import Sequence

from moe_sft.data.packing import Doc, PackedMicroBatch, build_micro_batch, pack_documents

STATE_VERSION = 1
_CACHED_EPOCHS = 2  # a run reads epochs in order; keep the current and the previous one


class DataPlanError(ValueError):
    """Settings or a saved state the plan cannot honour; the message names field, value and fix."""


def dataset_fingerprint(docs: Sequence[Doc]) -> str:
    """sha256 over every document's ids and mask, in order: resuming on other data is then an error."""
    digest = hashlib.sha256()
    for doc in docs:
        digest.update(len(doc.input_ids).to_bytes(8, "little"))
        digest.update(array("q", doc.input_ids).tobytes())
        digest.update(bytes(bool(m) for m in doc.assistant_mask))
    return digest.hexdigest()[:16]


def epoch_order(n_docs: int, seed: int, epoch: int, shuffle: bool) -> list[int]:
    """Document order for one epoch.

    Seeding `random.Random` with a string hashes it with sha512 (not Python's salted `hash`), so
    the order is the same in every process and run; random.shuffle's algorithm is stable across
    Python 3 releases.
    """
    order = list(range(n_docs))
    if shuffle:
        random.Random(f"moe_sft.data:{seed}:{epoch}").shuffle(order)
    return order


class PackedBatchPlan:
    """Step-indexed access to packed global batches; see the module docstring.

    The trainer sets `next_step` after each optimizer step (it is what `state_dict` saves);
    `batches_for_step` itself is stateless.
    """

    def __init__(
        self,
        docs: Sequence[Doc],
        pack_length: int,
        global_batch_size: int,
        *,
        seed: int = 0,
        shuffle: bool = True,
        pad_to: int = 1,
        pad_token_id: int = 0,
    ):
        _check_settings(docs, pack_length, global_batch_size, pad_to)
        self.docs = docs
        self.pack_length = pack_length
        self.global_batch_size = global_batch_size
        self.seed = seed
        self.shuffle = shuffle
        self.pad_to = pad_to
        self.pad_token_id = pad_token_id
        self.next_step = 0
        self._lengths = [len(doc.input_ids) for doc in docs]
        self._loss_tokens = [sum(bool(m) for m in doc.assistant_mask[1:]) for doc in docs]
        self._packs: dict[int, list[list[int]]] = {}
        self._steps_in_epoch: dict[int, int] = {}
        self._fingerprint: str | None = None
        if self.steps_per_epoch == 0:
            raise DataPlanError(
                f"the {len(docs)} documents pack into {len(self.epoch_packs(0))} micro-batches of pack_length="
                f"{pack_length}, fewer than global_batch_size={global_batch_size}: no full step; lower "
                "global_batch_size or pack_length, or add data"
            )

    @property
    def fingerprint(self) -> str:
        if self._fingerprint is None:  # computed lazily: it reads every token once
            self._fingerprint = dataset_fingerprint(self.docs)
        return self._fingerprint

    @property
    def steps_per_epoch(self) -> int:
        """Optimizer steps in epoch 0. Later epochs may differ by a step or so (packing depends on order)."""
        return self.steps_in_epoch(0)

    def steps_in_epoch(self, epoch: int) -> int:
        if epoch not in self._steps_in_epoch:
            self._steps_in_epoch[epoch] = len(self.epoch_packs(epoch)) // self.global_batch_size
        return self._steps_in_epoch[epoch]

    def total_steps(self, num_epochs: int) -> int:
        """Optimizer steps in the first `num_epochs` epochs."""
        return sum(self.steps_in_epoch(e) for e in range(num_epochs))

    def epoch_packs(self, epoch: int) -> list[list[int]]:
        """The micro-batches of `epoch`, as lists of document indices (drop-last not yet applied)."""
        if epoch not in self._packs:
            order = epoch_order(len(self.docs), self.seed, epoch, self.shuffle)
            if len(self._packs) >= _CACHED_EPOCHS:
                del self._packs[min(self._packs)]
            self._packs[epoch] = pack_documents(self._lengths, self.pack_length, order)
        return self._packs[epoch]

    def locate(self, step: int) -> tuple[int, int]:
        """(epoch, step within that epoch) of global optimizer step `step` (0-based)."""
        if step < 0:
            raise DataPlanError(f"step={step} must be >= 0")
        epoch = 0
        while step >= self.steps_in_epoch(epoch):
            if self.steps_in_epoch(epoch) == 0:
                raise DataPlanError(
                    f"epoch {epoch} packs into fewer than global_batch_size={self.global_batch_size} micro-batches; "
                    "lower global_batch_size or pack_length"
                )
            step -= self.steps_in_epoch(epoch)
            epoch += 1
        return epoch, step

    def step_doc_indices(self, step: int) -> list[list[int]]:
        """Document indices of the `global_batch_size` micro-batches of `step`, all ranks."""
        epoch, offset = self.locate(step)
        start = offset * self.global_batch_size
        return self.epoch_packs(epoch)[start : start + self.global_batch_size]

    def batches_for_step(self, step: int, dp_rank: int = 0, dp_size: int = 1) -> tuple[list[PackedMicroBatch], int]:
        """This rank's micro-batches for `step` and the assistant-token count of the whole global batch.

        Rank r gets the r-th contiguous block of global_batch_size / dp_size micro-batches.
        """
        if dp_size < 1 or not 0 <= dp_rank < dp_size:
            raise DataPlanError(f"dp_rank={dp_rank}, dp_size={dp_size}: need dp_size >= 1 and 0 <= dp_rank < dp_size")
        if self.global_batch_size % dp_size:
            raise DataPlanError(
                f"global_batch_size={self.global_batch_size} is not divisible by the data-parallel size {dp_size}; "
                f"use a multiple of {dp_size}"
            )
        packs = self.step_doc_indices(step)
        global_loss_tokens = sum(self._loss_tokens[i] for pack in packs for i in pack)
        per_rank = self.global_batch_size // dp_size
        mine = packs[dp_rank * per_rank : (dp_rank + 1) * per_rank]
        batches = [
            build_micro_batch([self.docs[i] for i in pack], pad_to=self.pad_to, pad_token_id=self.pad_token_id)
            for pack in mine
        ]
        return batches, global_loss_tokens

    def state_dict(self) -> dict:
        """The data position plus what must match to resume it (pad_to and dp_size may change)."""
        return {
            "version": STATE_VERSION,
            "next_step": self.next_step,
            "seed": self.seed,
            "shuffle": self.shuffle,
            "pack_length": self.pack_length,
            "global_batch_size": self.global_batch_size,
            "num_docs": len(self.docs),
            "fingerprint": self.fingerprint,
        }

    def load_state_dict(self, state: dict) -> None:
        """Restore `next_step`; any mismatch of data or packing settings is an error naming the field."""
        if state.get("version") != STATE_VERSION:
            raise DataPlanError(
                f"data state version {state.get('version')!r} is not {STATE_VERSION}; it was written by another moe_sft"
            )
        current = self.state_dict()
        missing = sorted(set(current) - set(state))
        if missing:
            raise DataPlanError(f"data state lacks {missing}; it is not a PackedBatchPlan.state_dict()")
        for key in ("num_docs", "fingerprint"):
            if state[key] != current[key]:
                raise DataPlanError(
                    f"the checkpoint's data differs from this run's ({key}: saved {state[key]!r}, "
                    f"now {current[key]!r}); "
                    "resume with the same data files, tokenizer and max_seq_len, or start a new run"
                )
        for key in ("seed", "shuffle", "pack_length", "global_batch_size"):
            if state[key] != current[key]:
                raise DataPlanError(
                    f"data.{key}={current[key]!r} but the checkpoint was saved with {key}={state[key]!r}; set it back "
                    "to resume (the data position of one setting does not map to another), or start a new run"
                )
        self.next_step = int(state["next_step"])


def _check_settings(docs: Sequence[Doc], pack_length: int, global_batch_size: int, pad_to: int) -> None:
    if not docs:
        raise DataPlanError("no documents to train on; check the data paths and the overlong/max_seq_len settings")
    if global_batch_size < 1:
        raise DataPlanError(f"global_batch_size={global_batch_size} must be >= 1")
    if pad_to < 1 or pack_length < 1 or pack_length % pad_to:
        raise DataPlanError(
            f"pack_length={pack_length} must be a positive multiple of pad_to={pad_to}, so padded micro-batches "
            "never exceed pack_length"
        )
    longest = max(range(len(docs)), key=lambda i: len(docs[i].input_ids))
    if len(docs[longest].input_ids) > pack_length:
        source = getattr(docs[longest], "source", "") or f"document {longest}"
        raise DataPlanError(
            f"{source} has {len(docs[longest].input_ids)} tokens > pack_length={pack_length}; "
            "set max_seq_len <= pack_length so long conversations are truncated or dropped"
        )
