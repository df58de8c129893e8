"""Bad data must fail with the file, the line and the fix; overlong rows are truncated or dropped and counted."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from moe_sft.data.chat import TokenizedDoc, tokenize_files
from moe_sft.data.formats import DataFormatError, read_conversations
from moe_sft.data.loader import DataPlanError, PackedBatchPlan

DEMO = Path(__file__).resolve().parents[2] / "recipes" / "demo"
GOOD = {
    "messages": [
        {"role": "user", "content": "Reverse: cat dog sun"},
        {"role": "assistant", "content": "Reversed: sun dog cat"},
    ]
}


def write_rows(path: Path, lines: list[str]) -> Path:
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


@pytest.mark.parametrize(
    "bad_line, expected",
    [
        ('{"messages": [', r"invalid JSON .*one complete JSON object"),
        ('{"conversation": []}', r"""row has no "messages" field \(got \['conversation'\]\).*write rows as"""),
        ('[1, 2]', r'row has no "messages" field \(got list\)'),
        ('{"messages": []}', r'"messages" must be a non-empty list'),
        ('{"messages": [{"content": "hi"}, {"role": "assistant", "content": "x"}]}', r"messages\[0\]: missing role;"),
        ('{"messages": [{"role": "user"}, {"role": "assistant", "content": "x"}]}', r"messages\[0\]: missing content;"),
        ('{"messages": [{"role": "user", "content": "hi"}, {"role": "bot", "content": "x"}]}',
         r"messages\[1\]: unknown role 'bot'; allowed roles: system, user, assistant, tool"),
        ('{"messages": [{"role": "user", "content": ["a", "b"]}, {"role": "assistant", "content": "x"}]}',
         r"messages\[0\]: content must be a string, got list"),
        ('{"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "hi"}]}',
         r"conversation has no assistant message.*add an .*assistant.* turn or remove the row"),
        ('{"messages": ["hello"]}', r"messages\[0\]: must be an object"),
    ],
)
def test_bad_row_names_file_and_line(tmp_path, bad_line, expected):
    # Line 2 is blank and skipped, yet line numbers stay those of the file.
    path = write_rows(tmp_path / "train.jsonl", [json.dumps(GOOD), "", json.dumps(GOOD), bad_line, json.dumps(GOOD)])
    with pytest.raises(DataFormatError, match=rf"^{re.escape(str(path))}:4: {expected}"):
        read_conversations([path])


def test_errors_for_files(tmp_path):
    with pytest.raises(DataFormatError, match=r"missing\.jsonl: no such file"):
        read_conversations([tmp_path / "missing.jsonl"])
    with pytest.raises(DataFormatError, match=r"rows\.parquet: unsupported file type '\.parquet'; supported: \.jsonl"):
        read_conversations([tmp_path / "rows.parquet"])
    empty = write_rows(tmp_path / "empty.jsonl", ["", "  "])
    with pytest.raises(DataFormatError, match=r"empty\.jsonl: the file has no rows"):
        read_conversations([empty])
    with pytest.raises(DataFormatError, match="no data files given"):
        read_conversations([])


def test_good_rows_keep_order_source_and_extra_keys(tmp_path):
    row = {
        "messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a", "reasoning_content": "r"}]
    }
    a = write_rows(tmp_path / "a.jsonl", [json.dumps(GOOD), "", json.dumps(row)])
    b = write_rows(tmp_path / "b.jsonl", [json.dumps(row)])
    convs = read_conversations([a, b])
    assert [c.source for c in convs] == [f"{a}:1", f"{a}:3", f"{b}:1"]
    assert convs[1].messages[1] == {"role": "assistant", "content": "a", "reasoning_content": "r"}
    assert read_conversations(str(a))[0].messages == GOOD["messages"]  # a single path is accepted


def test_overlong_rows_are_truncated_or_dropped_and_counted(tmp_path):
    tok = AutoTokenizer.from_pretrained(str(DEMO / "tokenizer"))
    long_row = {"messages": [{"role": "user", "content": "Reverse: " + " ".join(["cat"] * 40)},
                             {"role": "assistant", "content": "Reversed: " + " ".join(["cat"] * 40)}]}
    prompt_too_long = {
        "messages": [{"role": "user", "content": " ".join(["dog"] * 80)}, {"role": "assistant", "content": "ok"}]
    }
    path = write_rows(tmp_path / "mixed.jsonl", [json.dumps(GOOD), json.dumps(long_row), json.dumps(prompt_too_long)])

    docs, stats = tokenize_files(tok, [path], max_seq_len=64, overlong="truncate")
    # GOOD has 20 tokens (6 to learn); long_row (94 tokens) is cut to 64, keeping 14 of its 43 loss
    # tokens; the third row's answer lies past token 64, so nothing is left to learn: dropped.
    assert [len(d) for d in docs] == [20, 64]
    assert [d.truncated for d in docs] == [False, True]
    assert stats.as_dict() == {"n_rows": 3, "n_truncated": 1, "n_dropped": 1, "n_tokens": 84, "n_loss_tokens": 20}

    docs, stats = tokenize_files(tok, [path], max_seq_len=64, overlong="drop")
    assert [d.source for d in docs] == [f"{path}:1"]
    assert stats.as_dict() == {"n_rows": 3, "n_truncated": 0, "n_dropped": 2, "n_tokens": 20, "n_loss_tokens": 6}


def test_plan_rejects_documents_longer_than_pack_length():
    docs = [
        TokenizedDoc([1] * 8, [True] * 8, source="a.jsonl:1"),
        TokenizedDoc([1] * 30, [True] * 30, source="a.jsonl:2"),
    ]
    with pytest.raises(DataPlanError, match=r"a\.jsonl:2 has 30 tokens > pack_length=16; set max_seq_len <= pack_len"):
        PackedBatchPlan(docs, pack_length=16, global_batch_size=1)
