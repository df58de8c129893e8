"""Data statistics and the start-of-run summary: counts, skipped rows by category, length histogram."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from moe_sft.data.formats import ROW_ERRORS

MAX_EXAMPLES = 5  # locations kept per error category for the console; the report file has all


def length_bin_edges(max_seq_len: int) -> list[int]:
    """Upper edges of the histogram bins: 32, 64, ... (powers of two), ending at max_seq_len."""
    edges, edge = [], 32
    while edge < max_seq_len:
        edges.append(edge)
        edge *= 2
    return edges + [max_seq_len]


@dataclass
class DataStats:
    max_seq_len: int
    rows: int = 0  # rows read
    samples: int = 0  # documents kept
    tokens: int = 0  # tokens of kept documents
    loss_tokens: int = 0  # positions with a loss weight > 0 (labels shifted)
    loss_weight: float = 0.0  # Σ loss weights (the normaliser's share)
    truncated: int = 0  # kept, cut to max_seq_len (data.overlong=truncate)
    dropped: int = 0  # overlong with data.overlong=drop, or nothing left to learn after truncation
    errors: dict[str, int] = field(default_factory=dict)  # skipped rows per category (data.on_error=skip)
    examples: dict[str, list[str]] = field(default_factory=dict)  # first messages per category
    histogram: list[int] = field(default_factory=list)  # kept documents per length bin

    @classmethod
    def empty(cls, max_seq_len: int) -> DataStats:
        return cls(max_seq_len, histogram=[0] * len(length_bin_edges(max_seq_len)))

    @classmethod
    def from_dict(cls, d: dict) -> DataStats:
        return cls(**d)

    def as_dict(self) -> dict:
        return asdict(self)

    @property
    def n_errors(self) -> int:
        return sum(self.errors.values())

    def add_row(self, doc) -> None:
        """A row that tokenized: kept (`doc`) or dropped (None)."""
        self.rows += 1
        if doc is None:
            self.dropped += 1
            return
        self.add_lengths(np.array([len(doc)]))
        self.samples += 1
        self.tokens += len(doc)
        self.loss_tokens += doc.num_loss_tokens
        self.loss_weight += doc.loss_weight_sum
        self.truncated += doc.truncated

    def add_lengths(self, lengths: np.ndarray) -> None:
        bins = np.searchsorted(np.array(length_bin_edges(self.max_seq_len)), lengths, side="left")
        for b, n in zip(*np.unique(bins, return_counts=True)):
            self.histogram[int(b)] += int(n)

    def add_error(self, category: str, message: str) -> None:
        self.rows += 1
        self.errors[category] = self.errors.get(category, 0) + 1
        shown = self.examples.setdefault(category, [])
        if len(shown) < MAX_EXAMPLES:
            shown.append(message)

    def merge(self, other: DataStats) -> DataStats:
        if other.max_seq_len != self.max_seq_len:
            raise ValueError("cannot merge statistics of different max_seq_len")
        out = DataStats.from_dict(self.as_dict())
        for name in ("rows", "samples", "tokens", "loss_tokens", "loss_weight", "truncated", "dropped"):
            setattr(out, name, getattr(self, name) + getattr(other, name))
        for category, n in other.errors.items():
            out.errors[category] = out.errors.get(category, 0) + n
            out.examples[category] = (out.examples.get(category, []) + other.examples.get(category, []))[:MAX_EXAMPLES]
        out.histogram = [a + b for a, b in zip(self.histogram, other.histogram)]
        return out


def format_summary(name: str, stats: DataStats, n_files: int, report_paths: list[str] = ()) -> list[str]:
    """The lines printed at the start of a run for one split (train / eval)."""
    lines = [
        f"{name}: {n_files} file(s), {stats.rows:,} rows -> {stats.samples:,} samples, {stats.tokens:,} tokens, "
        f"{stats.loss_tokens:,} trainable (loss weight {stats.loss_weight:,.1f}); truncated {stats.truncated:,}, "
        f"dropped {stats.dropped:,}, skipped {stats.n_errors:,}"
    ]
    if stats.n_errors:
        counts = ", ".join(f"{c} {stats.errors[c]:,}" for c in ROW_ERRORS if stats.errors.get(c))
        lines.append(f"  skipped rows by category: {counts}")
        for category in ROW_ERRORS:
            for message in stats.examples.get(category, []):
                lines.append(f"    {category}: {message}")
    if report_paths and (stats.n_errors or stats.truncated or stats.dropped):
        lines.append(f"  every skipped/truncated/dropped row with file:line: {', '.join(report_paths)}")
    lines.append("  length histogram (tokens: samples):")
    edges, top = length_bin_edges(stats.max_seq_len), max(stats.histogram or [0]) or 1
    low = 1
    for edge, count in zip(edges, stats.histogram):
        bar = "#" * max(1 if count else 0, round(40 * count / top))
        lines.append(f"    {low:>6}-{edge:<6} {count:>10,} {bar}")
        low = edge + 1
    return lines


def not_kept_rows(report_paths, limit: int = 10) -> list[str]:
    """The first `limit` skipped or dropped rows ("file:row: reason") of the caches' report.jsonl
    files, in file order (truncated rows were kept and are left out)."""
    out: list[str] = []
    for path in report_paths:
        if not Path(path).is_file():
            continue
        with Path(path).open(encoding="utf-8") as f:
            for line in f:
                event = json.loads(line)
                if event["kind"] == "truncated":
                    continue
                message = event["message"]
                out.append(message if message.startswith(event["where"]) else f"{event['where']}: {message}")
                if len(out) == limit:
                    return out
    return out


def no_documents_message(caches, limit: int = 10) -> str:
    """Why training has nothing to train on: the rows read, skipped (by category) and dropped, and
    the first `limit` of them with file:row and reason. `caches`: data.cache.FileCache objects."""
    caches = list(caches)
    if not caches:
        return "no documents to train on; check the data paths and the overlong/max_seq_len settings"
    stats = DataStats.empty(caches[0].stats.max_seq_len)
    for cache in caches:
        stats = stats.merge(cache.stats)
    lost = []
    if stats.n_errors:
        counts = ", ".join(f"{c} {stats.errors[c]:,}" for c in ROW_ERRORS if stats.errors.get(c))
        lost.append(f"{stats.n_errors:,} skipped as bad rows ({counts}; data.on_error=skip)")
    if stats.dropped:
        lost.append(
            f"{stats.dropped:,} dropped (longer than data.max_seq_len={stats.max_seq_len}: data.overlong=drop, "
            "or nothing to learn left after truncation)"
        )
    message = f"no documents to train on: {stats.rows:,} rows read from {len(caches)} file(s), none kept" + (
        f"; {' and '.join(lost)}" if lost else ""
    )
    reports = [str(c.dir / "report.jsonl") for c in caches if (c.dir / "report.jsonl").is_file()]
    rows = not_kept_rows(reports, limit)
    if rows:
        more = stats.n_errors + stats.dropped - len(rows)
        message += (
            f". The first {len(rows)}: "
            + "; ".join(rows)
            + (f"; and {more:,} more" if more > 0 else "")
            + f" (every row: {', '.join(reports)})"
        )
    return message + ". Fix the rows, or the data paths and the data.max_seq_len/data.overlong settings"
