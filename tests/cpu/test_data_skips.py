"""When no row survives (data.on_error=skip with every row bad, or rows dropped by length), the
error lists the first skipped/dropped rows by file:row with their reason, and the counts; the
resume check names the recipe field that changed (trainer.global_batch_size is not a data field)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from moe_sft.config.schema import DataConfig
from moe_sft.data.chat import TokenizedDoc
from moe_sft.data.loader import DataPlanError, PackedLoader
from moe_sft.data.pipeline import build_pipeline

TOKENIZER = Path(__file__).resolve().parents[2] / "recipes" / "demo" / "tokenizer"


def _pipeline(tmp_path: Path, path: Path, **data):
    cfg = DataConfig(
        train_files=[str(path)],
        cache_dir=str(tmp_path / "cache"),
        num_workers=0,
        max_seq_len=64,
        pack_length=64,
        prefetch=False,
        **data,
    )
    return build_pipeline(cfg, tokenizer_path=str(TOKENIZER), global_batch_size=1, log=lambda m: None)


def test_every_row_skipped_lists_the_first_ten_with_file_row_and_reason(tmp_path):
    bad = ['{"messages": [', "[1, 2]", '{"messages": []}'] * 4  # 12 rows, 4 of each category
    path = tmp_path / "bad.jsonl"
    path.write_text("\n".join(bad) + "\n")
    with pytest.raises(DataPlanError) as err:
        _pipeline(tmp_path, path, on_error="skip")
    message = " ".join(str(err.value).split())  # as the CLI prints it: one line
    assert message.startswith("no documents to train on: 12 rows read from 1 file(s), none kept; 12 skipped")
    assert "invalid_json 4" in message and "data.on_error=skip" in message
    assert f"{path}:1: invalid JSON" in message and f"{path}:2: a row must be a JSON object" in message
    assert f"{path}:10: " in message and f"{path}:11:" not in message  # the first 10, then the count
    assert "and 2 more" in message and re.search(r"every row: \S+report\.jsonl", message)


def test_a_long_row_with_its_answer_past_max_seq_len_is_listed_as_dropped(tmp_path):
    # A long prompt (the was 5 MB; 200 kB is the same path, faster): truncated to
    # max_seq_len=64 no assistant token is left, so the row is dropped.
    row = {"messages": [{"role": "user", "content": "dog " * 50_000}, {"role": "assistant", "content": "ok"}]}
    path = tmp_path / "huge.jsonl"
    path.write_text(json.dumps(row) + "\n")
    with pytest.raises(DataPlanError) as err:
        _pipeline(tmp_path, path, overlong="truncate")
    message = " ".join(str(err.value).split())
    assert "1 rows read from 1 file(s), none kept; 1 dropped" in message
    assert (
        f"{path}:1: dropped: longer than max_seq_len=64, and its first 64 tokens hold no trained assistant "
        "token (data.overlong=truncate)"
    ) in message


def test_resume_names_trainer_global_batch_size():
    docs = [TokenizedDoc(list(range(8)), [0.0] * 4 + [1.0] * 4, f"d{i}") for i in range(16)]
    state = PackedLoader(docs, pack_length=16, global_batch_size=2, prefetch=False).state_dict()
    other = PackedLoader(docs, pack_length=16, global_batch_size=4, prefetch=False)
    with pytest.raises(
        DataPlanError, match=r"^trainer\.global_batch_size=4 but the checkpoint was saved with global_batch_size=2 "
    ):
        other.load_state_dict(state)
