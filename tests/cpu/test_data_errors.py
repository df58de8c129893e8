"""Bad data: each bad row is named by file and line, counted by category, and either stops the run
(data.on_error=fail) or is skipped and reported (skip); overlong rows are truncated or dropped and counted."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from moe_sft.data.chat import TokenizedDoc, tokenize_files
from moe_sft.data.formats import (
    DataFormatError,
    RowError,
    RowFormat,
    decode_payload,
    iter_records,
    read_conversations,
    to_conversation,
)
from moe_sft.data.loader import DataPlanError, PackedLoader

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
        (
            '{"conversation": []}',
            r"""row matches no known format \(keys \['conversation'\]\); expected "messages" \(OpenAI""",
        ),
        ("[1, 2]", r"a row must be a JSON object, got list"),
        ('{"messages": []}', r'"messages" must be a non-empty list'),
        ('{"messages": [{"content": "hi"}, {"role": "assistant", "content": "x"}]}', r"messages\[0\]: missing role;"),
        ('{"messages": [{"role": "user"}, {"role": "assistant", "content": "x"}]}', r"messages\[0\]: missing content;"),
        (
            '{"messages": [{"role": "user", "content": "hi"}, {"role": "bot", "content": "x"}]}',
            r"messages\[1\]: unknown role 'bot'; allowed roles: system, user, assistant, tool",
        ),
        (
            '{"messages": [{"role": "user", "content": ["a", "b"]}, {"role": "assistant", "content": "x"}]}',
            r"messages\[0\]: content must be a string or a list of .*text.* parts, got list",
        ),
        (
            '{"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "hi"}]}',
            r"conversation has no assistant message.*add an .*assistant.* turn or remove the row",
        ),
        ('{"messages": ["hello"]}', r"messages\[0\]: must be an object"),
        (
            '{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": " "}]}',
            r"messages\[1\] is an assistant message with empty content \(and no tool_calls\)",
        ),
        (
            '{"messages": [{"role": "user", "content": "hi", "weight": 1}, {"role": "assistant", "content": "x"}]}',
            r"messages\[0\] \(user\) has a weight; weights apply to assistant messages only",
        ),
        (
            '{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "x", "weight": "1"}]}',
            r"messages\[1\] weight='1' must be a number >= 0",
        ),
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
    with pytest.raises(DataFormatError, match=r"rows\.csv: unsupported file type '\.csv'; supported: \.jsonl, \.json"):
        read_conversations([tmp_path / "rows.csv"])
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
    long_row = {
        "messages": [
            {"role": "user", "content": "Reverse: " + " ".join(["cat"] * 40)},
            {"role": "assistant", "content": "Reversed: " + " ".join(["cat"] * 40)},
        ]
    }
    prompt_too_long = {
        "messages": [{"role": "user", "content": " ".join(["dog"] * 80)}, {"role": "assistant", "content": "ok"}]
    }
    path = write_rows(tmp_path / "mixed.jsonl", [json.dumps(GOOD), json.dumps(long_row), json.dumps(prompt_too_long)])

    docs, stats = tokenize_files(tok, [path], max_seq_len=64, overlong="truncate")
    # GOOD has 20 tokens (6 to learn); long_row (94 tokens) is cut to 64, keeping 14 of its 43 loss
    # tokens; the third row's answer lies past token 64, so nothing is left to learn: dropped.
    assert [len(d) for d in docs] == [20, 64]
    assert [d.truncated for d in docs] == [False, True]
    counts = ("rows", "samples", "truncated", "dropped", "tokens", "loss_tokens")
    assert tuple(getattr(stats, c) for c in counts) == (3, 2, 1, 1, 84, 20)

    docs, stats = tokenize_files(tok, [path], max_seq_len=64, overlong="drop")
    assert [d.source for d in docs] == [f"{path}:1"]
    assert tuple(getattr(stats, c) for c in counts) == (3, 1, 0, 2, 20, 6)


def test_plan_rejects_documents_longer_than_pack_length():
    docs = [
        TokenizedDoc([1] * 8, [True] * 8, source="a.jsonl:1"),
        TokenizedDoc([1] * 30, [True] * 30, source="a.jsonl:2"),
    ]
    with pytest.raises(DataPlanError, match=r"a\.jsonl:2 has 30 tokens > pack_length=16; set max_seq_len <= pack_len"):
        PackedLoader(docs, pack_length=16, global_batch_size=1)


# ----------------------------------------------------------------------------- skip-and-report vs fail-fast


def _msgs(*pairs, **extra):
    return {"messages": [dict({"role": r, "content": c}, **extra.get(str(i), {})) for i, (r, c) in enumerate(pairs)]}


def _bad_file(path: Path) -> tuple[Path, dict[str, int]]:
    """Good rows with one bad row per category in between; returns the file and category -> line."""
    good = json.dumps(GOOD).encode()
    rows = [
        ("good", good),
        ("invalid_json", b'{"messages": ['),
        ("wrong_shape", b'{"text": "plain pretraining text"}'),
        ("unknown_role", json.dumps(_msgs(("user", "hi"), ("bot", "x"))).encode()),
        ("good", good),
        ("empty_assistant", json.dumps(_msgs(("user", "hi"), ("assistant", ""))).encode()),
        ("no_assistant", json.dumps(_msgs(("system", "s"), ("user", "hi"))).encode()),
        ("template_error", json.dumps(_msgs(("assistant", "I start"), ("user", "hi"), ("assistant", "x"))).encode()),
        ("no_trainable_tokens", json.dumps(_msgs(("user", "hi"), ("assistant", "x"), **{"1": {"weight": 0}})).encode()),
        ("non_utf8", b'{"messages": [{"role": "user", "content": "caf\xe9"}, {"role": "assistant", "content": "ok"}]}'),
        ("truncated", json.dumps(_msgs(("user", "Reverse: cat"), ("assistant", " ".join(["cat"] * 60)))).encode()),
        ("dropped", json.dumps(_msgs(("user", " ".join(["dog"] * 80)), ("assistant", "ok"))).encode()),
        ("good", good),
    ]
    path.write_bytes(b"\n".join(raw for _, raw in rows) + b"\n")
    return path, {kind: i + 1 for i, (kind, _) in enumerate(rows) if kind != "good"}


@pytest.fixture(scope="module")
def plain_template(tmp_path_factory):
    """The demo template without generation markers (a recipe's data.chat_template file): its prefix
    diff cannot place an opening assistant message, which gives a template_error row."""
    tok = AutoTokenizer.from_pretrained(str(DEMO / "tokenizer"))
    path = tmp_path_factory.mktemp("tpl") / "plain.jinja"
    path.write_text(tok.chat_template.replace("{%- generation -%}", "").replace("{%- endgeneration -%}", ""))
    return path


def _spec(template_file: Path, max_seq_len: int = 48):
    from moe_sft.data.cache import CacheSpec
    from moe_sft.data.chat import ChatOptions, read_chat_template

    return CacheSpec(
        str(DEMO / "tokenizer"), ChatOptions(max_seq_len, "truncate", chat_template=read_chat_template(template_file))
    )


def test_every_bad_row_is_counted_and_reported_with_file_and_line(tmp_path, plain_template):
    from moe_sft.data.cache import open_or_build
    from moe_sft.data.formats import ROW_ERRORS
    from moe_sft.data.stats import format_summary

    path, lines = _bad_file(tmp_path / "mixed.jsonl")
    cache = open_or_build(path, _spec(plain_template), tmp_path / "cache", on_error="skip", log=lambda m: None)
    stats = cache.stats
    assert stats.errors == {c: 1 for c in ROW_ERRORS}
    assert (stats.rows, stats.samples, stats.truncated, stats.dropped) == (13, 4, 1, 1)
    assert cache.lines.tolist() == [1, 5, 11, 13]  # kept rows keep their line numbers
    for category in ROW_ERRORS:
        assert stats.examples[category][0].startswith(f"{path}:{lines[category]}: "), (category, stats.examples)
    report = [json.loads(line) for line in (cache.dir / "report.jsonl").read_text().splitlines()]
    assert {r["kind"]: r["where"] for r in report} == {k: f"{path}:{n}" for k, n in lines.items()}
    assert "not valid UTF-8" in next(r["message"] for r in report if r["kind"] == "non_utf8")
    summary = "\n".join(format_summary("train data", stats, 1, [str(cache.dir / "report.jsonl")]))
    assert "13 rows -> 4 samples" in summary and "skipped 8" in summary and "truncated 1, dropped 1" in summary
    assert "invalid_json 1, non_utf8 1, wrong_shape 1" in summary and f"{path}:{lines['unknown_role']}: " in summary
    assert str(cache.dir / "report.jsonl") in summary

    # The same cache under on_error=fail: the run stops, naming the first bad row and the full list.
    with pytest.raises(DataFormatError, match=rf"^{re.escape(str(path))}:2: invalid JSON.*8 bad rows in .*report"):
        open_or_build(path, _spec(plain_template), tmp_path / "cache", on_error="fail", log=lambda m: None)


def test_fail_fast_stops_at_the_first_bad_row_and_writes_no_cache(tmp_path, plain_template):
    from moe_sft.data.cache import cache_dir_for, open_or_build

    path, _ = _bad_file(tmp_path / "mixed.jsonl")
    with pytest.raises(DataFormatError, match=rf"^{re.escape(str(path))}:2: invalid JSON .*data\.on_error=skip"):
        open_or_build(path, _spec(plain_template), tmp_path / "cache", on_error="fail", log=lambda m: None)
    final = cache_dir_for(path, _spec(plain_template), tmp_path / "cache")
    assert not final.exists() and not final.with_name(final.name + ".lock").exists()
    assert "invalid JSON" in json.loads(final.with_name(final.name + ".failed").read_text())["message"]
    assert [p.name for p in (tmp_path / "cache").iterdir()] == [final.name + ".failed"]  # no temp dir left


def test_json_array_file_reports_bad_elements_by_line(tmp_path):
    good = json.dumps(GOOD, indent=1)
    path = tmp_path / "rows.json"
    path.write_bytes(
        b"[\n"
        + good.encode()
        + b",\n"
        + b'{"messages": [{"role": "user", "content": "caf\xe9"}]},\n'
        + b'"just a string",\n'
        + good.encode()
        + b"\n]\n"
    )
    rows = list(iter_records(path))
    assert [line for line, _ in rows] == [2, 14, 15, 16]  # the good row spans lines 2-13
    assert isinstance(rows[1][1], RowError) and rows[1][1].category == "non_utf8"
    with pytest.raises(RowError, match=rf"^{re.escape(str(path))}:15: a row must be a JSON object, got str"):
        to_conversation(decode_payload(rows[2][1], f"{path}:15"), RowFormat(), f"{path}:15")
    broken = tmp_path / "broken.json"
    broken.write_text("[\n" + good + ",\n{oops}\n]")
    records = list(iter_records(broken))
    assert records[-1][1].category == "invalid_json" and str(records[-1][1]).startswith(f"{broken}:14: invalid JSON")


@pytest.mark.parametrize("reasoning_key", ["reasoning_content", "thinking"])  # thinking: gpt-oss's field
def test_an_assistant_turn_with_only_reasoning_is_a_row_and_empty_ones_are_errors(reasoning_key):
    only_reasoning = _msgs(("user", "hi"), ("assistant", ""), **{"1": {reasoning_key: "think first"}})
    messages = to_conversation(only_reasoning, RowFormat(), "f.jsonl:1").messages
    assert messages[1] == {"role": "assistant", "content": "", reasoning_key: "think first"}
    with pytest.raises(RowError, match="f.jsonl:2: messages\\[1\\] is an assistant message with empty content"):
        to_conversation(_msgs(("user", "hi"), ("assistant", "")), RowFormat(), "f.jsonl:2")
