"""Which document is sample j of epoch e: seeded permutations, mixture weights, held-out splits.

All orders are computed, not stored: `permute(i, n, key)` is a keyed bijection of [0, n) (a
4-round Feistel network on the next even power of two, with cycle walking back into [0, n);
Black & Rogaway 2002, "Ciphers with arbitrary finite domains"). Any position is mapped in O(1)
time and memory, so the order of a billion-sample epoch costs nothing to hold, every rank
computes any part of it without communication, and a resume needs only the position.

Mixture: source f (one data file) with n_f training documents and weight w_f contributes
floor(w_f) full passes plus round(frac(w_f) * n_f) documents drawn without replacement (a
different draw each epoch) to every epoch; its share of the mixture is w_f*n_f / Σ w*n.
Held-out split (data.eval_fraction): the first round(fraction * n_f) positions of a fixed
permutation of file f are evaluation documents, the rest are training documents.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import numpy as np

_ROUNDS = 4
_M1, _M2 = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)  # splitmix64 finaliser


def derive_key(*parts: object) -> int:
    """A 64-bit key from any printable parts (sha256: stable across processes and Python versions)."""
    digest = hashlib.sha256(":".join(map(str, ("moe_sft.data", *parts))).encode()).digest()
    return int.from_bytes(digest[:8], "little")


def _mix(x: np.ndarray, key: np.uint64) -> np.ndarray:
    z = x ^ key
    z = (z ^ (z >> np.uint64(30))) * _M1
    z = (z ^ (z >> np.uint64(27))) * _M2
    return z ^ (z >> np.uint64(31))


def _feistel(x: np.ndarray, half: int, keys: list[np.uint64]) -> np.ndarray:
    mask = np.uint64((1 << half) - 1)
    left, right = x >> np.uint64(half), x & mask
    for key in keys:
        left, right = right, left ^ (_mix(right, key) & mask)
    return (left << np.uint64(half)) | right


def permute(positions: np.ndarray | Sequence[int] | int, n: int, key: int) -> np.ndarray:
    """The images of `positions` (in [0, n)) under the keyed permutation of [0, n)."""
    x = np.atleast_1d(np.asarray(positions, dtype=np.uint64))
    if n <= 1:
        return x.astype(np.int64)
    half = max(1, ((n - 1).bit_length() + 1) // 2)  # domain 2^(2*half) < 4n: < 4 walks on average
    keys = [np.uint64(derive_key(key, r) & 0xFFFFFFFFFFFFFFFF) for r in range(_ROUNDS)]
    with np.errstate(over="ignore"):
        out = _feistel(x, half, keys)
        outside = out >= np.uint64(n)
        while outside.any():  # cycle walking: apply again until the value is back in [0, n)
            out[outside] = _feistel(out[outside], half, keys)
            outside = out >= np.uint64(n)
    return out.astype(np.int64)


class Mixture:
    """Sample position → (source, training index) for one epoch (see the module doc)."""

    def __init__(self, sizes: Sequence[int], weights: Sequence[float], seed: int):
        if len(sizes) != len(weights):
            raise ValueError(f"{len(sizes)} sources but {len(weights)} weights")
        if any(w < 0 for w in weights) or not any(w > 0 and n > 0 for w, n in zip(weights, sizes)):
            raise ValueError(
                f"mixture weights {list(weights)} must be >= 0 with at least one > 0 on a non-empty source"
            )
        self.sizes = [int(n) for n in sizes]
        self.weights = [float(w) for w in weights]
        self.seed = seed
        self.copies = [int(w) for w in self.weights]
        self.extra = [int(round((w - int(w)) * n)) for w, n in zip(self.weights, self.sizes)]
        counts = [c * n + k for c, n, k in zip(self.copies, self.sizes, self.extra)]
        self.starts = np.cumsum([0] + counts)
        self.num_samples = int(self.starts[-1])

    def locate(self, positions: np.ndarray, epoch: int) -> tuple[np.ndarray, np.ndarray]:
        """(source index, index among that source's training documents) of each position."""
        positions = np.asarray(positions, dtype=np.int64)
        source = np.searchsorted(self.starts, positions, side="right") - 1
        local = np.empty_like(positions)
        for f in np.unique(source):
            sel = source == f
            offset = positions[sel] - self.starts[f]
            full = self.copies[f] * self.sizes[f]
            out = offset % max(self.sizes[f], 1)
            drawn = offset >= full
            if drawn.any():
                out[drawn] = permute(offset[drawn] - full, self.sizes[f], derive_key(self.seed, "draw", epoch, f))
            local[sel] = out
        return source, local


def holdout_count(n: int, fraction: float) -> int:
    """Evaluation documents held out of a file of n documents (data.eval_fraction)."""
    return min(int(round(fraction * n)), n) if fraction > 0 else 0


def split_index(n: int, fraction: float, seed: int, file_index: int, train_positions: np.ndarray) -> np.ndarray:
    """Document index within the file of each training position (after holding out evaluation docs)."""
    k = holdout_count(n, fraction)
    if k == 0:
        return np.asarray(train_positions, dtype=np.int64)
    return permute(np.asarray(train_positions, dtype=np.int64) + k, n, derive_key(seed, "holdout", file_index))


def holdout_docs(n: int, fraction: float, seed: int, file_index: int) -> np.ndarray:
    """Document indices within the file that are held out for evaluation (sorted)."""
    k = holdout_count(n, fraction)
    return np.sort(permute(np.arange(k), n, derive_key(seed, "holdout", file_index))) if k else np.zeros(0, np.int64)
