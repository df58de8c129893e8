"""Optimizer step → this data-parallel rank's packed micro-batches, resumable exactly.

The global stream (the same on every rank, whatever the DP size):

1. Epoch e has N samples (moe_sft.data.sampling: mixture weights, held-out split). Position j of
   the epoch is sample `permute(j, N, key(seed, e))` (or j without shuffling).
2. Positions are cut into windows of `window` samples; each window is packed best-fit
   decreasing into micro-batches of at most `pack_length` tokens (documents padded to
   `doc_multiple` first), and the window's micro-batches are shuffled. Packing over a window
   of thousands of samples, not one global batch, is what keeps packing efficiency >= 95% on
   long-tailed length distributions (docs/data.md).
3. The epoch's micro-batches, window after window, are cut into steps of `global_batch_size`;
   the last incomplete step of an epoch is dropped (a different handful of samples each epoch).
4. DP rank r of `dp` takes the r-th contiguous block of global_batch_size / dp micro-batches, so
   CP/TP/PP ranks of one DP rank get the same micro-batches and every sample of an epoch goes
   to exactly one rank.

The position in the stream is (epoch, window, micro-batch within the window): that and the
settings are the state a checkpoint saves. A resume continues with exactly the samples an
uninterrupted run would have seen, with any DP size, because nothing above depends on the
rank. Every rank also knows the global batch's loss-weight sum (the loss normaliser) without
communication.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np

from moe_sft.data.chat import TokenizedDoc
from moe_sft.data.packing import PackedMicroBatch, best_fit_decreasing, build_micro_batch, padded_length
from moe_sft.data.sampling import Mixture, derive_key, holdout_count, permute, split_index
from moe_sft.data.stats import no_documents_message
from moe_sft.data.store import DocStore, MemoryDocs

STATE_VERSION = 2
_KEEP = 8  # recent steps / windows remembered (the trainer asks in order)
# Epochs in a row that pack into fewer micro-batches than one step before the loader gives up: the
# packing of an epoch depends on its shuffle, so one epoch of a small dataset may pack into one
# micro-batch fewer than the epoch before and have no full step (its packs are all dropped, as
# any epoch's incomplete last step is); a data plan where that keeps happening is an error.
_MAX_EMPTY_EPOCHS = 8


class DataPlanError(ValueError):
    """Settings or a saved state the loader cannot honour; the message names field, value and fix."""


@dataclass(frozen=True)
class Cursor:
    epoch: int = 0
    window: int = 0
    pack: int = 0


@dataclass(frozen=True)
class Pack:
    """One micro-batch's samples: epoch positions, and which document of which source each is."""

    epoch: int
    positions: np.ndarray
    sources: np.ndarray
    docs: np.ndarray
    tokens: int  # real (non-padding) tokens
    loss: float  # Σ loss weights


class PackedLoader:
    """See the module doc. `next_step` is set by the trainer after each step (it is what
    `state_dict` saves); `batches_for_step` is a function of the step alone."""

    def __init__(
        self,
        store: DocStore | Sequence[TokenizedDoc],
        pack_length: int,
        global_batch_size: int,
        *,
        seed: int = 0,
        shuffle: bool = True,
        window: int = 8192,
        weights: Sequence[float] | None = None,
        eval_fraction: float = 0.0,
        pad_to: int = 1,
        doc_multiple: int = 1,
        pad_token_id: int = 0,
        prefetch: bool = True,
    ):
        self.store = store if isinstance(store, DocStore) else MemoryDocs(list(store))
        self.pack_length, self.global_batch_size, self.seed, self.shuffle = (
            pack_length,
            global_batch_size,
            seed,
            shuffle,
        )
        self.window, self.eval_fraction = window, eval_fraction
        self.pad_to, self.doc_multiple, self.pad_token_id = pad_to, doc_multiple, pad_token_id
        self.weights = [1.0] * len(self.store.sizes) if not weights else [float(w) for w in weights]
        _check_settings(self)
        self.train_sizes = [n - holdout_count(n, eval_fraction) for n in self.store.sizes]
        try:
            self.mixture = Mixture(self.train_sizes, self.weights, seed)
        except ValueError as e:
            raise DataPlanError(f"data.train_weights: {e}") from None
        self.num_samples = self.mixture.num_samples
        self.num_windows = -(-self.num_samples // window)
        self.next_step = 0
        self._cursors: dict[int, Cursor] = {0: Cursor()}
        self._steps: OrderedDict[int, list[Pack]] = OrderedDict()
        self._windows: OrderedDict[tuple[int, int], list[Pack]] = OrderedDict()
        self._lock = threading.RLock()
        self._prefetch = prefetch
        self._pool: ThreadPoolExecutor | None = None
        self._pending: dict[tuple, Future] = {}
        if isinstance(self.store, MemoryDocs):
            self._check_lengths()
        self.step_packs(0)  # fails now, not at step 0, when an epoch has no full step

    # ------------------------------------------------------------------ the global stream
    def window_packs(self, epoch: int, window: int) -> list[Pack]:
        """The shuffled micro-batches of one window (cached: the trainer reads windows in order)."""
        key = (epoch, window)
        with self._lock:
            if key not in self._windows:
                self._windows[key] = self._pack_window(epoch, window)
                while len(self._windows) > _KEEP:
                    self._windows.popitem(last=False)
            return self._windows[key]

    def _pack_window(self, epoch: int, window: int) -> list[Pack]:
        positions = np.arange(window * self.window, min((window + 1) * self.window, self.num_samples))
        slots = (
            permute(positions, self.num_samples, derive_key(self.seed, "order", epoch)) if self.shuffle else positions
        )
        sources, train_idx = self.mixture.locate(slots, epoch)
        docs = np.empty_like(train_idx)
        lengths, loss = np.empty(len(slots), np.int64), np.empty(len(slots), np.float64)
        for f in np.unique(sources):
            sel = sources == f
            docs[sel] = split_index(self.store.sizes[f], self.eval_fraction, self.seed, int(f), train_idx[sel])
            lengths[sel] = self.store.lengths(int(f), docs[sel])
            loss[sel] = self.store.loss_sums(int(f), docs[sel])
        need = -(-lengths // self.doc_multiple) * self.doc_multiple
        if len(need) and need.max() > self.pack_length:
            k = int(np.argmax(need))
            raise DataPlanError(
                f"{self.store.names[sources[k]]} document {docs[k]} has {lengths[k]} tokens > "
                f"pack_length={self.pack_length}; set max_seq_len <= pack_length so long "
                "conversations are truncated or dropped"
            )
        bins = best_fit_decreasing(need.tolist(), self.pack_length)
        if self.shuffle:
            rng = np.random.default_rng(derive_key(self.seed, "packs", epoch, window))
            bins = [bins[i] for i in rng.permutation(len(bins))]
        return [
            Pack(epoch, positions[b], sources[b], docs[b], int(lengths[b].sum()), float(loss[b].sum()))
            for b in map(np.asarray, bins)
        ]

    def _advance(self, cursor: Cursor) -> tuple[list[Pack], Cursor]:
        """The global batch starting at `cursor`, and the cursor after it (drop-last per epoch)."""
        epoch, window, pack = cursor.epoch, cursor.window, cursor.pack
        packs: list[Pack] = []
        epoch_start, empty_epochs = window == 0 and pack == 0, 0
        while len(packs) < self.global_batch_size:
            if window >= self.num_windows:  # the epoch ended: its incomplete step is dropped
                empty_epochs += epoch_start
                if epoch_start and (epoch == 0 or empty_epochs >= _MAX_EMPTY_EPOCHS):
                    raise DataPlanError(
                        f"the {self.num_samples} samples of an epoch pack into fewer than global_batch_size="
                        f"{self.global_batch_size} micro-batches of pack_length={self.pack_length}: no full step; "
                        "lower global_batch_size or pack_length, or add data"
                    )
                epoch, window, pack, packs, epoch_start = epoch + 1, 0, 0, [], True
                continue
            available = self.window_packs(epoch, window)
            take = min(self.global_batch_size - len(packs), len(available) - pack)
            packs += available[pack : pack + take]
            pack += take
            if pack == len(available):
                window, pack = window + 1, 0
        return packs, Cursor(epoch, window, pack)

    def _cursor_for(self, step: int) -> Cursor:
        with self._lock:
            if step not in self._cursors:
                known = max(s for s in self._cursors if s <= step)
                while known < step:  # replay (lengths only) from the nearest known position
                    self._remember(known, *self._advance(self._cursors[known]))
                    known += 1
            return self._cursors[step]

    def _remember(self, step: int, packs: list[Pack], after: Cursor) -> None:
        self._steps[step] = packs
        while len(self._steps) > _KEEP:
            self._steps.popitem(last=False)
        self._cursors[step + 1] = after
        for old in [s for s in self._cursors if 0 < s < step - _KEEP and s != self.next_step]:
            del self._cursors[old]

    def step_packs(self, step: int) -> list[Pack]:
        """The global batch of `step` (all DP ranks' micro-batches, in rank order)."""
        if step < 0:
            raise DataPlanError(f"step={step} must be >= 0")
        with self._lock:
            if step not in self._steps:
                self._remember(step, *self._advance(self._cursor_for(step)))
            return self._steps[step]

    # ------------------------------------------------------------------ per rank
    def batches_for_step(self, step: int, dp_rank: int = 0, dp_size: int = 1) -> tuple[list[PackedMicroBatch], float]:
        """This rank's micro-batches of `step` and the loss-weight sum of the whole global batch."""
        future = self._pending.pop((step, dp_rank, dp_size), None)
        return future.result() if future is not None else self._build(step, dp_rank, dp_size)

    def prefetch(self, step: int, dp_rank: int = 0, dp_size: int = 1) -> None:
        """Build `step`'s micro-batches in a background thread (while the current step trains)."""
        if not self._prefetch or (step, dp_rank, dp_size) in self._pending:
            return
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="moe-sft-data")
        self._pending = {k: f for k, f in self._pending.items() if k[0] >= step - 1}
        self._pending[(step, dp_rank, dp_size)] = self._pool.submit(self._build, step, dp_rank, dp_size)

    def _build(self, step: int, dp_rank: int, dp_size: int) -> tuple[list[PackedMicroBatch], float]:
        if dp_size < 1 or not 0 <= dp_rank < dp_size:
            raise DataPlanError(f"dp_rank={dp_rank}, dp_size={dp_size}: need dp_size >= 1 and 0 <= dp_rank < dp_size")
        if self.global_batch_size % dp_size:
            raise DataPlanError(
                f"global_batch_size={self.global_batch_size} is not divisible by the data-parallel size {dp_size}; "
                f"use a multiple of {dp_size}"
            )
        packs = self.step_packs(step)
        per_rank = self.global_batch_size // dp_size
        mine = packs[dp_rank * per_rank : (dp_rank + 1) * per_rank]
        return [self.micro_batch(p) for p in mine], sum(p.loss for p in packs)

    def micro_batch(self, pack: Pack) -> PackedMicroBatch:
        docs = [self.store.doc(int(f), int(d)) for f, d in zip(pack.sources, pack.docs)]
        return build_micro_batch(
            docs, pad_to=self.pad_to, pad_token_id=self.pad_token_id, doc_multiple=self.doc_multiple
        )

    # ------------------------------------------------------------------ reporting
    def step_info(self, step: int) -> dict[str, float]:
        """Packing efficiency (real tokens / capacity) and the epoch (fractional) of `step`."""
        packs, cursor = self.step_packs(step), self._cursor_for(step)
        real = sum(p.tokens for p in packs)
        done = cursor.window
        if cursor.window < self.num_windows:
            done += cursor.pack / len(self.window_packs(cursor.epoch, cursor.window))
        return {
            "data/packing_efficiency": real / (len(packs) * self.pack_length),
            "data/epoch": cursor.epoch + done / self.num_windows,
        }

    def sample_ids(self, step: int) -> list[list[tuple[int, int]]]:
        """Per micro-batch of the global batch: (source, document) of each sample."""
        return [list(zip(p.sources.tolist(), p.docs.tolist())) for p in self.step_packs(step)]

    def epoch_packs(self, epoch: int) -> list[Pack]:
        """Every micro-batch of `epoch`, before the last incomplete step is dropped."""
        return [p for w in range(self.num_windows) for p in self.window_packs(epoch, w)]

    def steps_in_epoch(self, epoch: int) -> int:
        return len(self.epoch_packs(epoch)) // self.global_batch_size

    def estimate_steps_per_epoch(self) -> float:
        """From the first window's packing (exact when one window holds the epoch)."""
        packs = self.window_packs(0, 0)
        share = sum(len(p.positions) for p in packs) / max(self.num_samples, 1)
        return len(packs) / max(share, 1e-12) / self.global_batch_size

    # ------------------------------------------------------------------ resume
    def state_dict(self) -> dict:
        """The data position plus what must match to resume it (pad_to and the DP size may change)."""
        cursor = self._cursor_for(self.next_step)
        return {
            "version": STATE_VERSION,
            "next_step": self.next_step,
            "cursor": [cursor.epoch, cursor.window, cursor.pack],
            **self._settings(),
        }

    def _settings(self) -> dict:
        return {
            "seed": self.seed,
            "shuffle": self.shuffle,
            "pack_length": self.pack_length,
            "global_batch_size": self.global_batch_size,
            "window": self.window,
            "doc_multiple": self.doc_multiple,
            "weights": self.weights,
            "eval_fraction": self.eval_fraction,
            "num_docs": list(self.store.sizes),
            "fingerprint": self.store.fingerprint,
        }

    def load_state_dict(self, state: dict) -> None:
        """Restore the position; any mismatch of data or packing settings is an error naming the field."""
        if state.get("version") != STATE_VERSION:
            raise DataPlanError(
                f"data state version {state.get('version')!r} is not {STATE_VERSION}; it was written by another "
                "moe_sft data loader, whose sample order this one cannot reproduce; start a new run "
                "(checkpoint.resume=never) or resume with that version"
            )
        current = self._settings()
        missing = sorted(set(current) - set(state))
        if missing:
            raise DataPlanError(f"data state lacks {missing}; it is not a PackedLoader.state_dict()")
        for key in ("num_docs", "fingerprint"):
            if state[key] != current[key]:
                raise DataPlanError(
                    f"the checkpoint's data differs from this run's ({key}: saved {state[key]!r}, now {current[key]!r}); "
                    "resume with the same data files, tokenizer and data settings, or start a new run"
                )
        for key, (name, how) in _RESUME_FIELDS.items():
            if state[key] != current[key]:
                raise DataPlanError(
                    f"{name}={current[key]!r} but the checkpoint was saved with {name.split('.')[-1]}={state[key]!r}{how}; "
                    "set it back to resume (the data position of one setting does not map to another), or start a new run"
                )
        with self._lock:
            self.next_step = int(state["next_step"])
            self._cursors = {0: Cursor(), self.next_step: Cursor(*state["cursor"])}
            self._steps.clear()
            self._pending.clear()

    def _check_lengths(self) -> None:
        for f, n in enumerate(self.store.sizes):
            lengths = self.store.lengths(f, np.arange(n))
            if n and lengths.max() > self.pack_length:
                k = int(np.argmax(lengths))
                doc = self.store.doc(f, k)
                raise DataPlanError(
                    f"{getattr(doc, 'source', '') or f'document {k}'} has {lengths[k]} tokens > "
                    f"pack_length={self.pack_length}; set max_seq_len <= pack_length so long "
                    "conversations are truncated or dropped"
                )


# The loader settings a resume must keep: the recipe field that sets each (and what else may set it).
_RESUME_FIELDS = {
    "seed": ("data.seed", ""),
    "shuffle": ("data.shuffle", ""),
    "pack_length": ("data.pack_length", ""),
    "global_batch_size": ("trainer.global_batch_size", " (trainer.global_batch_tokens decides it when set)"),
    "window": ("data.pack_window", ""),
    "doc_multiple": ("data.pad_documents_to", ""),
    "weights": ("data.train_weights", ""),
    "eval_fraction": ("data.eval_fraction", ""),
}


def _check_settings(loader: PackedLoader) -> None:
    if not sum(loader.store.sizes):  # every row skipped or dropped: say which and why
        raise DataPlanError(no_documents_message(getattr(loader.store, "caches", [])))
    if loader.global_batch_size < 1:
        raise DataPlanError(f"trainer.global_batch_size={loader.global_batch_size} must be >= 1")
    if loader.window < 1:
        raise DataPlanError(f"data.pack_window={loader.window} must be >= 1")
    m = loader.doc_multiple
    if (
        loader.pad_to < 1
        or m < 1
        or loader.pack_length < 1
        or loader.pack_length % loader.pad_to
        or loader.pack_length % m
    ):
        raise DataPlanError(
            f"pack_length={loader.pack_length} must be a positive multiple of pad_to={loader.pad_to} and of the "
            f"per-document multiple {m}, so padded micro-batches never exceed pack_length"
        )
    if len(loader.weights) != len(loader.store.sizes):
        raise DataPlanError(
            f"data.train_weights has {len(loader.weights)} entries for {len(loader.store.sizes)} "
            "train files; give one weight per file (or none)"
        )
    if not 0 <= loader.eval_fraction < 1:
        raise DataPlanError(f"data.eval_fraction={loader.eval_fraction} must be in [0, 1)")


class EvalBatches:
    """The evaluation set packed once (best-fit decreasing, fixed order) and dealt to DP ranks.

    Every rank gets the same number of micro-batches (ranks short of one get a padding-only
    micro-batch with weight 0), because expert-parallel and pipeline schedules need all ranks of
    a step to run the same number of micro-batches.
    """

    def __init__(
        self,
        store: DocStore,
        refs: Sequence[tuple[int, int]],
        pack_length: int,
        *,
        window: int = 8192,
        pad_to: int = 1,
        doc_multiple: int = 1,
        pad_token_id: int = 0,
    ):
        self.store, self.pad_to, self.doc_multiple, self.pad_token_id = store, pad_to, doc_multiple, pad_token_id
        refs = np.asarray(list(refs), dtype=np.int64).reshape(-1, 2)
        self.num_samples, self.num_tokens, self.packs = len(refs), 0, []
        for lo in range(0, len(refs), window):
            part = refs[lo : lo + window]
            lengths = np.empty(len(part), dtype=np.int64)
            for f in np.unique(part[:, 0]):
                sel = part[:, 0] == f
                lengths[sel] = self.store.lengths(int(f), part[sel, 1])
            self.num_tokens += int(lengths.sum())
            need = [padded_length(int(n), doc_multiple) for n in lengths]
            self.packs += [part[np.asarray(b)] for b in best_fit_decreasing(need, pack_length)]

    def for_rank(self, dp_rank: int, dp_size: int, per_call: int) -> Iterator[list[PackedMicroBatch]]:
        """Groups of `per_call` micro-batches (one forward-only schedule call each; the same count on
        every rank and per call, as pipeline schedules need)."""
        per_rank = padded_length(-(-len(self.packs) // dp_size), per_call)
        mine = self.packs[dp_rank * per_rank : (dp_rank + 1) * per_rank]
        for lo in range(0, per_rank, per_call):
            yield [
                self._micro_batch(mine[i] if i < len(mine) else None) for i in range(lo, min(lo + per_call, per_rank))
            ]

    def _micro_batch(self, pack: np.ndarray | None) -> PackedMicroBatch:
        docs = (
            [TokenizedDoc([self.pad_token_id], [0.0])]
            if pack is None
            else [self.store.doc(int(f), int(d)) for f, d in pack]
        )
        return build_micro_batch(
            docs, pad_to=self.pad_to, pad_token_id=self.pad_token_id, doc_multiple=self.doc_multiple
        )
