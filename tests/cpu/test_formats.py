"""Row formats (OpenAI messages with tools, ShareGPT, alpaca, prompt/completion, renamed fields) and file
kinds (jsonl, json, parquet, HF save_to_disk) all become the same validated conversations."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from moe_sft.data.formats import (
    DataFormatError,
    RowError,
    RowFormat,
    decode_payload,
    file_kind,
    iter_records,
    read_conversations,
    to_conversation,
)

REVERSE = [
    {"role": "user", "content": "Reverse: cat dog sun"},
    {"role": "assistant", "content": "Reversed: sun dog cat"},
]
SYSTEM = {"role": "system", "content": "Be brief."}


def convert(row, fmt=RowFormat(), where="f.jsonl:1"):
    return to_conversation(decode_payload(row, where), fmt, where)


@pytest.mark.parametrize(
    "row",
    [
        {"messages": [SYSTEM, *REVERSE]},
        {
            "conversations": [
                {"from": "human", "value": "Reverse: cat dog sun"},
                {"from": "gpt", "value": "Reversed: sun dog cat"},
            ],
            "system": "Be brief.",
        },
        {"instruction": "Reverse:", "input": "cat dog sun", "output": "Reversed: sun dog cat", "system": "Be brief."},
        {"prompt": "Reverse: cat dog sun", "completion": "Reversed: sun dog cat", "system": "Be brief."},
        {"prompt": [SYSTEM, REVERSE[0]], "completion": [REVERSE[1]]},
        {
            "messages": [
                SYSTEM,
                {
                    "role": "user",
                    "content": [{"type": "text", "text": "Reverse: "}, {"type": "text", "text": "cat dog sun"}],
                },
                REVERSE[1],
            ]
        },
    ],
)
def test_every_format_gives_the_same_conversation(row):
    messages = convert(json.dumps(row).encode()).messages
    expected = [SYSTEM, *REVERSE]
    if "instruction" in row:
        expected = [SYSTEM, {"role": "user", "content": "Reverse:\n\ncat dog sun"}, REVERSE[1]]
    assert messages == expected


def test_tool_calls_and_tools_pass_through():
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": {"x": 1}}}
    tools = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
    row = {
        "messages": [
            REVERSE[0],
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "content": "42", "tool_call_id": "c1"},
            {"role": "assistant", "content": "It is 42.", "weight": 0.5},
        ],
        "tools": json.dumps(tools),
    }  # some datasets store the schemas as a JSON string
    conv = convert(row)
    assert conv.messages[1] == {"role": "assistant", "content": "", "tool_calls": [call]}
    assert conv.messages[2] == {"role": "tool", "content": "42", "tool_call_id": "c1"}
    assert conv.messages[3]["weight"] == 0.5 and conv.tools == tools


def test_renamed_fields_and_forced_format():
    fmt = RowFormat.make("messages", {"messages": "chat", "role": "speaker", "content": "text", "weight": "w"})
    row = {"chat": [{"speaker": "user", "text": "hi"}, {"speaker": "assistant", "text": "hello", "w": 2}]}
    assert convert(row, fmt).messages == [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "hello", "weight": 2},
    ]
    with pytest.raises(RowError, match=r'f\.jsonl:1: "chat" must be a non-empty list') as err:
        convert({"messages": REVERSE}, fmt)
    assert err.value.category == "wrong_shape"
    sharegpt = RowFormat.make("auto", {"conversations": "turns", "from": "speaker", "value": "text"})
    assert convert(
        {"turns": [{"speaker": "human", "text": "hi"}, {"speaker": "gpt", "text": "yo"}]}, sharegpt
    ).messages == [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
    with pytest.raises(ValueError, match=r"data\.fields has unknown keys \['speaker'\]"):
        RowFormat.make("auto", {"speaker": "x"})


@pytest.mark.parametrize(
    "row, category, message",
    [
        (
            {"conversations": [{"from": "human", "value": "hi"}, {"from": "robot", "value": "x"}]},
            "unknown_role",
            r"conversations\[1\]: unknown role 'robot'; ShareGPT roles: system, human",
        ),
        ({"instruction": "x", "output": 3}, "wrong_shape", r'alpaca "output" must be a string, got int'),
        ({"prompt": "x", "completion": None}, "wrong_shape", r'"completion" must be a string or a non-empty list'),
        ({"conversations": [{"from": "human", "value": "hi"}]}, "no_assistant", "conversation has no assistant"),
        ({"messages": REVERSE, "tools": "{not json"}, "wrong_shape", r'"tools" is a string but not JSON'),
    ],
)
def test_format_errors_have_categories(row, category, message):
    with pytest.raises(RowError, match=rf"^f\.jsonl:1: .*{message}") as err:
        convert(row)
    assert err.value.category == category


def _rows():
    return [
        {"messages": [SYSTEM, *REVERSE]},
        {"messages": REVERSE},
        {"messages": [REVERSE[0], {"role": "assistant", "content": "Reversed: sun dog cat", "weight": 0.5}]},
    ]


def test_file_kinds_give_identical_conversations(tmp_path):
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = _rows()
    jsonl = tmp_path / "a.jsonl"
    jsonl.write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    array = tmp_path / "b.json"
    array.write_text(json.dumps(rows, indent=1))
    lines_json = tmp_path / "c.json"  # JSON Lines under a .json name
    lines_json.write_text(jsonl.read_text())
    parquet = tmp_path / "d.parquet"
    pq.write_table(pa.Table.from_pylist(rows), parquet, row_group_size=2)
    hf = tmp_path / "e_hf"
    datasets.Dataset.from_list(rows).save_to_disk(str(hf))
    datasets.DatasetDict({"train": datasets.Dataset.from_list(rows)}).save_to_disk(str(tmp_path / "f_dict"))

    expected = [c.messages for c in read_conversations([jsonl])]
    assert [m["role"] for m in expected[0]] == ["system", "user", "assistant"]
    for path, kind in ((array, "json"), (lines_json, "json"), (parquet, "parquet"), (hf, "hf")):
        assert file_kind(path) == kind
        # arrow fills absent keys with None (e.g. "weight"); conversations drop them
        assert [c.messages for c in read_conversations([path])] == expected, kind
    starts = [i + 1 for i, line in enumerate(array.read_text().splitlines()) if line == " {"]
    assert [line for line, _ in iter_records(array)] == starts == [2, 18, 30]  # where each element starts
    assert [line for line, _ in iter_records(parquet)] == [1, 2, 3]  # 1-based row numbers
    with pytest.raises(DataFormatError, match=r"f_dict: an HF DatasetDict with splits \['train'\]; .*f_dict/train"):
        file_kind(tmp_path / "f_dict")
    assert [c.messages for c in read_conversations([tmp_path / "f_dict" / "train"])] == expected
    assert Path(read_conversations([parquet])[1].source) == Path(f"{parquet}:2")
