"""Document stores the loader reads from: sources (data files) of documents addressed by index.

`CachedDocs` reads the memory-mapped per-file caches (training); `MemoryDocs` holds a list of
documents (tests, small tools). Both answer lengths and loss-weight sums for many documents at
once without materialising them, and one document's arrays on demand.
"""

from __future__ import annotations

import abc
import hashlib
from collections.abc import Sequence

import numpy as np

from moe_sft.data.chat import TokenizedDoc


class DocStore(abc.ABC):
    """Interface: `sizes[f]` documents in source f; global id = `starts[f] + index`."""

    sizes: list[int]
    names: list[str]
    fingerprint: str

    @property
    def starts(self) -> np.ndarray:
        return np.cumsum([0] + list(self.sizes))

    @abc.abstractmethod
    def lengths(self, source: int, idx: np.ndarray) -> np.ndarray:
        """Token count of each document `idx` of `source`."""

    @abc.abstractmethod
    def loss_sums(self, source: int, idx: np.ndarray) -> np.ndarray:
        """Sum of the loss weights of each document `idx` of `source`."""

    @abc.abstractmethod
    def doc(self, source: int, index: int) -> TokenizedDoc:
        """One document's token ids and loss weights."""


class MemoryDocs(DocStore):
    """Documents in memory; each inner list is one source."""

    def __init__(self, sources: Sequence[Sequence[TokenizedDoc]] | Sequence[TokenizedDoc], names=None):
        if sources and not isinstance(sources[0], (list, tuple)):
            sources = [sources]
        self.docs = [list(s) for s in sources]
        self.sizes = [len(s) for s in self.docs]
        self.names = list(names or [f"source{i}" for i in range(len(self.docs))])
        self._lengths = [np.array([len(d.input_ids) for d in s], dtype=np.int64) for s in self.docs]
        self._loss = [np.array([_loss_sum(d) for d in s], dtype=np.float64) for s in self.docs]
        digest = hashlib.sha256()
        for s in self.docs:
            for d in s:
                digest.update(np.asarray(d.input_ids, dtype=np.int64).tobytes())
                digest.update(np.asarray(_weights(d), dtype=np.float32).tobytes())
            digest.update(b"|")
        self.fingerprint = digest.hexdigest()[:16]

    def lengths(self, source: int, idx: np.ndarray) -> np.ndarray:
        return self._lengths[source][np.asarray(idx, dtype=np.int64)]

    def loss_sums(self, source: int, idx: np.ndarray) -> np.ndarray:
        return self._loss[source][np.asarray(idx, dtype=np.int64)]

    def doc(self, source: int, index: int) -> TokenizedDoc:
        return self.docs[source][int(index)]


class CachedDocs(DocStore):
    """The memory-mapped caches of data files (moe_sft.data.cache.FileCache), one source each."""

    def __init__(self, caches: Sequence):
        self.caches = list(caches)
        self.sizes = [len(c) for c in self.caches]
        self.names = [c.source for c in self.caches]
        # From the content, not the cache keys: touching a file (new mtime, same rows) keeps a resume valid.
        digest = hashlib.sha256()
        for c in self.caches:
            s = c.stats
            digest.update(repr((len(c), s.tokens, s.loss_tokens, s.histogram)).encode())
            digest.update(np.asarray(c.tokens[:4096]).tobytes() + np.asarray(c.tokens[-4096:]).tobytes())
            digest.update(np.asarray(c.loss[:4096]).tobytes() + np.asarray(c.loss[-4096:]).tobytes())
        self.fingerprint = digest.hexdigest()[:16]

    def lengths(self, source: int, idx: np.ndarray) -> np.ndarray:
        return self.caches[source].lengths(idx)

    def loss_sums(self, source: int, idx: np.ndarray) -> np.ndarray:
        return self.caches[source].loss_sums(idx)

    def doc(self, source: int, index: int) -> TokenizedDoc:
        return self.caches[source].doc(int(index))


def _weights(doc) -> Sequence[float]:
    weights = getattr(doc, "loss_weights", None)
    return doc.assistant_mask if weights is None else weights


def _loss_sum(doc) -> float:
    return float(np.asarray(_weights(doc)[1:], dtype=np.float64).sum())
