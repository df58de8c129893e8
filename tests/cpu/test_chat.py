"""Assistant-only masks from the demo tokenizer's chat template: generation markers and prefix diff."""

from __future__ import annotations

import json
from itertools import groupby
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from moe_sft.data.chat import (
    has_generation_markers,
    tokenize_conversation,
    tokenize_files,
)
from moe_sft.data.formats import DataFormatError

DEMO = Path(__file__).resolve().parents[2] / "recipes" / "demo"

CONVERSATION = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "Reverse: cat dog sun"},
    {"role": "assistant", "content": "Reversed: sun dog cat"},
    {"role": "user", "content": "Reverse: owl fox egg"},
    {"role": "assistant", "content": "Reversed: egg fox owl"},
]

# Like Qwen3's template: turns after the last user message get an (empty) think block, earlier
# ones do not, so rendering a prefix is not a prefix of the full render for every cut.
QWEN3_LIKE_TEMPLATE = (
    "{%- set ns = namespace(last_user=-1) -%}"
    "{%- for m in messages -%}"
    "{%- if m['role'] == 'user' -%}{%- set ns.last_user = loop.index0 -%}{%- endif -%}"
    "{%- endfor -%}"
    "{%- for m in messages -%}"
    "{%- if m['role'] == 'assistant' -%}"
    "{{- '<|im_start|>assistant\\n' -}}"
    "{%- if loop.index0 > ns.last_user -%}{{- '<think>\\n\\n</think>\\n\\n' -}}{%- endif -%}"
    "{{- m['content'] + '<|im_end|>\\n' -}}"
    "{%- else -%}{{- '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' -}}{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)


def _load(template: str | None = None):
    tok = AutoTokenizer.from_pretrained(str(DEMO / "tokenizer"))
    if template is not None:
        tok.chat_template = template
    return tok


@pytest.fixture(scope="module")
def tok():
    return _load()


@pytest.fixture(scope="module")
def tok_plain(tok):
    """The demo template with the {% generation %} markers removed: forces the prefix-diff path."""
    plain = tok.chat_template.replace("{%- generation -%}", "").replace("{%- endgeneration -%}", "")
    assert plain != tok.chat_template
    return _load(plain)


def masked_runs(tok, doc) -> list[str]:
    """Decoded text of each maximal run of masked tokens."""
    runs, pos = [], 0
    for masked, group in groupby(doc.assistant_mask):
        n = len(list(group))
        if masked:
            runs.append(tok.decode(doc.input_ids[pos : pos + n], skip_special_tokens=False))
        pos += n
    return runs


def test_demo_tokenizer_is_the_committed_one(tok):
    assert len(tok) == 688
    assert tok.convert_tokens_to_ids(["<|endoftext|>", "<|im_start|>", "<|im_end|>"]) == [0, 1, 2]
    assert tok.eos_token == "<|im_end|>" and tok.pad_token == "<|endoftext|>"
    assert has_generation_markers(tok.chat_template)


@pytest.mark.parametrize("which", ["markers", "prefix_diff"])
def test_mask_is_exactly_assistant_content_and_end_token(tok, tok_plain, which):
    tokenizer = tok if which == "markers" else tok_plain
    doc = tokenize_conversation(tokenizer, CONVERSATION, max_seq_len=1024)
    assert masked_runs(tokenizer, doc) == ["Reversed: sun dog cat<|im_end|>", "Reversed: egg fox owl<|im_end|>"]
    assert len(doc) == 51
    assert [i for i, m in enumerate(doc.assistant_mask) if m] == [24, 25, 26, 27, 28, 29, 44, 45, 46, 47, 48, 49]
    assert doc.num_loss_tokens == 12
    rendered = tok.apply_chat_template(CONVERSATION, tokenize=False)
    assert tokenizer.decode(doc.input_ids, skip_special_tokens=False) == rendered
    assert doc.truncated is False and doc.source == ""


def test_marker_and_prefix_paths_agree_on_demo_data(tok, tok_plain):
    rows = [json.loads(line)["messages"] for line in (DEMO / "data" / "train.jsonl").open()][:150]
    rows.append(  # tool role, non-ASCII content, a system-then-assistant opening
        [
            {"role": "system", "content": "Greet first."},
            {"role": "assistant", "content": "Héllo ✓"},
            {"role": "user", "content": "call the tool"},
            {"role": "tool", "content": '{"ok": true}'},
            {"role": "assistant", "content": ""},
        ]
    )
    n_multi_turn = 0
    for messages in rows:
        a = tokenize_conversation(tok, messages, 1024)
        b = tokenize_conversation(tok_plain, messages, 1024)
        assert a.input_ids == b.input_ids
        assert a.assistant_mask == b.assistant_mask
        expected = [m["content"] + "<|im_end|>" for m in messages if m["role"] == "assistant"]
        assert masked_runs(tok, a) == expected
        n_multi_turn += len(expected) > 1
    assert n_multi_turn > 10  # the demo data does exercise multi-turn rows


def test_prefix_diff_trains_on_template_inserted_think_block():
    tokenizer = _load(QWEN3_LIKE_TEMPLATE)
    assert not has_generation_markers(tokenizer.chat_template)
    doc = tokenize_conversation(tokenizer, CONVERSATION[1:], max_seq_len=1024)
    # The earlier turn is plain; the last one carries the empty think block the model must emit.
    assert masked_runs(tokenizer, doc) == [
        "Reversed: sun dog cat<|im_end|>",
        "<think>\n\n</think>\n\nReversed: egg fox owl<|im_end|>",
    ]


def test_prefix_diff_rejects_templates_that_rewrite_history():
    tokenizer = _load(
        "{%- for m in messages -%}{{- '<|im_start|>' + m['role'] + ' ' + (messages|length)|string + '\\n' "
        "+ m['content'] + '<|im_end|>\\n' -}}{%- endfor -%}"
        "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
    )
    with pytest.raises(DataFormatError, match=r"train\.jsonl:7: .*renders messages\[:1\].*generation"):
        tokenize_conversation(tokenizer, CONVERSATION[1:], 1024, source="train.jsonl:7")


MISTRAL_LIKE_TEMPLATE = (
    "{%- for m in messages -%}"
    "{%- if m['role'] == 'user' -%}{{- '[INST] ' + m['content'] + ' [/INST]' -}}"
    "{%- elif m['role'] == 'assistant' -%}{{- ' ' + m['content'] + eos_token -}}{%- endif -%}"
    "{%- endfor -%}"
)


def test_prefix_diff_end_of_turn_is_eos_or_im_end(tok_plain):
    # Base-model setup (Qwen3 base): eos is <|endoftext|> but ChatML turns end with <|im_end|>.
    base = _load(tok_plain.chat_template)
    base.eos_token = "<|endoftext|>"
    doc = tokenize_conversation(base, CONVERSATION, 1024)
    assert masked_runs(base, doc) == ["Reversed: sun dog cat<|im_end|>", "Reversed: egg fox owl<|im_end|>"]
    # Mistral-style: no ChatML at all, assistant turns end with eos; no generation prompt either.
    mistral = _load(MISTRAL_LIKE_TEMPLATE)
    mistral.eos_token = "<|endoftext|>"
    doc = tokenize_conversation(mistral, CONVERSATION[1:], 1024)
    assert masked_runs(mistral, doc) == [" Reversed: sun dog cat<|endoftext|>", " Reversed: egg fox owl<|endoftext|>"]
    with pytest.raises(DataFormatError, match=r"messages\[1\]: .*not closed by any of \['</s>'\].*end_of_turn"):
        tokenize_conversation(mistral, CONVERSATION[1:], 1024, end_of_turn="</s>")


def test_template_exceptions_name_the_row():
    tokenizer = _load(
        "{%- for m in messages -%}{%- if m['role'] == 'system' -%}{{- raise_exception('System role not supported') -}}"
        "{%- endif -%}{{- m['content'] + eos_token -}}{%- endfor -%}"
    )
    with pytest.raises(DataFormatError, match=r"^a\.jsonl:3: the chat template rejected this row: System role not"):
        tokenize_conversation(tokenizer, CONVERSATION, 1024, source="a.jsonl:3")


def test_truncate_and_drop(tok):
    full = tokenize_conversation(tok, CONVERSATION, 1024)
    cut = tokenize_conversation(tok, CONVERSATION, 40)
    assert cut.truncated and len(cut) == 40
    assert cut.input_ids == full.input_ids[:40] and cut.assistant_mask == full.assistant_mask[:40]
    assert cut.num_loss_tokens == 6  # only the first answer survives
    assert tokenize_conversation(tok, CONVERSATION, 40, overlong="drop") is None
    assert tokenize_conversation(tok, CONVERSATION, 51, overlong="drop").input_ids == full.input_ids
    # Cut before the first answer: nothing left to learn, so the row is dropped.
    assert tokenize_conversation(tok, CONVERSATION, 20) is None
    with pytest.raises(ValueError, match="overlong='pad'"):
        tokenize_conversation(tok, CONVERSATION, 40, overlong="pad")


def test_tokenize_files_counts(tok, tmp_path):
    path = tmp_path / "mini.jsonl"
    path.write_text(
        "\n".join(json.dumps({"messages": m}) for m in (CONVERSATION, CONVERSATION[1:3], CONVERSATION[:3])) + "\n"
    )
    docs, stats = tokenize_files(tok, [path], max_seq_len=40)
    assert [len(d) for d in docs] == [40, 20, 31]
    assert stats.as_dict() == {"n_rows": 3, "n_truncated": 1, "n_dropped": 0, "n_tokens": 91, "n_loss_tokens": 18}
    assert docs[1].source == f"{path}:2"
    docs, stats = tokenize_files(tok, [path], max_seq_len=40, overlong="drop")
    assert stats.as_dict() == {"n_rows": 3, "n_truncated": 0, "n_dropped": 1, "n_tokens": 51, "n_loss_tokens": 12}
