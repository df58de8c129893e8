"""The pre-tokenized cache: the same documents as in-memory tokenization, reused across runs and ranks,
rebuilt when the tokenizer, template, settings or data change, the same with worker processes,
one builder among concurrent ranks (lock, stale lock, failed build)."""

from __future__ import annotations

import json
import multiprocessing
import os
import shutil
import socket
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from transformers import AutoTokenizer

from moe_sft.data import cache as cache_mod
from moe_sft.data.cache import CacheSpec, cache_dir_for, open_or_build
from moe_sft.data.chat import ChatOptions, tokenize_files
from moe_sft.data.formats import DataFormatError
from moe_sft.data.store import CachedDocs

DEMO = Path(__file__).resolve().parents[2] / "recipes" / "demo"
TOKENIZER = str(DEMO / "tokenizer")


class Log(list):
    def __call__(self, message: str) -> None:
        self.append(message)

    def built(self) -> int:
        return sum("data cache: tokenizing" in m for m in self)


@pytest.fixture(scope="module")
def rows(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("rows") / "rows.jsonl"
    lines = (DEMO / "data" / "train.jsonl").read_text().splitlines()[:600]
    path.write_text("\n".join(lines) + "\n")
    return path


def spec(max_seq_len: int = 64, tokenizer: str = TOKENIZER, template: str | None = None) -> CacheSpec:
    return CacheSpec(tokenizer, ChatOptions(max_seq_len, "truncate", chat_template=template))


def test_cache_holds_the_in_memory_documents_and_is_reused(rows, tmp_path):
    log = Log()
    cache = open_or_build(rows, spec(), tmp_path, log=log)
    docs, stats = tokenize_files(AutoTokenizer.from_pretrained(TOKENIZER), [rows], max_seq_len=64)
    assert len(cache) == len(docs) == 600 and log.built() == 1
    for i in (0, 1, 299, 599):
        doc = cache.doc(i)
        assert doc.input_ids.tolist() == docs[i].input_ids and doc.loss_weights.tolist() == docs[i].loss_weights
        assert doc.source == docs[i].source == f"{rows}:{i + 1}"
    assert cache.lengths(np.arange(600)).tolist() == [len(d) for d in docs]
    assert np.allclose(cache.loss_sums(np.arange(600)), [d.loss_weight_sum for d in docs])
    assert (cache.stats.samples, cache.stats.tokens, cache.stats.loss_tokens, cache.stats.histogram) == (
        stats.samples,
        stats.tokens,
        stats.loss_tokens,
        stats.histogram,
    )
    # Another run (or rank) opens it without tokenizing again.
    again = open_or_build(rows, spec(), tmp_path, log=log)
    assert again.dir == cache.dir and log.built() == 1


def test_key_changes_with_tokenizer_template_settings_and_data(rows, tmp_path):
    base = cache_dir_for(rows, spec(), tmp_path)
    tok2 = tmp_path / "tok2"
    shutil.copytree(TOKENIZER, tok2)
    config = json.loads((tok2 / "tokenizer_config.json").read_text())
    (tok2 / "tokenizer_config.json").write_text(json.dumps(dict(config, model_max_length=2048)))
    changed = {
        "max_seq_len": cache_dir_for(rows, spec(max_seq_len=128), tmp_path),
        "template": cache_dir_for(rows, spec(template="{{ messages }}"), tmp_path),
        "tokenizer files": cache_dir_for(rows, spec(tokenizer=str(tok2)), tmp_path),
        "loss_on": cache_dir_for(rows, CacheSpec(TOKENIZER, ChatOptions(64, loss_on="last_assistant")), tmp_path),
        "close_last_turn": cache_dir_for(rows, CacheSpec(TOKENIZER, ChatOptions(64, close_last_turn=False)), tmp_path),
        "empty_think": cache_dir_for(rows, CacheSpec(TOKENIZER, ChatOptions(64, empty_think="mask")), tmp_path),
    }
    assert len({base, *changed.values()}) == 7, changed
    data = tmp_path / "data.jsonl"
    shutil.copy(rows, data)
    before = cache_dir_for(data, spec(), tmp_path)
    assert cache_dir_for(data, spec(), tmp_path) == before  # deterministic
    with data.open("a") as f:
        f.write(rows.read_text().splitlines()[0] + "\n")
    assert cache_dir_for(data, spec(), tmp_path) != before
    # A touched file gets a new cache, but its documents (the resume fingerprint) are the same.
    a = open_or_build(data, spec(), tmp_path / "c", log=Log())
    os.utime(data, ns=(time.time_ns(), time.time_ns() + 10**9))
    b = open_or_build(data, spec(), tmp_path / "c", log=Log())
    assert a.dir != b.dir and CachedDocs([a]).fingerprint == CachedDocs([b]).fingerprint


def test_worker_processes_build_the_same_cache(rows, tmp_path, monkeypatch):
    monkeypatch.setattr(cache_mod, "SMALL_FILE_BYTES", 0)  # use the pool even for this small file
    monkeypatch.setattr(cache_mod, "CHUNK_ROWS", 64)  # ten chunks, in flight on two workers
    log = Log()
    pooled = open_or_build(rows, spec(), tmp_path / "pooled", num_workers=2, log=log)
    assert "(2 worker processes)" in log[0]
    serial = open_or_build(rows, spec(), tmp_path / "serial", num_workers=0, log=Log())
    for name in ("tokens", "weights", "offsets", "lines", "loss"):
        assert np.array_equal(getattr(pooled, name), getattr(serial, name)), name
    assert pooled.stats == serial.stats


@pytest.mark.parametrize("workers", [0, 2])
def test_builder_streams_rows_in_bounded_chunks(rows, tmp_path, monkeypatch, workers):
    """Datasets larger than RAM: when the first chunk reaches the writer, the reader has read at most the
    chunks in flight (one in-process; two per worker), not the file (docs/data.md measures the memory:
    flat from 10k to 1M rows)."""
    monkeypatch.setattr(cache_mod, "CHUNK_ROWS", 32)
    big = tmp_path / "big.jsonl"
    big.write_bytes(rows.read_bytes() * 4)  # 2,400 rows = 75 chunks
    read, real = [], cache_mod.iter_records

    def counting(path):
        for record in real(path):
            read.append(record[0])
            yield record

    monkeypatch.setattr(cache_mod, "iter_records", counting)
    chunks = cache_mod._tokenized_chunks(big, spec(), workers)
    first = next(chunks)
    assert len(first["lengths"]) == 32 and first["lines"].tolist() == list(range(1, 33))
    assert len(read) == 32 * max(1, 2 * workers)
    chunks.close()


def test_one_builder_among_concurrent_ranks(rows, tmp_path):
    logs, results = [Log() for _ in range(3)], [None] * 3

    def rank(i):
        results[i] = open_or_build(rows, spec(), tmp_path, log=logs[i])

    threads = [threading.Thread(target=rank, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sum(log.built() for log in logs) == 1
    assert len({r.dir for r in results}) == 1 and all(len(r) == 600 for r in results)
    assert sorted(p.name for p in tmp_path.iterdir()) == [results[0].dir.name]  # no lock or temp dir left


def _dead_pid() -> int:
    proc = multiprocessing.get_context("spawn").Process(target=int)
    proc.start()
    proc.join()
    return proc.pid


def test_stale_lock_of_a_dead_builder_is_taken_over(rows, tmp_path):
    final = cache_dir_for(rows, spec(), tmp_path)
    tmp_path.mkdir(exist_ok=True)
    final.with_name(final.name + ".lock").write_text(
        json.dumps({"host": socket.gethostname(), "pid": _dead_pid(), "nonce": "old"})
    )
    log = Log()
    cache = open_or_build(rows, spec(), tmp_path, log=log)
    assert "removing the stale lock" in log[0] and "process gone" in log[0] and log.built() == 1 and len(cache) == 600


def test_waiting_ranks_raise_the_builders_error_and_ignore_old_failures(rows, tmp_path):
    final = cache_dir_for(rows, spec(), tmp_path)
    lock, failed = final.with_name(final.name + ".lock"), final.with_name(final.name + ".failed")
    lock.write_text(json.dumps({"host": socket.gethostname(), "pid": os.getpid(), "nonce": "n1"}))
    failed.write_text(json.dumps({"nonce": "n1", "message": "rows.jsonl:7: invalid JSON"}))
    with pytest.raises(DataFormatError, match=r"^rows\.jsonl:7: invalid JSON$"):
        open_or_build(rows, spec(), tmp_path, log=Log())
    # A marker from an earlier build (another nonce) does not fail the current one: the waiter waits
    # for the lock to go, then builds itself.
    failed.write_text(json.dumps({"nonce": "n0", "message": "old failure"}))
    threading.Timer(1.0, lock.unlink).start()
    log = Log()
    cache = open_or_build(rows, spec(), tmp_path, log=log)
    assert len(cache) == 600 and log.built() == 1 and not failed.exists()
