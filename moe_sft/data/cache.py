"""The pre-tokenized on-disk cache: one directory per data file, built once, read by memory map.

    <cache_dir>/<file stem>-<key>/      tokens.u32  weights.f32  offsets.i64  lines.i64  loss.f64
                                        meta.json (statistics, settings)  report.jsonl (skipped/cut rows)

`key` hashes everything that decides the tokens: the tokenizer's files, the chat template, the
settings (max_seq_len, overlong, loss_on, end_of_turn, close_last_turn, empty_think, format, fields: every
ChatOptions field) and the data file (path, size, mtime and a content hash of 16 evenly spaced
1 MiB blocks, so a multi-GB file is not read in full at every start). Change any of them and a new cache is built; otherwise every run and
every rank reuses it. Datasets larger than RAM: rows are streamed through the builder, written
as they come, and read back by memory map, so memory does not grow with the dataset.

Building: the first process to create `<dir>.lock` (O_EXCL) builds; the others wait for the
finished directory, which appears atomically (built as `<dir>.tmp-<nonce>`, then renamed). A
failed build (a bad row with data.on_error=fail) leaves `<dir>.failed` with the message, and the
waiting ranks raise the same error. A lock whose builder died (same host, pid gone) or stopped
heart-beating for `stale_after` seconds is taken over. With a cache_dir on a shared filesystem
one process of the job builds; with a node-local one, one per node. Rows are tokenized in
`num_workers` forked processes, in chunks whose results are written in file order, so the cache
does not depend on the number of workers.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import socket
import sys
import time
import uuid
from collections import deque
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np

from moe_sft.data.chat import ChatOptions, RowTokenizer, TokenizedDoc
from moe_sft.data.formats import DataFormatError, RowError, RowFormat, iter_records
from moe_sft.data.stats import DataStats

CACHE_VERSION = 2  # 2: meta.json records the id range; masks of harmony and Nemotron-3-style templates fixed
CHUNK_ROWS = 256  # rows per worker task
SMALL_FILE_BYTES = 4 << 20  # below this, tokenizing in-process beats starting worker processes
_SAMPLE_BLOCKS, _BLOCK = 16, 1 << 20
_WEIGHT_FILES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".msgpack", ".h5")
_ARRAYS = {"tokens": np.uint32, "weights": np.float32, "offsets": np.int64, "lines": np.int64, "loss": np.float64}
_SUFFIX = {np.uint32: "u32", np.float32: "f32", np.int64: "i64", np.float64: "f64"}


@dataclasses.dataclass(frozen=True)
class CacheSpec:
    """What decides a file's tokens: the tokenizer (a directory), chat options and the row format."""

    tokenizer_path: str
    options: ChatOptions
    fmt: RowFormat = RowFormat()

    def digest(self) -> str:
        h = hashlib.sha256(f"moe_sft.data.cache v{CACHE_VERSION}".encode())
        h.update(_tokenizer_digest(Path(self.tokenizer_path)).encode())
        h.update(json.dumps([dataclasses.asdict(self.options), dataclasses.asdict(self.fmt)], sort_keys=True).encode())
        return h.hexdigest()


def _tokenizer_digest(path: Path) -> str:
    h = hashlib.sha256()
    files = (
        sorted(p for p in path.iterdir() if p.is_file() and not p.name.endswith(_WEIGHT_FILES)) if path.is_dir() else []
    )
    if not files:
        raise DataFormatError(f"tokenizer directory {path} has no files; set data.tokenizer_path to a tokenizer dir")
    for p in files:
        h.update(p.name.encode() + b"\0" + p.read_bytes())
    return h.hexdigest()


def file_fingerprint(path: Path) -> str:
    """Path, size, mtime and sampled content of a data file (or of an HF dataset directory's files)."""
    h = hashlib.sha256(str(path.resolve()).encode())
    files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
    for p in files:
        st = p.stat()
        h.update(f"{p.name}:{st.st_size}:{st.st_mtime_ns}".encode())
        with p.open("rb") as f:
            step = max(st.st_size // _SAMPLE_BLOCKS, _BLOCK)
            for offset in range(0, st.st_size, step):
                f.seek(offset)
                h.update(f.read(_BLOCK))
    return h.hexdigest()


def cache_dir_for(path: str | Path, spec: CacheSpec, root: str | Path, spec_digest: str | None = None) -> Path:
    path = Path(path)
    key = hashlib.sha256(((spec_digest or spec.digest()) + file_fingerprint(path)).encode()).hexdigest()[:20]
    return Path(root) / f"{path.stem[:40]}-{key}"


class FileCache:
    """One file's documents, memory-mapped (see the module doc). Document i of the file is the
    i-th kept row; `lines[i]` is its line (row) in the source file.

    Opening checks what a damaged cache would otherwise turn into an unlocated error or silently
    wrong training: meta.json readable, every array as long as the statistics say (a truncated or
    partly copied cache), and every token id below the vocabulary size, the tokenizer's that built
    it and `vocab_size` (the model's) when given: the ids' maximum recorded at build time, and each
    document's ids as it is read (a corrupted tokens file). Each error names the cache and the fix."""

    def __init__(self, directory: str | Path, vocab_size: int | None = None):
        self.dir = Path(directory)
        meta = self._meta()
        self.meta, self.source = meta, meta["source"]
        self.stats = DataStats.from_dict(meta["stats"])
        n, t = self.stats.samples, self.stats.tokens
        for name, count in (("tokens", t), ("weights", t), ("offsets", n + 1), ("lines", n), ("loss", n)):
            setattr(self, name, self._array(name, count))
        self.n = len(self.lines)
        if self.offsets[0] != 0 or self.offsets[-1] != t:
            self._damaged("offsets.i64 does not split the tokens into the documents meta.json counts")
        self.tokenizer_vocab = int(meta["vocab_size"])
        self.model_vocab = vocab_size
        self.vocab = min(self.tokenizer_vocab, vocab_size or self.tokenizer_vocab)
        if meta["max_id"] >= self.vocab:
            raise DataFormatError(self._id_error(meta["max_id"], "a document"))

    def _meta(self) -> dict:
        try:
            meta = json.loads((self.dir / "meta.json").read_text())
        except (OSError, ValueError) as e:
            self._damaged(f"meta.json cannot be read ({e})")
        if meta.get("version") != CACHE_VERSION:
            raise DataFormatError(
                f"data cache {self.dir}: version {meta.get('version')} is not {CACHE_VERSION}; delete it "
                "(it is rebuilt at the next start)"
            )
        return meta

    def _array(self, name: str, count: int) -> np.ndarray:
        dtype = _ARRAYS[name]
        path = self.dir / f"{name}.{_SUFFIX[dtype]}"
        size = path.stat().st_size if path.is_file() else -1
        if size != count * np.dtype(dtype).itemsize:
            found = "is missing" if size < 0 else f"holds {size:,} bytes"
            self._damaged(f"{path.name} {found}, {count:,} entries of {np.dtype(dtype).itemsize} bytes expected")
        return _memmap(path, dtype)

    def _damaged(self, what: str):
        raise DataFormatError(
            f"data cache {self.dir} is damaged: {what} (truncated or partly copied?); delete that directory "
            "and it is rebuilt from the data file at the next start"
        )

    def _id_error(self, token_id: int, where: str) -> str:
        if token_id >= self.tokenizer_vocab:  # no tokenizer of this cache writes it: the file is corrupt
            return (
                f"data cache {self.dir}: tokens.u32 holds token id {token_id} in {where}, outside the vocabulary "
                f"of the tokenizer that built it ({self.tokenizer_vocab} ids): the cache is corrupt; delete that "
                "directory and it is rebuilt from the data file at the next start"
            )
        return (
            f"data cache {self.dir}: token id {token_id} in {where} is outside the model's vocabulary "
            f"({self.model_vocab} ids, config.json vocab_size): the tokenizer "
            f"({self.meta['settings']['tokenizer_path']}, {self.tokenizer_vocab} ids) is not the model's; set "
            "data.tokenizer_path to the model's tokenizer"
        )

    def __len__(self) -> int:
        return self.n

    def lengths(self, idx: np.ndarray) -> np.ndarray:
        idx = np.asarray(idx, dtype=np.int64)
        return self.offsets[idx + 1] - self.offsets[idx]

    def loss_sums(self, idx: np.ndarray) -> np.ndarray:
        return self.loss[np.asarray(idx, dtype=np.int64)]

    def doc(self, i: int) -> TokenizedDoc:
        a, b = int(self.offsets[i]), int(self.offsets[i + 1])
        ids = np.array(self.tokens[a:b])
        where = f"{self.source}:{self.lines[i]}"
        if len(ids) and int(ids.max()) >= self.vocab:
            raise DataFormatError(self._id_error(int(ids.max()), f"the document of {where}"))
        return TokenizedDoc(ids, np.array(self.weights[a:b]), where, truncated=False)


def _memmap(path: Path, dtype) -> np.ndarray:
    if path.stat().st_size == 0:
        return np.zeros(0, dtype=dtype)
    return np.memmap(path, dtype=dtype, mode="r")


# ----------------------------------------------------------------------------- open or build


def open_or_build(
    path: str | Path,
    spec: CacheSpec,
    root: str | Path,
    *,
    num_workers: int = 2,
    on_error: str = "fail",
    log: Callable[[str], None] = print,
    stale_after: float = 600.0,
    spec_digest: str | None = None,
    vocab_size: int | None = None,
) -> FileCache:
    """The cache of `path`, built here if no other process is building it (see the module doc)."""
    final = cache_dir_for(path, spec, root, spec_digest)
    final.parent.mkdir(parents=True, exist_ok=True)
    lock, failed = final.with_name(final.name + ".lock"), final.with_name(final.name + ".failed")
    while not (final / "meta.json").is_file():
        nonce = _try_lock(lock)
        if nonce is None:
            _wait(final, lock, failed, log, stale_after)
            continue
        try:
            failed.unlink(missing_ok=True)
            if not (final / "meta.json").is_file():
                _build(Path(path), spec, final, nonce, lock, num_workers, on_error, log)
        except DataFormatError as e:
            failed.write_text(json.dumps({"nonce": nonce, "message": str(e)}))
            raise
        finally:
            lock.unlink(missing_ok=True)
    cache = FileCache(final, vocab_size)
    if on_error == "fail" and cache.stats.n_errors:
        first = next(m for c in cache.stats.examples for m in cache.stats.examples[c])
        raise DataFormatError(
            f"{first} ({cache.stats.n_errors} bad rows in {path}, listed in "
            f"{final / 'report.jsonl'}; fix them or set data.on_error=skip)"
        )
    return cache


def _try_lock(lock: Path) -> str | None:
    nonce = uuid.uuid4().hex
    try:
        fd = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    except FileExistsError:
        return None
    with os.fdopen(fd, "w") as f:
        json.dump({"host": socket.gethostname(), "pid": os.getpid(), "nonce": nonce}, f)
    return nonce


def _wait(final: Path, lock: Path, failed: Path, log, stale_after: float) -> None:
    """Until the cache exists, its build failed (raise), or the lock is gone or stale (return)."""
    try:
        owner = json.loads(lock.read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        time.sleep(0.2)  # the lock vanished or is being written: look again
        return
    start = last_log = time.monotonic()
    while not (final / "meta.json").is_file():
        if failed.is_file():
            marker = json.loads(failed.read_text())
            if marker.get("nonce") == owner["nonce"]:
                raise DataFormatError(marker["message"])
        try:
            age = time.time() - lock.stat().st_mtime
        except FileNotFoundError:
            return
        dead = owner["host"] == socket.gethostname() and not _alive(owner["pid"])
        if dead or age > stale_after:
            log(
                f"data cache: removing the stale lock {lock} of {owner['host']}:{owner['pid']} "
                f"({'process gone' if dead else f'no heartbeat for {age:.0f}s'})"
            )
            lock.unlink(missing_ok=True)
            return
        if time.monotonic() - last_log > 30:
            log(
                f"data cache: waiting for {owner['host']}:{owner['pid']} to build {final} "
                f"({time.monotonic() - start:.0f}s)"
            )
            last_log = time.monotonic()
        time.sleep(0.5)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _build(
    path: Path, spec: CacheSpec, final: Path, nonce: str, lock: Path, num_workers: int, on_error: str, log
) -> None:
    tmp = final.with_name(f"{final.name}.tmp-{nonce}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    started = time.monotonic()
    workers = num_workers if _data_bytes(path) > SMALL_FILE_BYTES else 0
    _init_worker(spec)  # here first: a tokenizer that cannot render rows fails once, in this process
    log(f"data cache: tokenizing {path} -> {final} ({workers or 'no'} worker processes)")
    try:
        with _Writer(tmp, spec.options.max_seq_len) as writer:
            for chunk in _tokenized_chunks(path, spec, workers):
                writer.add(chunk, str(path), fail_fast=on_error == "fail")
                os.utime(lock)  # heartbeat for waiting ranks
            stats = writer.stats
        meta = {
            "version": CACHE_VERSION,
            "source": str(path),
            "stats": stats.as_dict(),
            "vocab_size": len(_ROWS.tokenizer),  # ids are below it; FileCache checks
            "max_id": writer.max_id,
            "settings": {
                "tokenizer_path": spec.tokenizer_path,
                **dataclasses.asdict(spec.options),
                "chat_template": "<custom>" if spec.options.chat_template else None,
                **dataclasses.asdict(spec.fmt),
            },
        }
        (tmp / "meta.json").write_text(json.dumps(meta, indent=1))
        os.rename(tmp, final)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    seconds = time.monotonic() - started
    log(
        f"data cache: {path}: {stats.rows:,} rows, {stats.tokens:,} tokens in {seconds:.1f}s "
        f"({stats.rows / max(seconds, 1e-9):,.0f} rows/s, {stats.tokens / max(seconds, 1e-9):,.0f} tokens/s)"
    )


def _data_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) if path.is_dir() else path.stat().st_size


class _Writer:
    """Appends chunk results to the cache files in order and keeps the statistics."""

    def __init__(self, directory: Path, max_seq_len: int):
        self.dir, self.stats, self.n_tokens, self.max_id = directory, DataStats.empty(max_seq_len), 0, -1

    def __enter__(self) -> _Writer:
        self.files = {name: (self.dir / f"{name}.{_SUFFIX[dtype]}").open("wb") for name, dtype in _ARRAYS.items()}
        self.files["offsets"].write(np.zeros(1, dtype=np.int64).tobytes())
        self.report = (self.dir / "report.jsonl").open("w", encoding="utf-8")
        return self

    def __exit__(self, *exc) -> None:
        for f in (*self.files.values(), self.report):
            f.close()

    def add(self, chunk: dict, path: str, fail_fast: bool) -> None:
        for line, kind, message in chunk["events"]:
            if kind not in ("truncated", "dropped"):
                if fail_fast:
                    raise RowError(
                        kind, f"{message} (data.on_error=fail; set data.on_error=skip to skip and report bad rows)"
                    )
                self.stats.add_error(kind, message)
            self.report.write(
                json.dumps({"where": f"{path}:{line}", "kind": kind, "message": message}, ensure_ascii=False) + "\n"
            )
        lengths = chunk["lengths"]
        if len(chunk["ids"]):
            self.max_id = max(self.max_id, int(chunk["ids"].max()))
        ends = self.n_tokens + np.cumsum(lengths, dtype=np.int64)
        self.n_tokens = int(ends[-1]) if len(ends) else self.n_tokens
        for name, values in (
            ("tokens", chunk["ids"]),
            ("weights", chunk["weights"]),
            ("offsets", ends),
            ("lines", chunk["lines"]),
            ("loss", chunk["loss"]),
        ):
            self.files[name].write(np.ascontiguousarray(values, dtype=_ARRAYS[name]).tobytes())
        s = self.stats
        s.rows += len(lengths) + chunk["dropped"]
        s.samples += len(lengths)
        s.tokens += int(lengths.sum())
        s.loss_tokens += chunk["loss_tokens"]
        s.loss_weight += float(chunk["loss"].sum())
        s.truncated += chunk["truncated"]
        s.dropped += chunk["dropped"]
        s.add_lengths(lengths)


# ----------------------------------------------------------------------------- tokenizing chunks


def _chunks(path: Path) -> Iterator[tuple[str, list]]:
    chunk: list = []
    for record in iter_records(path):
        chunk.append(record)
        if len(chunk) == CHUNK_ROWS:
            yield str(path), chunk
            chunk = []
    if chunk:
        yield str(path), chunk


def _tokenized_chunks(path: Path, spec: CacheSpec, workers: int) -> Iterator[dict]:
    """Chunk results in file order; at most 2 chunks per worker in flight (bounded memory)."""
    if workers <= 0:
        _init_worker(spec)
        for chunk in _chunks(path):
            yield _run_chunk(chunk)
        return
    import multiprocessing

    # fork: the workers start at once with transformers already imported (a fresh interpreter needs
    # 5-20 s to import it). They only run Python and the tokenizers library, never torch, CUDA or
    # the process group, so forking the training process is safe (as torch's DataLoader does).
    ctx = multiprocessing.get_context("fork" if sys.platform.startswith("linux") else "spawn")
    with ctx.Pool(workers, initializer=_init_worker, initargs=(spec,)) as pool:
        pending: deque = deque()
        for chunk in _chunks(path):
            pending.append(pool.apply_async(_run_chunk, (chunk,)))
            if len(pending) >= 2 * workers:
                yield pending.popleft().get()
        while pending:
            yield pending.popleft().get()


_ROWS: RowTokenizer | None = None
_ROWS_SPEC: CacheSpec | None = None


def _init_worker(spec: CacheSpec) -> None:
    """The row tokenizer of `spec` in this process (loaded once per spec)."""
    global _ROWS, _ROWS_SPEC
    if _ROWS is not None and _ROWS_SPEC == spec:
        return
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one thread per worker: the workers are the parallelism
    from transformers import AutoTokenizer

    _ROWS, _ROWS_SPEC = None, None
    _ROWS = RowTokenizer(AutoTokenizer.from_pretrained(spec.tokenizer_path), spec.options, spec.fmt)
    _ROWS_SPEC = spec


def _run_chunk(chunk: tuple[str, list]) -> dict:
    path, records = chunk
    results = _ROWS.many([(f"{path}:{line}", payload) for line, payload in records])
    kept, events, dropped, truncated = [], [], 0, 0
    for (line, _), result in zip(records, results):
        where = f"{path}:{line}"
        if isinstance(result, RowError):
            events.append((line, result.category, str(result)))
        elif result is None:
            dropped += 1
            events.append((line, "dropped", _dropped_reason(where, _ROWS.options)))
        else:
            truncated += result.truncated
            if result.truncated:
                events.append((line, "truncated", f"{where}: truncated to max_seq_len={_ROWS.options.max_seq_len}"))
            kept.append((line, result))
    docs = [d for _, d in kept]
    return {
        "ids": _concat([d.input_ids for d in docs], np.uint32),
        "weights": _concat([d.loss_weights for d in docs], np.float32),
        "lengths": np.array([len(d) for d in docs], dtype=np.int64),
        "lines": np.array([line for line, _ in kept], dtype=np.int64),
        "loss": np.array([d.loss_weight_sum for d in docs], dtype=np.float64),
        "loss_tokens": sum(d.num_loss_tokens for d in docs),
        "events": events,
        "dropped": dropped,
        "truncated": truncated,
    }


def _dropped_reason(where: str, options: ChatOptions) -> str:
    """Why chat.finish dropped a row: overlong=drop drops every row over max_seq_len; truncate drops
    one whose first max_seq_len tokens hold no assistant token with a loss weight."""
    n = options.max_seq_len
    if options.overlong == "drop":
        return f"{where}: dropped: longer than max_seq_len={n} (data.overlong=drop)"
    return (
        f"{where}: dropped: longer than max_seq_len={n}, and its first {n} tokens hold no trained assistant "
        "token (data.overlong=truncate); raise data.max_seq_len or shorten the conversation before the answer"
    )


def _concat(parts: list, dtype) -> np.ndarray:
    return np.concatenate([np.asarray(p, dtype=dtype) for p in parts]) if parts else np.zeros(0, dtype=dtype)
