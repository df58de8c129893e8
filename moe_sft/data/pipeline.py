"""The recipe's data section → the training loader, the evaluation batches and the start-of-run summary.

Used by the trainer (`Trainer._data`) and by anything that must see exactly the trainer's batches
(tests/hf_reference_loop.py, tools/bench_data.py).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from moe_sft.data.cache import CacheSpec, open_or_build
from moe_sft.data.chat import ChatOptions, read_chat_template
from moe_sft.data.formats import RowFormat
from moe_sft.data.loader import EvalBatches, PackedLoader
from moe_sft.data.sampling import holdout_docs
from moe_sft.data.stats import DataStats, format_summary
from moe_sft.data.store import CachedDocs
from moe_sft.runtime.logs import ALL_RANKS, get_logger

log = get_logger(__name__)


def default_cache_dir() -> Path:
    return Path(os.environ.get("MOE_SFT_DATA_CACHE") or Path.home() / ".cache" / "moe_sft" / "data")


@dataclass
class DataPipeline:
    train: PackedLoader
    eval: EvalBatches | None
    summary: list[str]


def cache_spec(data, tokenizer_path: str) -> CacheSpec:
    options = ChatOptions(
        data.max_seq_len,
        data.overlong,
        data.loss_on,
        data.end_of_turn,
        read_chat_template(data.chat_template),
        data.close_last_turn,
        data.empty_think,
    )
    return CacheSpec(str(tokenizer_path), options, RowFormat.make(data.format, dict(data.fields)))


def build_pipeline(
    data,
    *,
    tokenizer_path: str,
    global_batch_size: int,
    pad_to: int = 1,
    doc_multiple: int = 1,
    pad_token_id: int = 0,
    log=None,
    vocab_size: int | None = None,
) -> DataPipeline:
    """Open (or build) the caches of every file of `data` (a DataConfig) and make the loaders.

    `vocab_size`: the model's; a cache holding an id at or above it is refused (see FileCache)."""
    log = log or _rank_log
    spec = cache_spec(data, tokenizer_path)
    digest, root = spec.digest(), Path(data.cache_dir) if data.cache_dir else default_cache_dir()

    def caches(paths):
        return [
            open_or_build(
                p,
                spec,
                root,
                num_workers=data.num_workers,
                on_error=data.on_error,
                log=log,
                spec_digest=digest,
                vocab_size=vocab_size,
            )
            for p in paths
        ]

    train_caches, eval_caches = caches(data.train_files), caches(data.eval_files)
    store = CachedDocs(train_caches)
    loader = PackedLoader(
        store,
        data.pack_length,
        global_batch_size,
        seed=data.seed,
        shuffle=data.shuffle,
        window=data.pack_window,
        weights=list(data.train_weights) or None,
        eval_fraction=data.eval_fraction,
        pad_to=pad_to,
        doc_multiple=doc_multiple,
        pad_token_id=pad_token_id,
        prefetch=data.prefetch,
    )
    refs = [
        (f, int(d)) for f, c in enumerate(train_caches) for d in holdout_docs(len(c), data.eval_fraction, data.seed, f)
    ]
    refs += [(len(train_caches) + f, d) for f, c in enumerate(eval_caches) for d in range(len(c))]
    evals = (
        EvalBatches(
            CachedDocs(train_caches + eval_caches),
            refs,
            data.pack_length,
            window=data.pack_window,
            pad_to=pad_to,
            doc_multiple=doc_multiple,
            pad_token_id=pad_token_id,
        )
        if refs
        else None
    )
    return DataPipeline(loader, evals, _summary(train_caches, eval_caches, loader, evals))


def _summary(train_caches, eval_caches, loader: PackedLoader, evals: EvalBatches | None) -> list[str]:
    def merged(caches):
        stats = DataStats.empty(caches[0].stats.max_seq_len)
        for c in caches:
            stats = stats.merge(c.stats)
        return stats

    lines = format_summary("train data", merged(train_caches), len(train_caches), _reports(train_caches))
    total = sum(w * n for w, n in zip(loader.weights, loader.train_sizes)) or 1
    shares = ", ".join(
        f"{Path(name).name} x{w:g} = {100 * w * n / total:.1f}%"
        for name, w, n in zip(loader.store.names, loader.weights, loader.train_sizes)
    )
    held = sum(loader.store.sizes) - sum(loader.train_sizes)
    lines.append(f"  epoch: {loader.num_samples:,} samples ({shares}){f', {held:,} held out for eval' if held else ''}")
    info = loader.step_info(0)
    lines.append(
        f"  packing: best-fit decreasing over windows of {loader.window:,} samples into "
        f"{loader.pack_length} tokens; step 0 efficiency {100 * info['data/packing_efficiency']:.1f}%; "
        f"~{loader.estimate_steps_per_epoch():,.1f} steps per epoch of {loader.global_batch_size} "
        "micro-batches"
    )
    if evals is not None:
        if eval_caches:
            lines += format_summary("eval data", merged(eval_caches), len(eval_caches), _reports(eval_caches))
        lines.append(
            f"  eval set: {evals.num_samples:,} samples, {evals.num_tokens:,} tokens in "
            f"{len(evals.packs):,} micro-batches"
        )
    return lines


def _reports(caches) -> list[str]:
    """The report files that list rows: skipped, truncated or dropped."""
    return [str(c.dir / "report.jsonl") for c in caches if c.stats.n_errors or c.stats.truncated or c.stats.dropped]


def _rank_log(message: str) -> None:
    """Cache events: logged by the first process of each node (the others only wait)."""
    if os.environ.get("LOCAL_RANK", "0") == "0":
        log.info(message, extra=ALL_RANKS)
