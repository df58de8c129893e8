"""Data fault paths a user meets (issue 42): a row holding a lone UTF-16 surrogate is a bad row like any
other (skipped and reported, or the first error, naming file:line and the field), a tokenizer without a
chat template is one error naming its directory and the fix, and a damaged token cache (truncated,
garbled meta.json, ids outside the vocabulary) is refused naming the cache and the fix instead of an
unlocated error or silently wrong training."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from moe_sft.config.schema import DataConfig
from moe_sft.data.cache import CacheSpec, FileCache, open_or_build
from moe_sft.data.chat import ChatOptions, tokenize_conversation
from moe_sft.data.formats import DataFormatError
from moe_sft.data.pipeline import build_pipeline

TOKENIZER = Path(__file__).resolve().parents[2] / "recipes" / "demo" / "tokenizer"
GOOD = {"messages": [{"role": "user", "content": "Reverse: a b"}, {"role": "assistant", "content": "b a"}]}


def _rows(path: Path, lines: list[str]) -> Path:
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def _pipeline(tmp_path: Path, path: Path, tokenizer: Path = TOKENIZER, vocab_size: int | None = None, **data):
    cfg = DataConfig(
        train_files=[str(path)],
        cache_dir=str(tmp_path / "cache"),
        num_workers=0,
        max_seq_len=64,
        pack_length=64,
        prefetch=False,
        **data,
    )
    return build_pipeline(
        cfg, tokenizer_path=str(tokenizer), global_batch_size=1, log=lambda m: None, vocab_size=vocab_size
    )


# A lone high surrogate, as JSON writes it (json.dumps("\ud800") gives this escape).
SURROGATE_ROW = '{"messages": [{"role": "user", "content": "hi \\ud800"}, {"role": "assistant", "content": "ok"}]}'


def test_a_lone_surrogate_is_a_bad_row_skipped_or_reported(tmp_path):
    good = json.dumps(GOOD)
    path = _rows(tmp_path / "sur.jsonl", [good, SURROGATE_ROW, good])
    data = _pipeline(tmp_path, path, on_error="skip")
    store = data.train.store
    assert store.sizes == [2] and store.caches[0].stats.n_errors == 1
    report = (store.caches[0].dir / "report.jsonl").read_text().splitlines()
    (entry,) = [json.loads(line) for line in report]
    assert entry["where"] == f"{path}:2" and entry["kind"] == "non_utf8"
    assert "messages[0].content holds a lone surrogate U+D800 at character 3" in entry["message"]
    with pytest.raises(DataFormatError, match=rf"^{path}:2: messages\[0\]\.content holds a lone surrogate U\+D800"):
        _pipeline(tmp_path / "fail", path, on_error="fail")
    # A surrogate *pair* is one character and a good row.
    pair = '{"messages": [{"role": "user", "content": "\\ud83d\\ude00"}, {"role": "assistant", "content": "ok"}]}'
    assert _pipeline(tmp_path / "pair", _rows(tmp_path / "pair.jsonl", [pair])).train.store.sizes == [1]


def test_a_lone_surrogate_in_a_json_array_file(tmp_path):
    path = tmp_path / "rows.json"
    path.write_text("[\n" + json.dumps(GOOD) + ",\n" + SURROGATE_ROW + "\n]\n", encoding="utf-8")
    data = _pipeline(tmp_path, path, on_error="skip")
    assert data.train.store.sizes == [1] and data.train.store.caches[0].stats.n_errors == 1


def _no_template_tokenizer(tmp_path: Path) -> Path:
    tok = tmp_path / "base_tokenizer"
    shutil.copytree(TOKENIZER, tok)
    (tok / "chat_template.jinja").unlink(missing_ok=True)
    config = json.loads((tok / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (tok / "tokenizer_config.json").write_text(json.dumps(config))
    return tok


def test_a_tokenizer_without_a_chat_template_is_one_error_naming_it(tmp_path):
    tok = _no_template_tokenizer(tmp_path)
    path = _rows(tmp_path / "rows.jsonl", [json.dumps(GOOD)] * 3)
    for on_error in ("fail", "skip"):
        with pytest.raises(DataFormatError) as err:
            _pipeline(tmp_path / on_error, path, tokenizer=tok, on_error=on_error)
        message = str(err.value)
        assert "\n" not in message and type(err.value) is DataFormatError
        assert message.startswith(f"tokenizer {tok} has no chat template")
        assert "data.tokenizer_path" in message and "data.chat_template" in message
    # A template file named by the recipe is the fix.
    template = tmp_path / "t.jinja"
    template.write_text((TOKENIZER / "chat_template.jinja").read_text())
    assert _pipeline(tmp_path / "fixed", path, tokenizer=tok, chat_template=str(template)).train.store.sizes == [3]
    # The in-memory path says the same.
    from transformers import AutoTokenizer

    with pytest.raises(DataFormatError, match=r"has no chat template"):
        tokenize_conversation(AutoTokenizer.from_pretrained(str(tok)), GOOD["messages"], 64)


@pytest.fixture
def cache(tmp_path) -> FileCache:
    path = _rows(tmp_path / "rows.jsonl", [json.dumps(GOOD)] * 5)
    return open_or_build(path, CacheSpec(str(TOKENIZER), ChatOptions(64)), tmp_path / "c", num_workers=0, log=print)


def _reopen(cache: FileCache, **kw) -> FileCache:
    return FileCache(cache.dir, **kw)


@pytest.mark.parametrize("name", ["tokens.u32", "weights.f32", "offsets.i64", "lines.i64", "loss.f64"])
def test_a_truncated_cache_is_refused_naming_it(cache, name):
    path = cache.dir / name
    data = path.read_bytes()
    path.write_bytes(data[: len(data) - 3])  # a copy cut short, not even a whole entry
    with pytest.raises(DataFormatError) as err:
        _reopen(cache)
    message = str(err.value)
    assert message.startswith(f"data cache {cache.dir} is damaged: {name} holds {len(data) - 3:,} bytes")
    assert "delete that directory and it is rebuilt" in message
    path.unlink()
    with pytest.raises(DataFormatError, match=rf"{name} is missing"):
        _reopen(cache)


def test_a_garbled_meta_is_refused_naming_the_cache(cache):
    (cache.dir / "meta.json").write_text('{"version": 2, "sou')
    with pytest.raises(DataFormatError, match=r"data cache .* is damaged: meta\.json cannot be read .*delete that"):
        _reopen(cache)


def test_out_of_range_ids_are_refused_naming_the_cache_and_the_row(cache):
    vocab = cache.meta["vocab_size"]
    assert cache.meta["max_id"] == int(np.max(cache.tokens)) < vocab
    tokens = np.fromfile(cache.dir / "tokens.u32", dtype=np.uint32)
    second = int(cache.offsets[1])  # the second document's first token
    tokens[second + 1] = vocab + 7  # a corrupted file: meta.json still says the ids are in range
    tokens.tofile(cache.dir / "tokens.u32")
    damaged = _reopen(cache)
    damaged.doc(0)
    with pytest.raises(DataFormatError) as err:
        damaged.doc(1)
    message = str(err.value)
    assert f"tokens.u32 holds token id {vocab + 7} in the document of {cache.source}:2" in message
    assert f"({vocab} ids): the cache is corrupt; delete that directory" in message


def test_a_cache_with_ids_past_the_models_vocabulary_is_refused(tmp_path):
    path = _rows(tmp_path / "rows.jsonl", [json.dumps(GOOD)] * 5)
    data = _pipeline(tmp_path, path)
    max_id = data.train.store.caches[0].meta["max_id"]
    # The model's embedding has fewer rows than the ids the tokenizer wrote: refused before training.
    with pytest.raises(DataFormatError) as err:
        _pipeline(tmp_path, path, vocab_size=max_id)
    message = str(err.value)
    assert f"token id {max_id} in a document is outside the model's vocabulary ({max_id} ids" in message
    assert f"the tokenizer ({TOKENIZER}" in message and "set data.tokenizer_path to the model's tokenizer" in message
    assert _pipeline(tmp_path, path, vocab_size=max_id + 1).train.store.sizes == [5]
